"""How the reference model writes KV rows into a ``DevicePool`` and reads context back.

Rows are addressed by slot id (``page_id * page_size + offset``). A batch of
rows carries one ``hicache.provenance.Row`` code per row; only ``VALID`` rows
reach the pool, padding rows (``STATIC_PAD``) may carry any slot id (``-1`` by
convention) and are dropped.
"""
from __future__ import annotations

from typing import Mapping

import torch

from hicache.errors import ProvenanceError
from hicache.pools import DevicePool
from hicache.provenance import Row, check_provenance

try:  # hicache's store kernel (Triton on CUDA, plain torch on CPU)
    from hicache.kernels.page_copy import store_rows as _store_rows
except ImportError:  # pragma: no cover - platforms without Triton
    _store_rows = None


def plane_names(pool: DevicePool, layer: int, draft: bool) -> list[str]:
    """Names of the KV planes of one layer, without the ``draft_`` prefix."""
    return [s.name[6:] if draft else s.name for s in pool.layout.planes_of_layer(layer, draft)]


def write_kv(pool: DevicePool, layer: int, rows: Mapping[str, torch.Tensor], slot_ids: torch.Tensor,
             provenance: torch.Tensor, *, draft: bool = False) -> int:
    """Store the ``VALID`` rows of ``rows`` (plane name -> ``[n, *row_shape]``) at ``slot_ids``.

    Mutates the pool's plane buffers of ``layer`` (the draft planes when
    ``draft``); returns the number of rows written. Rows are cast to the
    plane's storage dtype. Raises ``ProvenanceError`` when ``provenance`` does
    not have one code per row or a ``VALID`` row has no slot.
    """
    names = plane_names(pool, layer, draft)
    if not names:
        raise ProvenanceError(f"write_kv: the layout has no {'draft ' if draft else ''}layer {layer} "
                              f"(num_layers={pool.layout.num_layers}, draft_layers={pool.layout.draft_layers})")
    if sorted(rows) != sorted(names):
        raise ProvenanceError(f"write_kv(layer={layer}, draft={draft}) got planes {sorted(rows)}, "
                              f"the layout has {sorted(names)}")
    n = int(slot_ids.numel())
    check_provenance(n, provenance)
    keep = provenance == Row.VALID
    dst = slot_ids[keep]
    if dst.numel() == 0:
        return 0
    limit = pool.num_pages * pool.page_size
    if int(dst.min()) < 0 or int(dst.max()) >= limit:
        raise ProvenanceError(f"VALID rows need slot ids in [0, {limit}), got [{int(dst.min())}, "
                              f"{int(dst.max())}]")
    specs = pool.layout.planes_of_layer(layer, draft)
    src = []
    for spec, name in zip(specs, names):
        r = rows[name]
        if tuple(r.shape) != (n, *spec.row_shape):
            raise ProvenanceError(f"plane {spec.name!r} layer {layer}: rows of shape {tuple(r.shape)}, "
                                  f"expected {(n, *spec.row_shape)}")
        src.append(r.to(spec.dtype).contiguous())
    if _store_rows is not None:
        _store_rows(pool, [s.index for s in specs], src, slot_ids, provenance.to(pool.device))
    else:  # pragma: no cover
        for spec, r in zip(specs, src):
            pool.buffers[spec.index].index_copy_(0, dst.to(pool.device), r[keep])
    return int(dst.numel())


def gather_context(pool: DevicePool, layer: int, slot_ids: torch.Tensor, length: int,
                   dtype: torch.dtype, *, draft: bool = False) -> dict[str, torch.Tensor]:
    """Rows of ``slot_ids`` (the context's page table, in token order) from every plane of
    ``layer``, zero-padded to ``length`` rows. Returns fresh tensors (copies)."""
    n = int(slot_ids.numel())
    assert n <= length, (n, length)
    prefix = "draft_" if draft else ""
    out = {}
    for name in plane_names(pool, layer, draft):
        buf = pool.plane(prefix + name, layer)
        t = torch.zeros((length, *buf.shape[1:]), dtype=dtype, device=buf.device)
        if n:
            t[:n] = buf.index_select(0, slot_ids)
        out[name] = t
    return out
