"""Debug-mode state machine of the embedded cache's L2 (host) pages, as SGLang's
host-slot states (``MemoryStateInt``: reserved, protected, synced, backup).

Every L2 page id is in one state; the tier manager (``hicache.tiers.manager``) moves
it at each step of a two-phase movement, and an illegal move raises
``IntegrityError`` naming the page, its state and the state asked for::

    FREE --alloc_host--> RESERVED --prepare_backup/prefetch--> PROTECTED
    PROTECTED --complete_backup--> SYNCED        (the L1 -> L2 copy landed, indexed)
    PROTECTED --complete_prefetch--> BACKED_UP   (came from L3, indexed)
    SYNCED --complete_store (all pages)--> BACKED_UP
    RESERVED / PROTECTED --failed or unused--> FREE
    SYNCED / BACKED_UP --evict_host--> FREE      (never while a transfer reads it)
"""
from __future__ import annotations

import enum
import os
from typing import AbstractSet, Callable, Iterable, Mapping

from hicache.core.errors import IntegrityError
from hicache.core.types import HostPageId

ENV = "HICACHE_DEBUG_STATES"


class HostPageState(enum.IntEnum):
    FREE = 0  # in the host allocator's free list
    RESERVED = 1  # allocated for a plan (``alloc_host``); nothing written yet
    PROTECTED = 2  # being written (an L1 -> L2 backup or an L3 -> L2 prefetch in flight); not indexed
    SYNCED = 3  # indexed: holds the bytes of its page
    BACKED_UP = 4  # indexed, and L3 holds the page too (stored, or prefetched from L3)


_S = HostPageState
LEGAL: dict[HostPageState, frozenset[HostPageState]] = {
    _S.FREE: frozenset({_S.RESERVED}),
    _S.RESERVED: frozenset({_S.PROTECTED, _S.FREE}),
    _S.PROTECTED: frozenset({_S.SYNCED, _S.BACKED_UP, _S.FREE}),
    _S.SYNCED: frozenset({_S.BACKED_UP, _S.FREE}),
    _S.BACKED_UP: frozenset({_S.BACKED_UP, _S.FREE}),  # stored again: still in L3
}
_INDEXED = (_S.SYNCED, _S.BACKED_UP)


def enabled_by_env() -> bool:
    """``HICACHE_DEBUG_STATES`` is set to something other than "" or "0"."""
    return os.environ.get(ENV, "") not in ("", "0")


class HostPageStates:
    """The state of each of ``capacity`` L2 page ids, and the reads in progress.

    Reads are counted beside the state, not as one: a load back (L2 -> L1) and a
    store (L2 -> L3) read an indexed page, possibly both at once; a page being
    read cannot be freed.

    Off unless asked for (``HICACHE_DEBUG_STATES=1`` or ``debug_states = true``):
    the tier manager then keeps no table and each transition is one ``None`` test.
    ``check`` cross-checks the table against the allocator, the index and the
    plans in flight (the tier manager's ``check_integrity`` calls it).
    """

    def __init__(self, capacity: int):
        self._state = bytearray(capacity)  # HostPageState per page id; all FREE
        self._readers: dict[int, int] = {}  # page id -> transfers reading it (> 0)
        self.transitions = 0  # moves made (a test can see the table was used)

    def state(self, page: int) -> HostPageState:
        return HostPageState(self._state[page])

    def move(self, pages: Iterable[int], to: HostPageState) -> None:
        """Move every page to ``to``; ``IntegrityError`` (moving none) on an illegal move."""
        pages = list(pages)
        st, readers = self._state, self._readers
        for p in pages:
            cur = HostPageState(st[p])
            if to not in LEGAL[cur]:
                raise IntegrityError(f"L2 page {p}: illegal state transition {cur.name} -> {to.name} "
                                     f"(legal from {cur.name}: {sorted(s.name for s in LEGAL[cur])})")
            if to is _S.FREE and p in readers:
                raise IntegrityError(f"L2 page {p}: illegal state transition {cur.name} -> FREE while "
                                     f"{readers[p]} transfer(s) read it")
        for p in pages:
            st[p] = to
        self.transitions += len(pages)

    def read(self, pages: Iterable[int]) -> None:
        """A transfer starts reading ``pages`` (they must be indexed)."""
        pages = list(pages)
        for p in pages:
            if self._state[p] not in _INDEXED:
                raise IntegrityError(f"L2 page {p}: a transfer reads it in state {self.state(p).name}; "
                                     "only SYNCED or BACKED_UP pages hold bytes to read")
        for p in pages:
            self._readers[p] = self._readers.get(p, 0) + 1

    def done_reading(self, pages: Iterable[int]) -> None:
        for p in pages:
            n = self._readers.get(p, 0)
            if n == 0:
                raise IntegrityError(f"L2 page {p}: a read ended that never started (state {self.state(p).name})")
            if n == 1:
                del self._readers[p]
            else:
                self._readers[p] = n - 1

    def check(self, allocated: Callable[[int], bool], indexed: Mapping[HostPageId, int],
              in_flight: AbstractSet[HostPageId]) -> None:
        """Cross-check against the allocator (``allocated(page)``), the index
        (``indexed``: page id -> its node's ``host_lock_ref``) and the ids that
        prepared plans hold (``in_flight``)."""
        for p, raw in enumerate(self._state):
            s = HostPageState(raw)
            if (s is _S.FREE) == allocated(p):
                raise IntegrityError(f"L2 page {p} is {s.name} but the allocator has it "
                                     f"{'allocated' if allocated(p) else 'free'}")
            page = HostPageId(p)
            if (s in _INDEXED) != (page in indexed):
                raise IntegrityError(f"L2 page {p} is {s.name} but the index "
                                     f"{'holds' if page in indexed else 'does not hold'} it")
            if (s is _S.PROTECTED) != (page in in_flight):
                raise IntegrityError(f"L2 page {p} is {s.name} but a prepared plan "
                                     f"{'holds' if page in in_flight else 'does not hold'} it")
        for p, n in self._readers.items():
            if indexed.get(HostPageId(p), 0) < 1:
                raise IntegrityError(f"L2 page {p}: {n} transfer(s) read it but its node is not pinned on L2")
