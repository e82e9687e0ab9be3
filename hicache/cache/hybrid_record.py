"""The boundary record of a ``HybridCache``: which resumable boundaries it keeps,
bounded in number and pruned of the ones that can no longer resume.

A *boundary* is a page boundary of a cached prefix, keyed by the chained hash
of its last page. Its entry says which SWA pages its window needs (per SWA
group) and whether the state group keeps a snapshot there; the group stores
(``hicache.tiers.groups``) count, per item, the boundaries that need it.

The record stays bounded:

* at most ``cap`` boundaries, the least recently used forgotten first (a
  boundary is used when it is recorded again or an admission resumes from it);
* a boundary whose full-attention prefix left every tier of the ``HiCache``
  is forgotten: its last page is no longer indexed (on L1 or L2), and the
  pages of the index nodes it lost were not stored in L3 when they left (the
  index's ``in_storage``). L3's own eviction is not seen here: such a
  boundary ages out by the cap, and an admission never floors above the
  full groups' hit, so it is never used wrongly;
* a boundary one of whose items left every tier of its store (an L1 or L2
  copy evicted with no copy below it, an L3 object gone or corrupt) is
  forgotten.

The prefix check runs after pages left a tier of the index (its ``epoch``
moved), over at most ``limit`` boundaries per call from a rotating cursor (the
admission path's budget; ``bench/hybrid_record.py`` times it), until every boundary recorded
before that change was checked; a full sweep (``limit=None``) checks them all.
Items that left their store are looked up in a reverse index (item ->
boundaries that need it), not by scanning the record.

Each entry keeps an *anchor*: the index node that held its last page when it
was last recorded or used (or a node below it: an insert may split a node
later, the lower part keeping the object). The tree never merges nodes and
removes only leaves, so walking up by ``parent`` finds the node holding the
page, and that node is still indexed exactly when its parent still lists it.
Forgetting frees, on every tier, the items no other boundary needs
(``HybridCache.forget``); this module only decides which. Not thread-safe.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Iterator

from hicache.core.errors import ConfigError, IntegrityError
from hicache.index.node import Node
from hicache.core.types import PageHash

# Boundaries whose prefix one admission's sweep checks at most: 0.13 ms on the
# 2-core dev box (bench/hybrid_record.py: ~0.2 us a boundary plus a copy of the
# keys; a full check of 4096 boundaries 0.8 ms, of 16384 ~4 ms).
SWEEP_BATCH = 256
# Boundaries kept by default. Each costs ~0.3 KiB of Python objects here plus
# its items in the stores (an SWA window, a snapshot), which the stores' own
# pools and L3 bound; 4096 boundaries of gpt-oss-120b (8 SWA pages of 288 KiB
# each at page 16, shared by neighbours) are at most 9 GiB of L3 objects.
DEFAULT_MAX_BOUNDARIES = 4096


@dataclass(slots=True)
class Boundary:
    """What one resumable boundary needs of each non-full group."""

    pages: int  # the boundary, in pages of its prefix
    swa: dict[int, tuple[PageHash, ...]] = field(default_factory=dict)  # group -> its window's page hashes
    snapshot: bool = False  # the state group keeps a snapshot keyed by this boundary's hash
    anchor: Node | None = None  # an index node holding (or below) page ``pages - 1``; see the module docstring


class BoundaryRecord:
    """Boundaries by key, least recently used first, at most ``cap`` of them."""

    def __init__(self, cap: int, page_size: int):
        if not isinstance(cap, int) or isinstance(cap, bool) or cap < 1:
            raise ConfigError(f"HybridPools.max_boundaries={cap!r}: the record needs room for at least one "
                              f"boundary; pass a positive count (default {DEFAULT_MAX_BOUNDARIES})")
        self.cap, self.page_size = cap, page_size
        self._items: OrderedDict[PageHash, Boundary] = OrderedDict()
        self._users: dict[tuple[int, PageHash], set[PageHash]] = {}  # (group, SWA item) -> boundaries needing it
        self._cursor = 0  # where the next limited prefix check starts (an index into the LRU order)
        self._unchecked = 0  # boundaries still to check since the index last changed
        self.forgotten = 0  # boundaries forgotten since the start (cap, prefix gone, item gone)

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, key: object) -> bool:
        return key in self._items

    def __iter__(self) -> Iterator[PageHash]:
        """Keys, least recently used first (a copy: forgetting while iterating is fine)."""
        return iter(list(self._items))

    def get(self, key: PageHash) -> Boundary | None:
        return self._items.get(key)

    def items(self) -> Iterator[tuple[PageHash, Boundary]]:
        return iter(list(self._items.items()))

    def values(self) -> Iterator[Boundary]:
        return iter(list(self._items.values()))

    def add(self, key: PageHash, pages: int, anchor: Node) -> Boundary:
        """A new, empty entry for boundary ``key`` (the most recently used), anchored at ``anchor``."""
        if key in self._items:
            raise IntegrityError(f"boundary {key.hex()} is recorded already")
        rec = self._items[key] = Boundary(pages, anchor=anchor)
        return rec

    def set_window(self, key: PageHash, gi: int, hashes: tuple[PageHash, ...]) -> None:
        """Boundary ``key``'s window in SWA group ``gi`` is the items ``hashes``."""
        rec = self._items[key]
        self._unlink(key, gi, rec.swa.get(gi, ()))
        rec.swa[gi] = hashes
        for h in hashes:
            self._users.setdefault((gi, h), set()).add(key)

    def _unlink(self, key: PageHash, gi: int, hashes: tuple[PageHash, ...]) -> None:
        for h in hashes:
            users = self._users.get((gi, h))
            if users is not None:
                users.discard(key)
                if not users:
                    del self._users[(gi, h)]

    def use(self, key: PageHash, node: Node | None) -> None:
        """Boundary ``key`` was recorded again or resumed from: most recently used, anchored
        at ``node`` (the index node a request holds at or below its last page)."""
        rec = self._items.get(key)
        if rec is None:
            return
        self._items.move_to_end(key)
        if node is not None:
            rec.anchor = node

    def pop(self, key: PageHash) -> Boundary:
        rec = self._items.pop(key)
        for gi, hs in rec.swa.items():
            self._unlink(key, gi, hs)
        self.forgotten += 1
        return rec

    def over_cap(self) -> list[PageHash]:
        """The least recently used keys beyond the cap (forget them)."""
        extra = len(self._items) - self.cap
        return [k for k, _ in zip(self._items, range(extra))] if extra > 0 else []

    def stale(self, lost: dict[int, set[PageHash]], state_gi: int | None, *, index_changed: bool, l3: bool,
              limit: int | None = None) -> set[PageHash]:
        """Keys of boundaries that can no longer resume: one of their items is in ``lost``
        (group -> items gone from every tier of its store), or their full-attention prefix
        is held by no tier (``l3``: the full groups have an L3). ``index_changed``: pages
        left a tier of the index since the last call; prefixes are checked from then on,
        ``limit`` per call (None: all that remain). Mutates the cursor and anchors only."""
        out: set[PageHash] = set()
        for gi, hs in lost.items():
            for h in hs:
                if gi == state_gi:
                    rec = self._items.get(h)
                    if rec is not None and rec.snapshot:
                        out.add(h)
                else:
                    out.update(self._users.get((gi, h), ()))
        if index_changed:
            self._unchecked = len(self._items)
        n = min(self._unchecked, len(self._items) if limit is None else limit)
        if n:
            keys = list(self._items)
            start = self._cursor % len(keys)
            batch = keys[start:start + n]
            batch += keys[:n - len(batch)]  # wrapped around
            gone = [k for k in batch if not self._prefix_held(self._items[k], l3)]
            out.update(gone)
            # the caller forgets ``gone``: the next unchecked key moves up by as many places
            self._cursor, self._unchecked = start + n - len(gone), self._unchecked - n
        return out

    def _prefix_held(self, rec: Boundary, l3: bool) -> bool:
        """Whether the full groups still hold every page of ``rec``'s prefix: its last
        page's node is indexed (the index is prefix-closed over L1 and L2), or every node
        between it and the first indexed one was stored in L3 when it left. Re-anchors
        ``rec`` at the node holding its last page."""
        n = rec.anchor
        if n is None:
            return False
        while n.parent is not None and n.start_page >= rec.pages:
            n = n.parent  # a split since: the page is in an upper part
        rec.anchor = n
        pb = 4 * self.page_size
        while n.parent is not None:
            if n.parent.children.get(n.key[:pb]) is n:
                return True  # indexed: a node with a child is never removed, so every page above is too
            if not (l3 and n.in_storage):
                return False
            n = n.parent
        return True

    def need_counts(self, stores: list[int], state_gi: int | None) -> dict[int, dict[PageHash, int]]:
        """Per store, the boundaries that name each item (what the stores' ``need`` must be)."""
        want: dict[int, dict[PageHash, int]] = {gi: {} for gi in stores}
        for key, rec in self._items.items():
            for gi, hs in rec.swa.items():
                for h in hs:
                    want[gi][h] = want[gi].get(h, 0) + 1
            if rec.snapshot and state_gi is not None:
                want[state_gi][key] = want[state_gi].get(key, 0) + 1
        return want

    def check_integrity(self) -> None:
        """At most ``cap`` entries; each has a positive boundary, an anchor, and SWA
        windows that end at its own last page's key."""
        if len(self._items) > self.cap:
            raise IntegrityError(f"the boundary record holds {len(self._items)} boundaries, its cap is {self.cap}")
        users: dict[tuple[int, PageHash], set[PageHash]] = {}
        for key, rec in self._items.items():
            for gi, hs in rec.swa.items():
                for h in hs:
                    users.setdefault((gi, h), set()).add(key)
        if users != self._users:
            bad = sorted(k[1].hex()[:8] for k in set(users) ^ set(self._users)
                         or {k for k in users if users[k] != self._users.get(k)})
            raise IntegrityError(f"the record's item -> boundaries index disagrees with its windows at items {bad}")
        for key, rec in self._items.items():
            if rec.pages < 1 or rec.anchor is None:
                raise IntegrityError(f"boundary {key.hex()}: pages={rec.pages}, anchor={rec.anchor!r}; "
                                     "every recorded boundary has a positive page count and an index anchor")
            if any(hs and hs[-1] != key for hs in rec.swa.values()):
                raise IntegrityError(f"boundary {key.hex()} at {rec.pages} pages: an SWA window does not end "
                                     "at the boundary's last page")
