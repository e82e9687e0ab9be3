"""How the reference model writes KV rows into a ``DevicePool`` and reads context back.

Rows are addressed by slot id (``page_id * page_size + offset``). A batch of
rows carries one ``hicache.core.types.Row`` code per row; only ``VALID`` rows
reach the pool, padding rows (``STATIC_PAD``) may carry any slot id (``-1`` by
convention) and are dropped.

Two ways in. ``write_kv`` checks everything at every call; on a GPU each check
is a host sync (and ``store_rows`` adds its own), which is what a slow decode
step is made of. The fast path validates a batch once, on the host, where the
page table and provenance are built (``check_rows``), uploads it once
(``to_device``: pinned, non-blocking) and hands the ``RowBatch`` to
``write_rows`` in every layer: no host sync per layer, nothing left unchecked.
"""
from __future__ import annotations

from typing import Mapping, NamedTuple

import torch

from hicache.core.errors import InvalidArgument, PoolError, ProvenanceError
from hicache.memory.pools import DevicePool
from hicache.core.types import Row, check_provenance

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


class RowBatch(NamedTuple):
    """Where one batch of rows goes, validated by ``check_rows``; tensors on the pool's device.

    Read-only: build one per forward pass (per tile) and reuse it in every layer.
    Valid for the pool it was checked against, as long as the caller owns the slots.
    """

    num_rows: int  # rows in the batch, VALID or not
    dst: torch.Tensor  # [valid] int64: slot of each VALID row, in row order
    keep: torch.Tensor | None  # [valid] int64: index of each VALID row; None when every row is VALID

    @property
    def valid(self) -> int:
        return int(self.dst.numel())


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` on ``device``; a CPU tensor bound for a GPU travels pinned and
    non-blocking (no host sync; the caching host allocator keeps the staging
    buffer alive until the copy is done). Returns ``t`` itself when already there."""
    if t.device == device or (device.type == t.device.type == "cuda" and device.index is None):
        return t
    if t.device.type == "cpu" and device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def check_slot_bounds(pool: DevicePool, slot_ids: torch.Tensor, what: str) -> None:
    """Raise ``PoolError`` unless every id of ``slot_ids`` (host tensor) addresses a row of ``pool``."""
    if slot_ids.device.type != "cpu":
        raise InvalidArgument(f"{what}: slot ids are checked on the host, got a tensor on {slot_ids.device}")
    limit = pool.num_pages * pool.page_size
    if slot_ids.numel():
        lo, hi = (int(x) for x in torch.aminmax(slot_ids))
        if lo < 0 or hi >= limit:
            raise PoolError(f"{what}: slot ids span [{lo}, {hi}], the pool has slots [0, {limit}) "
                            f"({pool.num_pages} pages x {pool.page_size}); fix the page table")


def check_rows(pool: DevicePool, slot_ids: torch.Tensor, provenance: torch.Tensor, *,
               device_slots: torch.Tensor | None = None) -> RowBatch:
    """Validate one batch on the host and return its ``RowBatch`` on the pool's device.

    ``slot_ids`` (int64) and ``provenance`` (``Row`` codes) are host tensors
    with one entry per row. Checks what ``write_kv`` checks at every call:
    ``check_provenance`` (lengths, codes) and VALID slots inside the pool; and
    also that no two VALID rows share a slot. ``device_slots``: the same ids
    already on the pool's device (saves the upload). Raises ``ProvenanceError``.
    Does not mutate anything; the only device work is the non-blocking upload.
    """
    if slot_ids.device.type != "cpu" or provenance.device.type != "cpu":
        raise ValueError(f"check_rows validates on the host: got slot_ids on {slot_ids.device}, "
                         f"provenance on {provenance.device}; pass CPU tensors")
    if slot_ids.dim() != 1:
        raise ProvenanceError(f"slot_ids must be 1-D, got shape {tuple(slot_ids.shape)}")
    slot_ids = slot_ids.to(torch.int64)
    n = int(slot_ids.numel())
    valid = check_provenance(n, provenance)
    keep = None if valid == n else (provenance == Row.VALID).nonzero().squeeze(1)
    dst = slot_ids if keep is None else slot_ids[keep]
    limit = pool.num_pages * pool.page_size
    if dst.numel():
        lo, hi = (int(x) for x in torch.aminmax(dst))
        if lo < 0 or hi >= limit:
            raise ProvenanceError(f"VALID rows need slot ids in [0, {limit}), got [{lo}, {hi}]")
        if torch.unique(dst).numel() != dst.numel():
            raise ProvenanceError(f"two VALID rows share a slot id ({dst.tolist()[:16]}...); "
                                  "each row needs its own slot")
    dev = pool.device
    if keep is None:
        dst_dev = device_slots if device_slots is not None else to_device(dst, dev)
        return RowBatch(n, dst_dev, None)
    keep_dev = to_device(keep, dev)
    dst_dev = device_slots.index_select(0, keep_dev) if device_slots is not None else to_device(dst, dev)
    return RowBatch(n, dst_dev, keep_dev)


def write_rows(pool: DevicePool, layer: int, rows: Mapping[str, torch.Tensor], batch: RowBatch, *,
               draft: bool = False) -> int:
    """``write_kv`` for a batch already validated by ``check_rows``: no host sync.

    Mutates the pool's plane buffers of ``layer`` (asynchronous on the current
    stream on a GPU). Plane names and row shapes are still checked (host
    metadata only); returns the number of rows written. Rows are cast to the
    plane's storage dtype and scattered with one ``index_copy_`` per plane
    (``store_rows`` would re-validate and rebuild its address table: 4 syncs).
    """
    specs = pool.layout.planes_of_layer(layer, draft)
    names = plane_names(pool, layer, draft)
    if not names or sorted(rows) != sorted(names):
        raise ProvenanceError(f"write_rows(layer={layer}, draft={draft}) got planes {sorted(rows)}, "
                              f"the layout has {sorted(names)}")
    for spec, name in zip(specs, names):
        r = rows[name]
        if tuple(r.shape) != (batch.num_rows, *spec.row_shape):
            raise ProvenanceError(f"plane {spec.name!r} layer {layer}: rows of shape {tuple(r.shape)}, "
                                  f"expected {(batch.num_rows, *spec.row_shape)}")
        if batch.keep is not None:
            r = r.index_select(0, batch.keep)
        pool.buffers[spec.index].index_copy_(0, batch.dst, r.to(spec.dtype))
    return batch.valid


def gather_context(pool: DevicePool, layer: int, slot_ids: torch.Tensor, length: int,
                   dtype: torch.dtype, *, draft: bool = False) -> dict[str, torch.Tensor]:
    """Rows of ``slot_ids`` (the context's page table, in token order) from every plane of
    ``layer``, zero-padded to ``length`` rows. Returns fresh tensors (copies)."""
    n = int(slot_ids.numel())
    if n > length:
        raise InvalidArgument(f"gather_context: {n} slot ids do not fit in length={length} rows")
    prefix = "draft_" if draft else ""
    out = {}
    for name in plane_names(pool, layer, draft):
        buf = pool.plane(prefix + name, layer)
        if n == length and buf.dtype == dtype:  # no padding: skip the zero fill and second copy
            out[name] = buf.index_select(0, slot_ids)
            continue
        t = torch.zeros((length, *buf.shape[1:]), dtype=dtype, device=buf.device)
        if n:
            t[:n] = buf.index_select(0, slot_ids)
        out[name] = t
    return out
