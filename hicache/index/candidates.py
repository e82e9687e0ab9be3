"""Eviction candidates of one tier and the pure choice of victims.

``DeviceCandidates`` keeps the L1 leaves (on L1, no child on L1) incrementally;
``HostCandidates`` keeps push-on-change hints for L2 leaves and validates them
on pop. For a policy whose key only grows (``EvictionPolicy.monotone``) each
keeps a persistent lazy heap — an entry whose key went stale is re-pushed on
pop — so a choice costs O(victims log n) instead of a heap build over every
candidate; any other policy is ordered by a fresh scan per call. A
``SegmentedPolicy`` gets one lazy heap per segment and picks across the segments'
tops by its current offsets; the candidates tell it what was added and evicted.

``choose`` is the first of eviction's three steps (choose, the caller's
write-back, ``RadixTree.drop_*``): it returns victims in eviction order,
including parents that become candidates once their chosen children go, and
changes no node (it only tidies its own heap). Not thread-safe.
"""
from __future__ import annotations

import heapq
from typing import Any, Callable, Iterable, Sequence

from hicache.index.eviction import EvictionPolicy, Key, SegmentedPolicy
from hicache.index.node import Node

Entry = tuple[Key, int, Node]  # (policy key, nid, node): nid is unique, nodes are never compared
Spare = Callable[[Node], bool]  # a node kept while candidates it does not spare remain


class _Candidates:
    """What both tiers share: per-policy lazy heaps and the choice loop."""

    def __init__(self) -> None:
        self._heaps: dict[str, tuple[EvictionPolicy, list[Entry]]] = {}
        self._segs: dict[str, tuple[Any, list[list[Entry]]]] = {}  # segmented policies: a heap per segment
        self._spare: tuple[Spare, ...] = ()  # what the pass in progress keeps (``choose``)

    # Subclasses define what a candidate is, in the real tree and as seen
    # after the nodes in ``gone`` were evicted.
    def _all(self) -> Iterable[Node]:
        raise NotImplementedError

    def _bound(self) -> int:
        raise NotImplementedError

    def _valid(self, n: Node, gone: set[Node]) -> bool:
        raise NotImplementedError

    def _pinned(self, n: Node) -> bool:
        raise NotImplementedError

    def _next(self, n: Node, gone: set[Node]) -> Node | None:
        """``n``'s parent if evicting ``n`` (and ``gone``) makes it an unpinned candidate."""
        raise NotImplementedError

    def push(self, n: Node) -> None:
        """``n`` may have become a candidate: remember it in every live heap."""
        for pol, heap in self._heaps.values():
            heapq.heappush(heap, (pol.key(n), n.nid, n))
        for pol, heaps in self._segs.values():
            heapq.heappush(heaps[pol.segment(n)], (pol.key(n), n.nid, n))

    def _tell_added(self, n: Node) -> None:
        for pol, _ in self._segs.values():
            pol.added(n)

    def touched(self, n: Node) -> None:
        """A request is about to use ``n``'s path (it still carries its old access time)."""
        for pol, _ in self._segs.values():
            pol.touched(n)

    def _tell_evicted(self, n: Node) -> None:
        for pol, _ in self._segs.values():
            pol.evicted(n)

    def choose(self, num_pages: int, policy: EvictionPolicy, spares: Sequence[Spare] = ()) -> list[Node]:
        """Victims covering at least ``num_pages`` logical pages (fewer only when
        candidates run out), in eviction order. Mutates no node.

        ``spares``: predicates of nodes to keep while others remain, in passes: the
        first pass skips every node any predicate spares, each later pass drops the
        first predicate still in force, the last pass spares nothing. Inside a pass
        the order is the policy's."""
        victims: list[Node] = []
        gone: set[Node] = set()
        got = 0
        for i in range(len(spares) + 1):
            if got >= num_pages:
                break
            self._spare = tuple(spares[i:])
            try:
                more = self._choose_pass(num_pages - got, policy, gone)
            finally:
                self._spare = ()
            victims += more
            gone.update(more)
            got += sum(n.num_pages for n in more)
        return victims

    def _held(self, n: Node) -> bool:
        """Pinned, or spared in this pass."""
        return self._pinned(n) or any(f(n) for f in self._spare)

    def _choose_pass(self, num_pages: int, policy: EvictionPolicy, gone: set[Node]) -> list[Node]:
        if num_pages <= 0:
            return []
        if isinstance(policy, SegmentedPolicy):
            return self._choose_segmented(num_pages, policy, gone)
        if policy.monotone:
            return self._choose_heap(num_pages, policy, gone)
        key = policy.key
        heap = [(key(n), n.nid, n) for n in self._all()
                if n not in gone and self._valid(n, gone) and not self._held(n)]
        heapq.heapify(heap)
        return self._drain(heap, [], num_pages, policy, gone)

    def _freed_parents(self, gone: set[Node], key: Callable[[Node], Any]) -> list[Any]:
        """Parents that earlier passes' victims (``gone``) leave as candidates, as heap entries."""
        out, seen = [], set()
        for v in gone:
            p = self._next(v, gone)
            if p is not None and p not in gone and p not in seen:
                seen.add(p)
                out.append((key(p), p.nid, p))
        heapq.heapify(out)
        return out

    def _choose_heap(self, num_pages: int, policy: EvictionPolicy, gone: set[Node]) -> list[Node]:
        got = self._heaps.get(policy.name)
        if got is None or len(got[1]) > 2 * self._bound() + 1024:  # first use, or too stale
            heap = [(policy.key(n), n.nid, n) for n in self._all()]
            heapq.heapify(heap)
            self._heaps[policy.name] = (policy, heap)
        else:
            heap = got[1]
        restore: list[Entry] = []
        victims = self._drain(heap, restore, num_pages, policy, gone)
        for e in restore:  # chosen and pinned entries stay: drop_* invalidates the chosen
            heapq.heappush(heap, e)
        return victims

    def _choose_segmented(self, num_pages: int, policy: SegmentedPolicy, gone: set[Node]) -> list[Node]:
        """One lazy heap per segment (keys grow inside a segment, a node's segment only
        grows, offsets grow with the segment): the smallest ``key + offset`` over the
        segments' valid tops is the smallest over every candidate."""
        got = self._segs.get(policy.name)
        if got is None or got[0] is not policy or sum(map(len, got[1])) > 2 * self._bound() + 1024:
            heaps: list[list[Entry]] = [[] for _ in range(policy.segments)]
            for n in self._all():
                heaps[policy.segment(n)].append((policy.key(n), n.nid, n))
            for h in heaps:
                heapq.heapify(h)
            self._segs[policy.name] = (policy, heaps)
        else:
            heaps = got[1]
        restore: list[tuple[int, Entry]] = []
        gone = set(gone)
        # parents that become candidates, by effective key
        extra = self._freed_parents(gone, lambda p: (policy.key(p)[0] + policy.offset(policy.segment(p)), p.nid))
        victims, pages = [], 0
        while pages < num_pages:
            best = oldest = full = None
            for s, heap in enumerate(heaps):
                top = self._valid_top(heap, s, heaps, policy, restore, gone)
                if top is not None:
                    eff = (top[0][0] + policy.offset(s), top[1])
                    if best is None or eff < best[0]:
                        best = (eff, s)
                    if oldest is None or top[:2] < oldest[:2]:
                        oldest = top
                    eff = (top[0][0] + policy.offset(s, applied=False), top[1])
                    if full is None or eff < full[0]:
                        full = (eff, top[2])
            if oldest is not None and full is not None and full[1] is not oldest[2]:
                policy.compared(full[1], oldest[2])  # learnt offsets and LRU disagree
            while extra and extra[0][2] in gone:  # also chosen from a segment's heap meanwhile
                heapq.heappop(extra)
            if best is None and not extra:
                break
            if best is None or (extra and extra[0][0] < best[0]):
                n = heapq.heappop(extra)[2]
            else:
                e = heapq.heappop(heaps[best[1]])
                restore.append((best[1], e))
                n = e[2]
            victims.append(n)
            gone.add(n)
            pages += n.num_pages
            p = self._next(n, gone)
            if p is not None:
                k = policy.key(p)
                heapq.heappush(extra, ((k[0] + policy.offset(policy.segment(p)), p.nid), p.nid, p))
        for s, e in restore:  # chosen and pinned entries stay: drop_* invalidates the chosen
            heapq.heappush(heaps[s], e)
        return victims

    def _valid_top(self, heap: list[Entry], s: int, heaps: list[list[Entry]], policy: SegmentedPolicy,
                   restore: list[tuple[int, Entry]], gone: set[Node]) -> Entry | None:
        while heap:
            k, nid, n = heap[0]
            if n in gone or not self._valid(n, gone):
                heapq.heappop(heap)
                continue
            seg = policy.segment(n)
            if seg != s:  # its segment grew: it moves (its effective key grew with it)
                heapq.heappop(heap)
                heapq.heappush(heaps[seg], (policy.key(n), nid, n))
                continue
            cur = policy.key(n)
            if cur != k:
                heapq.heapreplace(heap, (cur, nid, n))
                continue
            if self._held(n):
                restore.append((s, heapq.heappop(heap)))
                continue
            return heap[0]
        return None

    def _drain(self, heap: list[Entry], restore: list[Entry], num_pages: int,
               policy: EvictionPolicy, gone: set[Node]) -> list[Node]:
        """Pop victims from ``heap`` (validated lazily; popped live entries go to
        ``restore``) merged with ``extra``, the parents that become candidates."""
        key, got, victims = policy.key, 0, []
        gone = set(gone)
        extra: list[Entry] = self._freed_parents(gone, key)
        while got < num_pages:
            top = None
            while heap:
                k, nid, n = heap[0]
                if n in gone or not self._valid(n, gone):
                    heapq.heappop(heap)  # stale: pushed again if it becomes a candidate
                    continue
                cur = key(n)
                if cur != k:
                    heapq.heapreplace(heap, (cur, nid, n))
                    continue
                if self._held(n):
                    restore.append(heapq.heappop(heap))
                    continue
                top = heap[0]
                break
            while extra and extra[0][2] in gone:  # also chosen from the heap meanwhile
                heapq.heappop(extra)
            if top is None and not extra:
                break
            if top is None or (extra and extra[0] < top):
                n = heapq.heappop(extra)[2]
            else:
                restore.append(heapq.heappop(heap))
                n = top[2]
            victims.append(n)
            gone.add(n)
            got += n.num_pages
            p = self._next(n, gone)
            if p is not None:
                heapq.heappush(extra, (key(p), p.nid, p))
        return victims


class DeviceCandidates(_Candidates):
    """L1 eviction candidates: the L1 leaves; pinned while ``lock_ref > 0``."""

    def __init__(self) -> None:
        super().__init__()
        self.leaves: set[Node] = set()

    def add(self, n: Node) -> None:
        self.leaves.add(n)
        self.push(n)
        if self._segs:
            self._tell_added(n)

    def discard(self, n: Node | None) -> None:
        self.leaves.discard(n)
        if self._segs and n is not None and n.device_pages is None:  # evicted, not covered by a child
            self._tell_evicted(n)

    def _all(self) -> Iterable[Node]:
        return self.leaves

    def _bound(self) -> int:
        return len(self.leaves)

    def _valid(self, n: Node, gone: set[Node]) -> bool:
        return n in self.leaves

    def _pinned(self, n: Node) -> bool:
        return n.lock_ref > 0

    def _next(self, n: Node, gone: set[Node]) -> Node | None:
        p = n.parent
        if p is None or p.parent is None or self._held(p):
            return None
        if any(c.device_pages is not None and c not in gone for c in p.children.values()):
            return None
        return p


class HostCandidates(_Candidates):
    """L2 eviction candidates: L2 leaves; pinned while ``host_lock_ref > 0``.
    Not kept as a set: ``push`` hints and every check is against the tree."""

    def __init__(self, nodes: Callable[[], Iterable[Node]]) -> None:
        super().__init__()
        self._nodes = nodes  # () -> every non-root node (the tree's iter_nodes)
        self.held = 0  # L2 ids held by the tree: bounds the heap's staleness

    def added(self, n: Node) -> None:
        """``n`` got L2 copies (a backup, a prefetch): a candidate hint, and news for learning policies."""
        self.push(n)
        if self._segs:
            self._tell_added(n)

    def dropped(self, n: Node) -> None:
        """``n``'s L2 copies were dropped (evicted)."""
        if self._segs:
            self._tell_evicted(n)

    def _all(self) -> Iterable[Node]:
        return (n for n in self._nodes() if n.host_pages is not None)

    def _bound(self) -> int:
        return self.held

    def _valid(self, n: Node, gone: set[Node]) -> bool:
        return n.host_pages is not None and not any(
            c.host_pages is not None and c not in gone for c in n.children.values())

    def _pinned(self, n: Node) -> bool:
        return n.host_lock_ref > 0

    def _next(self, n: Node, gone: set[Node]) -> Node | None:
        p = n.parent
        if p is None or p.parent is None or self._held(p) or not self._valid(p, gone):
            return None
        return p
