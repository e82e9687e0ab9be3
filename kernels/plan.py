"""Address tables for the page-copy kernel: built once per pool pair and plane set.

A ``CopyPlan`` turns per-plane addressing (``PlaneAddr``: where page 0 of a
plane starts on each side, the distance between pages, the bytes per page)
into the two chunk tables ``_triton_copy._page_copy_kernel`` walks, plus the
tile shape that fits them. Building one costs a small host→device copy; the
launcher caches plans so a launch does not rebuild them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Sequence

import torch

ALIGN = 16  # bytes; the wide path's access width
# Columns of a table row: SRC, SRC_STRIDE, DST, DST_STRIDE, LEN (see
# _triton_copy). Defined here so that building plans never imports Triton.
NCOLS = 5


class PlaneAddr(NamedTuple):
    """Absolute addressing of one plane on both sides of a copy (bytes)."""

    src_base: int  # address of page (or row) 0
    src_stride: int  # bytes between consecutive pages (or rows)
    dst_base: int
    dst_stride: int
    nbytes: int  # bytes to move per page (or row)

    @property
    def wide(self) -> bool:
        return all(x % ALIGN == 0 for x in self)


@dataclass(frozen=True, slots=True)
class TileConfig:
    """Tile sizes of one launch configuration (see ``page_copy`` for the tuned values)."""

    tile_bytes: int  # bytes one program moves per wide iteration
    narrow_tile_bytes: int  # bytes one program moves per narrow iteration
    max_chunk_bytes: int  # longest contiguous piece one tile row moves (<= tile_bytes)
    num_warps: int

    def __post_init__(self) -> None:
        assert self.max_chunk_bytes <= self.tile_bytes and self.num_warps >= 1, self
        for name in ("tile_bytes", "narrow_tile_bytes", "max_chunk_bytes"):
            v = getattr(self, name)
            assert v >= ALIGN and v & (v - 1) == 0, f"TileConfig.{name}={v} must be a power of two >= 16"


@dataclass(frozen=True, slots=True)
class CopyPlan:
    """Chunk tables and tile shape for one (source, destination, planes) triple.

    ``wide`` (int64 ``[max(t_wide, 1), 5]``) is also the kernel's address anchor:
    its entries are relative to ``wide.data_ptr()``, so the plan stays valid
    exactly as long as the buffers it was built from stay allocated.
    """

    wide: torch.Tensor  # on the launch device; 16-byte units
    wide_i32: torch.Tensor  # int32 view of ``wide``: the kernel's anchor argument
    narrow: torch.Tensor  # on the launch device; bytes
    t_wide: int  # wide entries per (src, dst) pair
    t_narrow: int
    rows: int  # ROWS constexpr: wide units per tile
    words: int  # WORDS constexpr: int32 words per wide unit
    nrows: int
    nbytes: int
    bytes_per_pair: int  # payload bytes moved per (src, dst) pair


def _pow2_at_least(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


def _chunks(addrs: Sequence[PlaneAddr], chunk: int) -> list[PlaneAddr]:
    out = []
    for a in addrs:
        for off in range(0, a.nbytes, chunk):
            out.append(PlaneAddr(a.src_base + off, a.src_stride, a.dst_base + off, a.dst_stride,
                                 min(chunk, a.nbytes - off)))
    return out


def build_plan(addrs: Sequence[PlaneAddr], device: torch.device, tiles: TileConfig) -> CopyPlan:
    """Split planes into wide and narrow chunks and upload both tables to ``device``.

    Pure function of its arguments; the returned tensors are new (nothing is mutated).
    """
    wide_planes = [a for a in addrs if a.wide]
    narrow_planes = [a for a in addrs if not a.wide]
    wchunk = min(_pow2_at_least(max((a.nbytes for a in wide_planes), default=ALIGN)), tiles.max_chunk_bytes)
    nchunk = min(_pow2_at_least(max((a.nbytes for a in narrow_planes), default=1)), tiles.narrow_tile_bytes)
    wide_rows, narrow_rows = _chunks(wide_planes, wchunk), _chunks(narrow_planes, nchunk)

    wide = torch.empty((max(len(wide_rows), 1), NCOLS), dtype=torch.int64, device=device)
    narrow = torch.empty((max(len(narrow_rows), 1), NCOLS), dtype=torch.int64, device=device)
    anchor = wide.data_ptr()
    assert anchor % ALIGN == 0, f"table allocation at {anchor:#x} is not {ALIGN}-byte aligned"
    w = [[(c.src_base - anchor) // ALIGN, c.src_stride // ALIGN, (c.dst_base - anchor) // ALIGN,
          c.dst_stride // ALIGN, c.nbytes // ALIGN] for c in wide_rows] or [[0] * NCOLS]
    nr = [[c.src_base - anchor, c.src_stride, c.dst_base - anchor, c.dst_stride, c.nbytes]
          for c in narrow_rows] or [[0] * NCOLS]
    wide.copy_(torch.tensor(w, dtype=torch.int64))
    narrow.copy_(torch.tensor(nr, dtype=torch.int64))
    return CopyPlan(
        wide=wide, wide_i32=wide.view(torch.int32), narrow=narrow, t_wide=len(wide_rows), t_narrow=len(narrow_rows),
        rows=tiles.tile_bytes // wchunk, words=wchunk // 4,
        nrows=tiles.narrow_tile_bytes // nchunk, nbytes=nchunk,
        bytes_per_pair=sum(a.nbytes for a in addrs))
