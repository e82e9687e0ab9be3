"""Refuse commits of reserved pages that were never written.

Engines write page bytes into the shared segment themselves, so the server
cannot see a write happen. Instead, ``stamp`` writes a fresh random mark
(``MARK_BYTES`` bytes, the same for every plane of one page, different per
page and per reservation) at the start of every plane of each reserved page;
``check`` at commit refuses a page on which a plane still carries its mark.
A real write replaces the mark with KV bytes; the chance that it reproduces
16 random bytes is 2**-128. With planes smaller than the mark (tiny test
layouts) the mark is shorter and a page is refused only when *every* plane
still carries it.

Marks live in two arrays indexed by page id, so stamping and checking a
batch is a handful of numpy operations on the segment (no per-page Python
loop over planes): bounded work on the event loop.
"""
from __future__ import annotations

import numpy as np

from hicache.core.errors import ServiceError
from hicache.memory.pools import HostPool

MARK_BYTES = 16
# Below this, one plane's mark surviving a write is too likely to refuse on it alone.
_PER_PLANE_MIN = 8


class WriteMarks:
    def __init__(self, pool: HostPool):
        lay = pool.layout
        self.m = min(MARK_BYTES, min(p.page_bytes for p in lay.planes))
        self.capacity = pool.allocator.capacity
        self._buf = pool.buffer.numpy()  # shares the segment's memory
        self._offset = np.asarray(pool.plane_offset, dtype=np.int64)[:, None, None]
        self._stride = np.asarray(pool.page_stride, dtype=np.int64)[:, None, None]
        self._within = np.arange(self.m, dtype=np.int64)[None, None, :]
        self._marks = np.zeros((self.capacity, self.m), dtype=np.uint8)
        self._stamped = np.zeros(self.capacity, dtype=bool)
        self._rng = np.random.default_rng()

    def _index(self, pages: np.ndarray) -> np.ndarray:
        # [planes, pages, m] byte offsets of every plane's mark
        return self._offset + pages[None, :, None] * self._stride + self._within

    def stamp(self, pages: list[int]) -> None:
        """Mark freshly reserved ``pages`` (valid page ids). Mutates the segment."""
        if not pages:
            return
        p = np.asarray(pages, dtype=np.int64)
        marks = self._rng.integers(0, 256, size=(len(pages), self.m), dtype=np.uint8)
        self._marks[p] = marks
        self._stamped[p] = True
        self._buf[self._index(p)] = marks[None, :, :]

    def check(self, pages: object) -> None:
        """Raise ``ServiceError('not_written')`` when a stamped page in ``pages`` was not written.

        Entries that are not valid page ids are left to the index's own checks.
        Mutates nothing.
        """
        if not isinstance(pages, (list, tuple)):
            return
        valid = [x for x in pages if type(x) is int and 0 <= x < self.capacity]
        p = np.asarray(valid, dtype=np.int64)
        p = p[self._stamped[p]] if len(p) else p
        if not len(p):
            return
        same = (self._buf[self._index(p)] == self._marks[p][None, :, :]).all(axis=2)  # [planes, pages]
        bad = same.any(axis=0) if self.m >= _PER_PLANE_MIN else same.all(axis=0)
        if bad.any():
            unwritten = p[bad].tolist()
            raise ServiceError("not_written", f"page(s) {unwritten[:8]}{' ...' if len(unwritten) > 8 else ''} "
                               "were reserved but not (fully) written: write every plane of a page into "
                               "the segment before committing it, or cancel it")

    def clear(self, pages: object) -> None:
        """Forget the marks of committed or cancelled ``pages``."""
        if isinstance(pages, (list, tuple)):
            valid = [x for x in pages if type(x) is int and 0 <= x < self.capacity]
            if valid:
                self._stamped[np.asarray(valid, dtype=np.int64)] = False
