"""Plain-torch page copy and row store: the CPU path and the kernels' reference.

Byte-exact by construction: every plane is viewed as ``uint8 [pages, page_bytes]``
(or ``[rows, row_bytes]``) and moved with ``index_select`` / ``index_copy_``,
so no payload is ever converted.
"""
from __future__ import annotations

from typing import Sequence

import torch

from hicache.memory.pools import DevicePool, HostPool
from hicache.core.provenance import Row

Pool = DevicePool | HostPool


def plane_pages(pool: Pool, plane: int) -> torch.Tensor:
    """``uint8 [num_pages, *dims]`` view (no copy) of one plane of a pool, row-major in canonical
    page order: ``[num_pages, page_bytes]`` except for an adopted engine's strided page views."""
    nbytes = pool.layout.planes[plane].page_bytes
    if isinstance(pool, DevicePool):
        return pool.byte_pages(plane)
    return pool.buffer.as_strided((pool.num_pages, nbytes), (pool.page_stride[plane], 1),
                                  pool.buffer.storage_offset() + pool.plane_offset[plane])


def torch_copy(src: Pool, dst: Pool, src_pages: torch.Tensor, dst_pages: torch.Tensor,
               planes: Sequence[int]) -> None:
    """Copy page ``src_pages[k]`` of ``src`` to page ``dst_pages[k]`` of ``dst`` on ``planes``.

    Mutates ``dst`` only. Synchronous whenever the two pools live on different devices.
    """
    s_idx = src_pages.to(_device(src))
    d_idx = dst_pages.to(_device(dst))
    for j in planes:
        a, b = plane_pages(src, j), plane_pages(dst, j)
        width = min(_width(a), _width(b))  # move 8-byte words where both sides allow: not byte by byte
        a, b = _as_words(a, width), _as_words(b, width)
        rows = a.index_select(0, s_idx)
        b.index_copy_(0, d_idx, rows.to(_device(dst)).view(-1, *b.shape[1:]))


_WORDS = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


def _width(t: torch.Tensor) -> int:
    """Widest word (bytes) that divides ``t``'s last dim, its other strides and its offset."""
    for w in (8, 4, 2):
        if t.shape[-1] % w == 0 and t.storage_offset() % w == 0 and all(x % w == 0 for x in t.stride()[:-1]):
            return w
    return 1


def _as_words(t: torch.Tensor, width: int) -> torch.Tensor:
    return t if width == 1 else t.view(_WORDS[width])


def torch_store(pool: DevicePool, plane_indices: Sequence[int], rows: Sequence[torch.Tensor],
                slot_ids: torch.Tensor, provenance: torch.Tensor) -> None:
    """Write ``rows[j][k]`` into slot ``slot_ids[k]`` of plane ``plane_indices[j]`` for every
    VALID row ``k``; other rows write nothing. Mutates ``pool``."""
    keep = (provenance.to(pool.device) == Row.VALID).nonzero().squeeze(1)
    slots = slot_ids.to(pool.device).index_select(0, keep)
    for j, r in zip(plane_indices, rows):
        row_bytes = pool.layout.planes[j].row_bytes
        dst = pool.buffers[j].view(-1).view(torch.uint8).view(-1, row_bytes)
        src = r.index_select(0, keep.to(r.device)).contiguous().view(torch.uint8).reshape(-1, row_bytes)
        dst.index_copy_(0, slots, src.to(pool.device))


def _device(pool: Pool) -> torch.device:
    return pool.device if isinstance(pool, DevicePool) else pool.buffer.device
