"""Page-granular radix tree: the index of every cached prefix and its tiers.

Edges are whole pages. A node's ``key`` is the uint32-LE bytes of its tokens
(``hicache.core.hashing.tokens_to_bytes``); children are keyed by the bytes of
their first page, so a lookup is one dict probe per node plus one ``memcmp``
of the edge (``bytes.startswith``). The first differing page inside an edge
is found by bisection over byte slices. Token ints are never compared one by
one and nothing is hashed on the match path; page hashes are computed lazily
(``hashes``).

Every namespace (LoRA adapter, cache salt) has its own root, so two
namespaces never share a node or a page.
"""
from __future__ import annotations

from typing import Iterator, Sequence


from hicache.core.cp import PageOwnership, RoundRobin
from hicache.core.errors import CacheStateError
from hicache.index.candidates import DeviceCandidates, HostCandidates
from hicache.index.eviction import EvictionPolicy
from hicache.core.hashing import namespace_root, raw_page_hashes
from hicache.index.node import DraftCut, Dropped, Hit, InsertResult, Node, TreeCensus
from hicache.index.radix_check import TreeFacts, check_tree
from hicache.core.types import DevicePageId, HostPageId, PageHash

__all__ = ["RadixTree", "Node", "Hit", "InsertResult", "Dropped", "TreeCensus"]

# Enum members read once: a member lookup costs ~0.8 us on Python 3.11, match() runs per request.
_NO_CUT, _CUT_L1, _CUT_L2 = DraftCut.NONE, DraftCut.L1, DraftCut.L2


def _on_l1(n: Node) -> bool:
    return n.device_pages is not None


def _waited(n: Node) -> bool:
    return n.wait_ref > 0


class RadixTree:
    """The index. ``page_size`` tokens per page; ``ownership``/``cp_rank`` pick owned pages.

    Draft planes (layouts with ``draft_layers``): a page is complete only when
    its draft rows are valid too, and an engine that does not run its draft head
    computes pages without them. ``draft_device`` / ``draft_host`` record, per
    node and tier, that the draft planes of every page hold valid rows; a
    ``match(..., need_draft=True)`` stops at the first node whose serving tier
    lacks them (``Hit.draft_cut`` says where), so a hit never returns target
    planes without their draft planes (invariant 5).

    Tiers per node: ``device_pages`` (L1 ids, ``None`` = not on L1) and
    ``host_pages`` (L2 ids, ``None`` = not on L2); ``in_storage`` marks L3. Under
    context parallelism those lists hold only the pages this rank owns (see
    ``hicache.core.cp``); ``[]`` means "on the tier, no page owned here". A non-root
    node is always on L1 or L2; L3-only prefixes live in the storage backend.

    The tree allocates, frees and copies nothing, and never calls up: it
    records page ids, returns what it created (``InsertResult.created``) and what
    it would evict (``device_victims`` / ``host_victims``), and drops what it is
    told to (``drop_device`` / ``drop_host``), handing freed ids back to its caller
    (``hicache.index.prefix_cache.PrefixCache``). Eviction candidates live in
    ``hicache.index.candidates``, draft-plane completeness in ``hicache.index.node``, the
    integrity check in ``hicache.index.radix_check``. Not thread-safe.
    """

    def __init__(self, page_size: int, ownership: PageOwnership | None = None, cp_rank: int = 0, *,
                 draft: bool = False):
        self.page_size = page_size
        self.draft = draft  # pages have draft planes: track their validity per node and tier
        self.page_bytes = 4 * page_size
        self.ownership = ownership or RoundRobin(1)
        self.cp_rank = cp_rank
        self.clock = 0  # logical time: bumps on every lock/insert
        self.epoch = 0  # bumps whenever pages leave a tier: older Hits may be stale
        self.device_ids_held = 0
        self.num_nodes = 0
        self._roots: dict[str, Node] = {}
        self._next_nid = 0
        # L1 leaves, kept incrementally so eviction does not scan the whole tree.
        self.device_candidates = DeviceCandidates()
        # L2 candidates are pushed when they may have become L2 leaves (set_host,
        # insert_host, a child's L2 eviction) and re-validated on pop.
        self.host_candidates = HostCandidates(self.iter_nodes)

    @property
    def host_ids_held(self) -> int:
        return self.host_candidates.held

    @host_ids_held.setter
    def host_ids_held(self, v: int) -> None:
        self.host_candidates.held = v

    # ------------------------------------------------------------------ helpers
    def owned(self, start_page: int, num_pages: int) -> int:
        """Owned pages among logical pages ``[start_page, start_page + num_pages)``."""
        return self.ownership.count(start_page, start_page + num_pages, self.cp_rank)

    def root(self, namespace: str = "") -> Node:
        """The namespace's root (created on first use). Roots count as on L1 and L2."""
        r = self._roots.get(namespace)
        if r is None:
            r = Node(b"", 0, 0, None, namespace, self._nid(), device_pages=[], host_pages=[],
                     draft_device=True, draft_host=True)
            self._roots[namespace] = r
        return r

    def namespaces(self) -> list[str]:
        """Namespaces that have a root (a fresh list)."""
        return list(self._roots)

    def _nid(self) -> int:
        self._next_nid += 1
        return self._next_nid

    def _common_pages(self, key: bytes, pos: int, end: int, child: Node) -> int:
        """Whole pages of ``child`` equal to ``key[pos:end]``; the first page is known equal."""
        pb, ck = self.page_bytes, child.key
        mv = memoryview(key)
        lo, hi = 1, min(child.num_pages, (end - pos) // pb)
        while lo < hi:  # pages [0, lo) match; is [lo, mid) a match too?
            mid = (lo + hi + 1) // 2
            if ck.startswith(mv[pos + lo * pb:pos + mid * pb], lo * pb):
                lo = mid
            else:
                hi = mid - 1
        return lo

    # -------------------------------------------------------------------- match
    def match(self, key: bytes, namespace: str = "", max_pages: int | None = None,
              need_draft: bool = False) -> Hit:
        """Longest cached whole-page prefix of ``key``: L1 hit, then the L2 hit continuing it.

        With ``need_draft`` (and a tree with draft planes) the hit stops at the
        first node whose serving tier lacks valid draft rows (``Hit.draft_cut``).
        Pure: mutates nothing (not even access times) and builds no page
        list (``pages`` does, on demand). The nodes stay valid until evicted;
        ``epoch`` tells whether an eviction happened since.
        """
        need_draft = need_draft and self.draft
        cut = _NO_CUT
        node = self._roots.get(namespace)
        if node is None:
            return Hit(0, 0, None, None)
        pb = self.page_bytes
        end = len(key) - len(key) % pb
        if max_pages is not None and max_pages * pb < end:
            end = max(0, max_pages * pb)
        starts = key.startswith
        pos = 0
        children = node.children
        nxt = None  # first node on the path that is not on L1
        while pos < end:  # hot loop: one slice, one dict probe, one memcmp per node
            child = children.get(key[pos:pos + pb])
            if child is None:
                break
            if child.device_pages is None:
                nxt = child
                break
            if need_draft and not child.draft_device:
                cut = _CUT_L1
                break
            ck = child.key
            if pos + len(ck) <= end and starts(ck, pos):
                pos += len(ck)
                node = child
                children = child.children
                continue
            p = pos // pb + self._common_pages(key, pos, end, child)
            return Hit(p, 0, child, child)
        dev_pages = pos // pb
        dev_node = node
        while nxt is not None and nxt.host_pages is not None:
            if need_draft and not nxt.draft_host:
                cut = _CUT_L2
                break
            child = nxt
            if pos + len(child.key) <= end and starts(child.key, pos):
                pos += len(child.key)
                node = child
                nxt = child.children.get(key[pos:pos + pb]) if pos < end else None
                continue
            pos += self._common_pages(key, pos, end, child) * pb
            node = child
            break
        return Hit(dev_pages, pos // pb - dev_pages, dev_node, node, cut)

    def pages(self, node: Node | None, end_page: int, first_page: int = 0, *, host: bool = False) -> list[int]:
        """Owned L1 (or L2) ids of logical pages ``[first_page, end_page)`` on the
        path to ``node``, which holds page ``end_page - 1``. A fresh list."""
        if end_page <= first_page:
            return []  # an empty range: ``node`` need not be on that tier at all
        parts = []
        n = node
        while n is not None and n.parent is not None and n.start_page + n.num_pages > first_page:
            ids = n.host_pages if host else n.device_pages
            if ids is None:
                raise CacheStateError(f"pages({end_page}) through {n!r}: it is not on {'L2' if host else 'L1'}")
            a = self.owned(n.start_page, max(0, first_page - n.start_page))
            b = self.owned(n.start_page, min(n.num_pages, end_page - n.start_page))
            parts.append(ids[a:b])
            n = n.parent
        return [i for part in reversed(parts) for i in part]

    # ------------------------------------------------------------------- insert
    def insert(self, key: bytes, namespace: str, device_pages: list[int], draft_pages: int = 0) -> InsertResult:
        """Insert whole pages ``key`` whose owned L1 ids are ``device_pages``.

        Pages already on L1 keep the tree's ids (the caller's become
        ``duplicates``); pages the tree holds only on L2 adopt the caller's
        ids. The caller vouches that logical pages ``[0, draft_pages)`` hold
        valid draft rows: new nodes are flagged accordingly (split at that
        boundary), and tree pages on L1 without valid draft rows are upgraded,
        listing in ``draft_copies`` the ids whose draft planes the caller must
        copy over. Splits nodes as needed. ``created`` lists the new nodes (what
        a write-through caller backs up); the tree calls nothing.
        """
        pb = self.page_bytes
        n = len(key)
        if n % pb or len(device_pages) != self.owned(0, n // pb):
            raise CacheStateError(f"insert: a key of {n} bytes (pages of {pb}) with {len(device_pages)} "
                                  f"page ids; it needs whole pages and one id per owned page")
        self.clock += 1
        node = self.root(namespace)
        pos = at = new = 0
        pages: list[int] = []
        dups: list[int] = []
        copies: list[tuple[int, int]] = []
        created: list[Node] = []
        dp = draft_pages
        while pos < n:
            child = node.children.get(key[pos:pos + pb])
            if child is None:
                created = self._add_new(node, key[pos:], device_pages[at:], dp)
                pages += device_pages[at:]
                new = (n - pos) // pb
                node = created[-1]
                break
            if pos + len(child.key) <= n and key.startswith(child.key, pos):
                p = child.num_pages
            else:
                p = self._common_pages(key, pos, n, child)
                if p < child.num_pages:
                    child = self._split(child, p)
            s = child.start_page
            if s < dp < s + p and not (child.device_pages is not None and child.draft_device):
                p = dp - s  # the draft boundary falls inside: the upper part changes flag
                child = self._split(child, p)
            cnt = self.owned(s, p)
            pages += self._meet(child, device_pages[at:at + cnt], s + p <= dp, dups, copies)
            child.last_access = self.clock
            at += cnt
            pos += p * pb
            node = child
        return InsertResult(node, pages, dups, new, tuple(copies), tuple(created))

    def _meet(self, child: Node, mine: list[int], vouched: bool, dups: list[int],
              copies: list[tuple[int, int]]) -> list[int]:
        """``insert`` reached ``child`` (fully covered) with the caller's ids ``mine``
        (``vouched``: their draft rows are valid). Returns the ids now serving it."""
        if child.device_pages is None:  # L2-only: the caller's pages bring it back to L1
            child.device_pages = list(mine)
            child.draft_device = vouched
            self.device_ids_held += len(mine)
            self.device_candidates.add(child)
            self.device_candidates.discard(child.parent)
            return mine
        if mine != child.device_pages:
            dups += [a for a, b in zip(mine, child.device_pages) if a != b]
        if vouched and not child.draft_device:
            copies += [(a, b) for a, b in zip(mine, child.device_pages) if a != b]
            child.draft_device = True
        return child.device_pages

    def _add_new(self, parent: Node, key: bytes, device_pages: list[int], draft_pages: int) -> list[Node]:
        """New node(s) for ``key`` under ``parent``: two when the draft boundary falls inside."""
        node = self._add_child(parent, key, device_pages)
        s = node.start_page
        if s < draft_pages < s + node.num_pages:
            up = self._split(node, draft_pages - s)
            up.draft_device = True
            return [up, node]
        node.draft_device = s + node.num_pages <= draft_pages
        return [node]

    def _add_child(self, parent: Node, key: bytes, device_pages: list[int]) -> Node:
        pb = self.page_bytes
        start = parent.start_page + parent.num_pages
        node = Node(key, len(key) // pb, start, parent, parent.namespace, self._nid(),
                    device_pages=list(device_pages), last_access=self.clock)
        parent.children[key[:pb]] = node
        self.device_ids_held += len(device_pages)
        self.device_candidates.add(node)
        self.device_candidates.discard(parent)
        self.num_nodes += 1
        return node

    def _split(self, child: Node, p: int) -> Node:
        """Cut ``child`` after ``p`` pages; return the new upper node (same locks)."""
        pb = self.page_bytes
        k = self.owned(child.start_page, p)
        up = Node(child.key[:p * pb], p, child.start_page, child.parent, child.namespace, self._nid(),
                  in_storage=child.in_storage, lock_ref=child.lock_ref,
                  host_lock_ref=child.host_lock_ref, wait_ref=child.wait_ref, last_access=child.last_access,
                  hit_count=child.hit_count, draft_device=child.draft_device, draft_host=child.draft_host)
        if child.device_pages is not None:
            up.device_pages, child.device_pages = child.device_pages[:k], child.device_pages[k:]
        if child.host_pages is not None:
            up.host_pages, child.host_pages = child.host_pages[:k], child.host_pages[k:]
        if child.hashes is not None:
            up.hashes, child.hashes = child.hashes[:p], child.hashes[p:]
        child.parent.children[up.key[:pb]] = up
        child.key = child.key[p * pb:]
        child.num_pages -= p
        child.start_page += p
        child.parent = up
        up.children[child.key[:pb]] = child
        self.num_nodes += 1
        return up

    # -------------------------------------------------------------------- locks
    def lock(self, node: Node) -> None:
        """Pin ``node`` and its ancestors on L1 (``lock_ref += 1``)."""
        if node.device_pages is None:
            raise CacheStateError(f"cannot lock {node!r}: it is not on L1; load it back first")
        while node.parent is not None:
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: Node) -> None:
        while node.parent is not None:
            if node.lock_ref <= 0:
                raise CacheStateError(f"unlock of unlocked {node!r}")
            node.lock_ref -= 1
            node = node.parent

    def host_lock(self, node: Node) -> None:
        """Pin ``node`` and its ancestors on L2 (``host_lock_ref += 1``)."""
        if node.host_pages is None:
            raise CacheStateError(f"cannot host-lock {node!r}: it is not on L2")
        while node.parent is not None:
            node.host_lock_ref += 1
            node = node.parent

    def host_unlock(self, node: Node) -> None:
        while node.parent is not None:
            if node.host_lock_ref <= 0:
                raise CacheStateError(f"host unlock of unlocked {node!r}")
            node.host_lock_ref -= 1
            node = node.parent

    def wait(self, node: Node, delta: int) -> None:
        """Add ``delta`` to ``wait_ref`` on ``node``'s path (a waiting request's cached prefix).
        ``node`` may have left the tree since: its parents still lead to the root."""
        while node.parent is not None:
            node.wait_ref += delta
            if node.wait_ref < 0:
                raise CacheStateError(f"wait_ref of {node!r} went negative")
            node = node.parent

    def touch(self, node: Node) -> None:
        """Record a use of ``node``'s path: access time and hit count."""
        self.device_candidates.touched(node)  # before the clock moves: learning policies read the idle time
        self.host_candidates.touched(node)
        self.clock += 1
        t = self.clock
        while node.parent is not None:
            node.last_access = t
            node.hit_count += 1
            node = node.parent

    # -------------------------------------------------------------- tier hooks
    def set_host(self, node: Node, host_pages: Sequence[HostPageId], draft: bool | None = None) -> None:
        """Attach L2 copies. Call only once every plane of every page is on L2.
        ``draft``: the copies' draft rows are valid (default: they were on L1
        when copied, ``node.draft_device``; pass the value seen at copy time)."""
        if node.host_pages is not None or (node.parent is not None and node.parent.host_pages is None):
            raise CacheStateError(f"set_host on {node!r}: it already has host pages or its parent "
                                  "is not on L2 (L2 must stay prefix-closed)")
        want = self.owned(node.start_page, node.num_pages)
        if len(host_pages) != want:
            raise CacheStateError(f"set_host on {node!r}: got {len(host_pages)} host pages, "
                                  f"this rank owns {want} of its pages")
        node.host_pages = list(host_pages)
        node.draft_host = node.draft_device if draft is None else draft
        self.host_ids_held += want
        self.host_candidates.added(node)

    def set_device(self, node: Node, device_pages: Sequence[DevicePageId]) -> None:
        """Attach L1 pages to an L2-only node (after a load back completed)."""
        if node.device_pages is not None or node.parent is None or node.parent.device_pages is None:
            raise CacheStateError(f"set_device on {node!r}: it is already on L1 or its parent is "
                                  "not (L1 must stay prefix-closed); load parents first")
        want = self.owned(node.start_page, node.num_pages)
        if len(device_pages) != want:
            raise CacheStateError(f"set_device on {node!r}: got {len(device_pages)} pages, need {want}")
        node.device_pages = list(device_pages)
        node.draft_device = node.draft_host  # the load back copies every plane
        self.device_ids_held += want
        self.device_candidates.add(node)
        self.device_candidates.discard(node.parent)

    def insert_host(self, key: bytes, namespace: str, first_page: int,
                    host_pages: list[int], draft: bool = True) -> tuple[Node | None, list[int]]:
        """Add pages ``[first_page, len(key) // page)`` of ``key`` as L2-only pages
        (an L3 prefetch landing in L2), holding ``host_pages`` (cp_size 1 only).

        Pages the tree already has keep the tree's copies; the walk stops where
        the path is not on L2 (L2 must stay prefix-closed). Returns the deepest
        node now covering the key on L2 (None if nothing new) and the host ids
        the tree did not take, which the caller frees.
        """
        pb = self.page_bytes
        n = len(key)
        if n % pb or len(host_pages) != n // pb - first_page:
            raise CacheStateError(f"insert_host: a key of {n} bytes (pages of {pb}) from page {first_page} "
                                  f"with {len(host_pages)} L2 ids; it needs one id per page from there")
        node = self.root(namespace)
        pos = 0
        while pos < n:
            child = node.children.get(key[pos:pos + pb])
            if child is None:
                break
            p = child.num_pages if (pos + len(child.key) <= n and key.startswith(child.key, pos)) \
                else self._common_pages(key, pos, n, child)
            if child.host_pages is None:
                return None, list(host_pages)  # L2 is not prefix-closed beyond here
            if p < child.num_pages:
                child = self._split(child, p)
            pos += p * pb
            node = child
        start = pos // pb
        if start < first_page or start == n // pb:
            return None, list(host_pages)  # a gap before our pages, or nothing new
        used = host_pages[start - first_page:]
        self.clock += 1
        new = Node(key[pos:], n // pb - start, start, node, namespace, self._nid(),
                   host_pages=list(used), last_access=self.clock, draft_host=draft)
        node.children[key[pos:pos + pb]] = new
        self.host_ids_held += len(used)
        self.num_nodes += 1
        self.host_candidates.added(new)
        return new, list(host_pages[:start - first_page])

    def set_stored(self, node: Node, stored: bool = True) -> None:
        node.in_storage = stored

    def split_at(self, node: Node, num_pages: int) -> Node:
        """Make a node boundary ``num_pages`` into ``node``; returns the upper part."""
        if not 0 < num_pages <= node.num_pages:
            raise CacheStateError(f"split_at {num_pages} outside (0, {node.num_pages}] of {node!r}")
        return node if num_pages == node.num_pages else self._split(node, num_pages)

    def path(self, node: Node, stop: Node | None = None) -> list[Node]:
        """Nodes from just below ``stop`` (default: the root) down to ``node``."""
        out = []
        while node is not None and node is not stop and node.parent is not None:
            out.append(node)
            node = node.parent
        out.reverse()
        return out

    def hashes(self, node: Node) -> list[PageHash]:
        """Chained page hashes of ``node`` (computed once, cached on the path)."""
        todo = []
        n = node
        while n.parent is not None and n.hashes is None:
            todo.append(n)
            n = n.parent
        prev = namespace_root(node.namespace) if n.parent is None else n.hashes[-1]
        for n in reversed(todo):
            n.hashes = raw_page_hashes(n.key, self.page_size, prev)
            prev = n.hashes[-1]
        return node.hashes if node.parent is not None else []

    # ----------------------------------------------------------------- eviction
    def iter_nodes(self) -> Iterator[Node]:
        """Every non-root node, parents before children. Do not mutate while iterating."""
        stack = list(self._roots.values())
        while stack:
            n = stack.pop()
            if n.parent is not None:
                yield n
            stack.extend(n.children.values())

    def _device_evictable(self, n: Node, unlocked: bool = True) -> bool:
        """An L1 leaf (and, with ``unlocked``, not pinned): what device eviction may take."""
        return (n.parent is not None and n.device_pages is not None and not (unlocked and n.lock_ref)
                and not any(c.device_pages is not None for c in n.children.values()))

    def _host_evictable(self, n: Node) -> bool:
        return (n.parent is not None and n.host_pages is not None and n.host_lock_ref == 0
                and not any(c.host_pages is not None for c in n.children.values()))

    def device_victims(self, num_pages: int, policy: EvictionPolicy) -> list[Node]:
        """Step 1 of L1 eviction: the unlocked L1 leaves to evict, in ``policy``
        order, covering at least ``num_pages`` logical pages (fewer only when
        nothing else is evictable); parents that become leaves once their
        children go are included after them. Mutates no node. Step 2 is the
        caller's: back up (``set_host``) what must stay on L2; step 3 is
        ``drop_device`` of the same list.

        Page-granular: when the last victim holds more pages than are still needed,
        it is split and only its tail is chosen (its head stays, still a prefix of
        the sequence), so eviction takes what was asked, not whole nodes. The split
        changes no page's tier.

        Pages a waiting request will hit (``Node.wait_ref``, see
        ``PrefixCache.note_waiting``) go only after every other candidate."""
        victims = self.device_candidates.choose(num_pages, policy, (_waited,))
        over = sum(n.num_pages for n in victims) - num_pages
        if over > 0 and victims[-1].num_pages > over:
            self._split(victims[-1], over)  # the victim keeps its identity: it is now the tail
        return victims

    def drop_device(self, victims: Sequence[Node]) -> Dropped:
        """Take ``victims`` off L1 in order (skipping any no longer an unlocked L1
        leaf). A victim with L2 copies stays as an L2-only node; others are
        removed. Returns the freed L1 ids (the caller frees them) and the
        logical pages evicted; bumps ``epoch`` if any."""
        freed: list[DevicePageId] = []
        got = 0
        for n in victims:
            if not self._device_evictable(n):
                continue
            freed.extend(n.device_pages)
            self.device_ids_held -= len(n.device_pages)
            n.device_pages = None
            n.draft_device = False
            self.device_candidates.discard(n)
            parent = n.parent
            if n.host_pages is None:
                self._remove(n)
            if self._device_evictable(parent, unlocked=False):
                self.device_candidates.add(parent)
            got += n.num_pages
        if got:
            self.epoch += 1
        return Dropped(freed, got)

    def host_victims(self, num_pages: int, policy: EvictionPolicy) -> list[Node]:
        """L2 leaves with ``host_lock_ref == 0`` to drop, in ``policy`` order,
        covering at least ``num_pages`` logical pages (parents that become L2
        leaves after them). Mutates no node; pass the list to ``drop_host``.

        L2 copies of pages L1 also holds go only after every other candidate: under
        write_through that keeps L2 a superset of L1 whatever the policy (dropping
        the copy of an L1 page would leave it with one copy, lost when L1 evicts it).
        Before those, but after the rest, go pages a waiting request will hit."""
        return self.host_candidates.choose(num_pages, policy, (_waited, _on_l1))

    def drop_host(self, victims: Sequence[Node]) -> Dropped:
        """Drop ``victims``' L2 copies in order (skipping any no longer an
        unpinned L2 leaf); L2 stays prefix-closed. A node also on L1 keeps its
        L1 pages; others are removed. Returns the freed L2 ids and pages."""
        freed: list[HostPageId] = []
        got = 0
        for n in victims:
            if not self._host_evictable(n):
                continue
            freed.extend(n.host_pages)
            self.host_ids_held -= len(n.host_pages)
            n.host_pages = None
            n.draft_host = False
            self.host_candidates.dropped(n)
            parent = n.parent
            if n.device_pages is None:
                self._remove(n)
            if parent.parent is not None and parent.host_pages is not None:
                self.host_candidates.push(parent)
            got += n.num_pages
        if got:
            self.epoch += 1
        return Dropped(freed, got)

    def _remove(self, n: Node) -> None:
        if n.children or n.lock_ref or n.host_lock_ref:
            raise CacheStateError(f"cannot remove {n!r}: it has children or holders")
        del n.parent.children[n.key[:self.page_bytes]]
        self.num_nodes -= 1

    def check_integrity(self) -> TreeCensus:
        """Check invariants 1-3 and 5 of DESIGN.md and the tree's own bookkeeping
        (``hicache.index.radix_check``); return every page id held (the cache checks
        pool accounting, invariant 4)."""
        leaves = {n for n in self.iter_nodes() if self._device_evictable(n, unlocked=False)}
        return check_tree(TreeFacts(self._roots, list(self.iter_nodes()), self.page_bytes, self.owned,
                                    leaves, self.device_candidates.leaves,
                                    (self.num_nodes, self.device_ids_held, self.host_ids_held)))
