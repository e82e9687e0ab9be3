"""Whole-page allocator: O(1) per page, detects double frees and foreign pages."""
from __future__ import annotations

from typing import Iterable

from hicache.core.errors import DoubleFree, ForeignPage, IntegrityError, OutOfPages


class PageAllocator:
    """Hands out page ids ``0 .. capacity-1`` of one pool.

    ``alloc``/``free`` are O(1) per page: a LIFO free stack plus a state byte
    per page (1 = allocated). LIFO keeps recently freed, cache-warm pages in use.
    Not thread-safe: one owner (the cache) serialises calls.
    """

    __slots__ = ("name", "capacity", "_free", "_allocated")

    def __init__(self, capacity: int, name: str = "pool"):
        if capacity < 0:
            raise ValueError(f"{name}: capacity must be >= 0, got {capacity}")
        self.name = name
        self.capacity = capacity
        # Reversed so that the first allocation returns 0, 1, 2, ... (readable tests).
        self._free: list[int] = list(range(capacity - 1, -1, -1))
        self._allocated = bytearray(capacity)

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.capacity - len(self._free)

    def can_alloc(self, n: int) -> bool:
        return n <= len(self._free)

    def alloc(self, n: int) -> list[int]:
        """Allocate ``n`` pages; raises ``OutOfPages`` and allocates nothing if short."""
        if n < 0:
            raise ValueError(f"{self.name}: cannot allocate {n} pages")
        if n > len(self._free):
            raise OutOfPages(f"{self.name}: asked for {n} pages, {len(self._free)} free of "
                             f"{self.capacity}; evict first or enlarge the pool")
        if n == 0:
            return []
        out = self._free[-n:]
        del self._free[-n:]
        out.reverse()
        st = self._allocated
        for p in out:
            st[p] = 1
        return out

    def free(self, pages: Iterable[int]) -> None:
        """Return pages. Validates every id before freeing any (all or nothing)."""
        pages = list(pages)
        st, cap = self._allocated, self.capacity
        seen = set()
        for p in pages:
            if not (0 <= p < cap) or isinstance(p, bool):
                raise ForeignPage(f"{self.name}: page id {p!r} is not in [0, {cap})")
            if not st[p] or p in seen:
                raise DoubleFree(f"{self.name}: page {p} freed but not allocated (double free?)")
            seen.add(p)
        for p in pages:
            st[p] = 0
        self._free.extend(pages)

    def is_allocated(self, page: int) -> bool:
        return 0 <= page < self.capacity and bool(self._allocated[page])

    def check_integrity(self) -> None:
        """Free stack and state bytes agree; no page is free twice."""
        free = self._free
        if len(set(free)) != len(free):
            raise IntegrityError(f"{self.name}: a page is on the free list twice")
        for p in free:
            if not (0 <= p < self.capacity) or self._allocated[p]:
                raise IntegrityError(f"{self.name}: free page {p} is marked allocated or out of range")
        used = sum(self._allocated)
        if used + len(free) != self.capacity:
            raise IntegrityError(f"{self.name}: used {used} + free {len(free)} != capacity {self.capacity}")
