"""The engine-facing prefix cache: one ``PrefixCache`` per engine (per CP rank).

A scheduler loop uses it like this::

    req = cache.new_request(rid, prompt_ids, namespace=lora_name)
    m = req.match()                     # pure: per-tier, page-floored hits
    req.lock(m)                         # pin the device hit, adopt its pages
    new_pages = req.alloc(chunk_len)    # L1 pages for the tokens to compute (evicts if needed)
    ...forward pass writes KV into req.pages...
    req.commit()                        # after each prefill chunk: full pages become shared
    req.extend([next_token]); req.alloc(1); req.commit()   # decode steps
    req.finish()                        # or req.abort() / req.preempt()
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Iterator, NamedTuple, Sequence

from hicache.core.errors import CacheStateError, IntegrityError, OutOfPages, StaleMatch
from hicache.core.layout import KVLayout
from hicache.core.stats import CacheStats
from hicache.core.types import DevicePageId, HostPageId
from hicache.core.cp import CPRowOrder, make_ownership, PageOwnership
from hicache.index.eviction import EvictionPolicy, make_policy
from hicache.index.node import check_request_pages, draft_prefix_pages, Dropped, InsertResult, Node
from hicache.index.radix import RadixTree
from hicache.index.request import as_key, MatchResult, Request, RequestState, Tokens
from hicache.memory.allocator import PageAllocator
from hicache.memory.pools import DevicePool, HostPool


__all__ = ["PrefixCache", "CacheStats", "Request", "RequestState", "Tokens", "as_key"]  # MatchResult: hicache.index.request

log = logging.getLogger(__name__)


def _allocator(pool: DevicePool | HostPool | PageAllocator | None) -> PageAllocator | None:
    return pool.allocator if isinstance(pool, (DevicePool, HostPool)) else pool


class PrefixCache:
    """Index + allocation for one engine (one CP rank).

    ``device`` is the L1 pool (or its allocator); ``host`` the L2 pool (or
    allocator) when a tiering controller runs on top. ``eviction`` /
    ``host_eviction`` name policies in ``hicache.index.eviction.POLICIES``;
    ``ownership`` a CP page ownership in ``hicache.core.cp.OWNERSHIPS``.

    Layouts with draft planes: requests are draft requests by default (they
    hit only draft-complete pages, see ``RadixTree.match``); an engine that
    does not run its draft head passes ``draft=False`` to ``new_request``.
    When a request supplies the draft rows a cached page lacked, the index
    flags the page complete; copying those rows onto the cached page is the
    caller's (``InsertResult.draft_copies``, done by ``hicache.HiCache``).

    This is the only way into the index: nothing outside reaches ``tree``.

    Equivalents: SGLang ``match_prefix`` = ``match``, ``cache_unfinished_req`` =
    ``commit``, ``cache_finished_req`` = ``finish``; vLLM
    ``get_num_new_matched_tokens`` = ``match().device_tokens``,
    ``request_finished`` = ``finish``.

    Hit rules. Scheduler-visible hits are whole pages: ``device_tokens``, then
    ``host_tokens`` continuing it. A request's partial last page is private to
    it; only its own refresh (``req.match()`` while it holds that page, also
    after ``preempt``) counts it, in ``exact_tokens``. Nothing here copies KV and
    nothing calls up: eviction is ``device_victims`` -> the caller's write-back ->
    ``drop_device``; an insert reports the nodes it created and the draft planes
    the caller must copy (``hicache.cache.hicache`` acts on both); ``set_host`` /
    ``set_device`` record what a tiering controller moved. Not thread-safe: one
    scheduler thread.
    """

    def __init__(self, layout: KVLayout, device: DevicePool | PageAllocator,
                 host: HostPool | PageAllocator | None = None, *,
                 eviction: str | EvictionPolicy = "lru", host_eviction: str | EvictionPolicy = "lru",
                 ownership: str | PageOwnership = "round_robin"):
        self.layout = layout
        self.page_size = layout.page_size
        self.device_allocator = _allocator(device)
        self.device_pool = device if isinstance(device, DevicePool) else None
        self.host_allocator = _allocator(host)
        self.ownership = make_ownership(ownership, layout.cp_size)
        self.row_order = CPRowOrder(self.ownership, layout.page_size)
        self.policy = make_policy(eviction)
        self.host_policy = make_policy(host_eviction)
        self.tree = RadixTree(layout.page_size, self.ownership, layout.cp_rank,
                              draft=layout.draft_layers > 0)
        self._waiting_seq = 0
        self._draft_warned: set[int] = set()  # causes already logged (one warning per cause)
        self.requests: dict[str, Request] = {}  # live (not finished/aborted) requests by id
        self._stats = CacheStats()
        # Waiting requests (arrived, not admitted): rid -> the deepest node of their cached
        # prefix when noted, counted in ``wait_ref`` along its path (``note_waiting``).
        self.waiting: dict[str, Waiting] = {}
        self._ext_locks: dict[Node, int] = {}  # holders outside requests (transfers)
        self._ext_host_locks: dict[Node, int] = {}

    # ---------------------------------------------------------------- requests
    def new_request(self, rid: str, tokens: Tokens, namespace: str = "", *, draft: bool | None = None) -> Request:
        """A WAITING handle for ``tokens``; ``rid`` must not be live. ``draft``: the
        request runs the draft head (default: the layout has draft planes)."""
        return self.add_request(Request(self, rid, as_key(tokens), namespace,
                                        self.tree.draft if draft is None else draft))

    def add_request(self, req: Request) -> Request:
        """Register a handle built on this cache (a subclass of ``Request``, e.g.
        ``hicache.cache.hicache.TieredRequest``); its ``rid`` must not be live."""
        rid = req.rid
        if rid in self.requests:
            raise CacheStateError(f"request id {rid!r} is already live ({self.requests[rid]!r}); "
                                  "finish or abort it first")
        self.requests[rid] = req
        self._stats.requests += 1
        return req

    # ------------------------------------------------------- waiting requests
    def note_waiting(self, rid: str, tokens: Tokens, namespace: str = "", *, priority: int = 0,
                     matched: MatchResult | None = None) -> int:
        """A request that has arrived but is not admitted yet will need ``tokens``: the
        prefix of them cached now (L1, then L2 continuing it) is evicted only after every
        other candidate, until ``forget_waiting(rid)``. Noting ``rid`` again replaces its
        entry (call it when the prefix grew, e.g. after a prefetch). ``priority``: higher
        is admitted sooner (orders ``waiting_order``). Returns the cached tokens now
        protected. Mutates only ``wait_ref`` counts; the protection is a preference, not a
        pin: when nothing else is left, protected pages go too (the request then misses them).

        For an engine that owns its scheduler (an engine KV connector over this index,
        e.g. vLLM's): call it for each waiting request the scheduler asks about (vLLM:
        ``get_num_new_matched_tokens`` of a request not yet allocated, with its prompt
        token ids; calling it each step keeps the protection current), and call
        ``forget_waiting`` once the request is allocated, finished or aborted. ``rid``
        is the engine's request id. ``matched``: this cache's ``match`` of ``tokens`` just made
        (the prefix it found is the one protected; a stale one is matched again). Not
        thread-safe: the scheduler thread."""
        old = self.waiting.get(rid)
        self.forget_waiting(rid)
        key = tokens if type(tokens) is bytes else as_key(tokens)
        if matched is not None and matched.epoch == self.tree.epoch:
            node, pages = matched.host_node, matched.tokens // self.page_size
        else:
            h = self.tree.match(key, namespace)
            node, pages = h.host_node, h.device_num_pages + h.host_num_pages
        if old is None:
            self._waiting_seq += 1
        seq = self._waiting_seq if old is None else old.seq  # noted again: keeps its place
        if node is not None and node.parent is not None and pages:
            node = self._lock_target(node, pages)  # protect no page past the prefix
            self.tree.wait(node, 1)
        else:
            node = None
        self.waiting[rid] = Waiting(key, namespace, priority, seq, node, pages)
        return pages * self.page_size

    def refresh_waiting(self) -> int:
        """Note again every waiting request whose cached prefix grew since it was noted
        (a request sharing it finished). Returns how many grew. Called when a request
        finishes; one lookup per waiting request."""
        grown = 0
        for rid, w in list(self.waiting.items()):
            h = self.tree.match(w.key, w.namespace)
            if h.device_num_pages + h.host_num_pages > w.pages:
                self.note_waiting(rid, w.key, w.namespace, priority=w.priority)
                grown += 1
        return grown

    def forget_waiting(self, rid: str) -> None:
        """``rid`` was admitted, finished or aborted: its pages lose the protection of
        ``note_waiting``. A no-op for an id not noted."""
        w = self.waiting.pop(rid, None)
        if w is not None and w.node is not None:
            self.tree.wait(w.node, -1)

    def waiting_order(self) -> list[str]:
        """Noted request ids, the next to be admitted first: higher priority, then arrival."""
        return sorted(self.waiting, key=lambda r: (-self.waiting[r].priority, self.waiting[r].seq))

    def match(self, tokens: Tokens, namespace: str = "", *, max_tokens: int | None = None,
              need_draft: bool = False) -> MatchResult:
        """Page-floored hits of ``tokens`` (L1, then L2 continuing it). Mutates only
        ``stats.lookups``; pass a bytes key (``as_key``) to skip conversion.
        ``need_draft``: only pages whose draft planes are complete on the tier
        they would be served from (the hit stops at the first that is not).

        Unlike ``Request.match``, the hit is not capped below the last token: a
        fully cached prompt is a full hit here (what a router asks), while a
        request's own refresh keeps at least one token to compute."""
        key = tokens if type(tokens) is bytes else as_key(tokens)
        ps = self.page_size
        tree = self.tree
        cap = None if max_tokens is None else max_tokens // ps
        h = tree.match(key, namespace, cap, need_draft)
        self._stats.lookups += 1
        d, hs = h[0] * ps, h[1] * ps
        if not h.draft_cut:
            return MatchResult(d, hs, d + hs, h[2], h[3], tree.epoch, tree)
        full = tree.match(key, namespace, cap)
        lost = (full[0] + full[1]) * ps - d - hs
        return MatchResult(d, hs, d + hs, h[2], h[3], tree.epoch, tree, h.draft_cut, lost)

    def _draft_truncated(self, m: MatchResult) -> None:
        self._stats.draft_truncated_hits += 1
        self._stats.draft_truncated_tokens += m.draft_cut_tokens
        if m.draft_cut not in self._draft_warned:
            self._draft_warned.add(m.draft_cut)
            log.warning("hit truncated to %d tokens (%d more cached): %s, e.g. pages computed by an "
                        "engine not running its draft head; recomputing them. Logged once per cause; "
                        "see stats draft_truncated_hits/tokens", m.tokens, m.draft_cut_tokens,
                        m.draft_cut.reason)

    def _draft_prefix(self, node: Node | None) -> int:
        """Tokens from 0 whose L1 draft planes are complete on ``node``'s path."""
        path = self.tree.path(node) if node is not None else []
        return draft_prefix_pages(path) * self.page_size

    # ---------------------------------------------------------------- eviction
    def device_victims(self, num_pages: int, policy: str | EvictionPolicy | None = None) -> list[Node]:
        """Step 1 of L1 eviction (pure): unlocked L1 leaves covering at least
        ``num_pages`` logical pages, in eviction order (see ``RadixTree.device_victims``).
        Back up what must survive on L2 (``set_host``), then ``drop_device``."""
        pol = self.policy if policy is None else make_policy(policy)
        return self.tree.device_victims(num_pages, pol)

    def drop_device(self, victims: list[Node]) -> int:
        """Step 3 of L1 eviction: take ``victims`` off L1 and free their ids.
        Returns the logical pages evicted. Invalidates older matches."""
        d = self.tree.drop_device(victims)
        self.free_device(d.freed)
        self._stats.device_evicted_pages += d.pages
        return d.pages

    def evict(self, num_pages: int, policy: str | EvictionPolicy | None = None) -> int:
        """Take at least ``num_pages`` logical pages off L1 without a write-back
        (unlocked leaves first, by ``policy`` or the cache's), freeing their ids.
        Returns pages evicted (fewer only when nothing else is evictable)."""
        return self.drop_device(self.device_victims(num_pages, policy))

    def evict_host(self, num_pages: int, policy: str | EvictionPolicy | None = None) -> list[HostPageId]:
        """Drop at least ``num_pages`` logical pages from L2 (never host-locked
        ones; L2 stays prefix-closed). Returns the freed L2 ids, already
        returned to the host allocator when the cache has one."""
        pol = self.host_policy if policy is None else make_policy(policy)
        d: Dropped = self.tree.drop_host(self.tree.host_victims(num_pages, pol))
        if d.freed and self.host_allocator is not None:
            self.host_allocator.free(d.freed)
        self._stats.host_evicted_pages += d.pages
        return d.freed

    # ------------------------------------------------ request locks (the one owner)
    def refresh(self, req: Request) -> MatchResult:
        """``req``'s hit for its tokens (at most all but the last; see ``Request.match``).
        Pure apart from ``stats.lookups``."""
        m = self.match(req.key, req.namespace, max_tokens=max(0, req.num_tokens - 1), need_draft=req.draft)
        exact = req.exact_tokens_for(m.tokens)
        return m if exact == m.tokens else m._replace(exact_tokens=exact)

    def lock(self, req: Request, m: MatchResult) -> None:
        """Pin ``m``'s device hit and make it ``req``'s computed prefix (see ``Request.lock``):
        WAITING or PREEMPTED -> RUNNING; ``StaleMatch`` on a match older than the last eviction."""
        req._check(RequestState.WAITING, RequestState.PREEMPTED, op="lock")
        self.forget_waiting(req.rid)  # admitted: its hit is pinned from here on
        if m.epoch != self.tree.epoch:
            raise StaleMatch(f"request {req.rid!r}: match from epoch {m.epoch}, the cache is at "
                             f"epoch {self.tree.epoch} (pages were evicted since); call match() again")
        ps = self.page_size
        req.pages = list(m.device_pages)
        req.shared_pages = m.device_tokens // ps
        req.computed_tokens = m.device_tokens
        tail_kept = (req.state is RequestState.PREEMPTED and m.host_tokens == 0
                     and m.exact_tokens > m.device_tokens and req._tail_page == req.shared_pages)
        if tail_kept:
            req.pages += req._tail
            req.computed_tokens = m.exact_tokens
        elif req._tail:
            self.free_device(req._tail)
        req._tail, req._tail_tokens = [], 0
        req.allocated_tokens = req.computed_tokens
        req.node, req.draft_tokens = self.lock_hit(req, m)
        req._draft_shared = req.draft_tokens // ps
        req.state = RequestState.RUNNING

    def lock_hit(self, req: Request, m: MatchResult) -> tuple[Node | None, int]:
        """``lock``'s part on the index: pin the first ``req.shared_pages`` of
        ``m``'s device hit (split to end there), touch it and count the admission.
        Returns the locked node (None: nothing shared) and, for a draft request, the
        tokens from 0 whose draft rows are complete on its path (else 0)."""
        node = self._lock_target(m.device_node, req.shared_pages) if req.shared_pages else None
        draft_tokens = self._draft_prefix(node) if req.draft else 0
        if node is not None:
            self.tree.lock(node)
            self.tree.touch(node)
        s = self._stats
        s.admitted_tokens += req.num_tokens
        s.device_hit_tokens += m.device_tokens
        s.device_hit_exact_tokens += req.computed_tokens
        s.host_hit_tokens += m.host_tokens
        s.host_hit_exact_tokens += m.host_tokens
        if m.draft_cut:
            self._draft_truncated(m)
        return node, draft_tokens

    def share(self, req: Request, num_pages: int, draft_pages: int) -> InsertResult:
        """Insert ``req``'s first ``num_pages`` computed pages (``draft_pages`` of them
        with valid draft rows) and lock the deepest node of the result for it (the
        caller unlocks its old node). Returns what the insert did."""
        k = self.owned(0, num_pages)
        res = self.tree.insert(req.key[:num_pages * 4 * self.page_size], req.namespace, req.pages[:k],
                               draft_pages)
        self.tree.lock(res.node)
        self._stats.inserted_pages += res.new_pages
        self._stats.duplicate_pages += len(res.duplicates)
        return res

    def unlock(self, node: Node) -> None:
        """Release one request lock on ``node``'s path."""
        self.tree.unlock(node)

    def adopted(self, res: InsertResult) -> None:
        """A share's duplicates are no longer needed (their draft planes were copied): free them."""
        self._stats.draft_upgraded_pages += len(res.draft_copies)
        self.free_device(res.duplicates)

    def request_ended(self, req: Request, state: RequestState) -> None:
        """``req`` released what it held and is now ``state`` (FINISHED and ABORTED
        leave the live set; PREEMPTED stays, holding at most its tail)."""
        s = self._stats
        if state is RequestState.PREEMPTED:
            s.requests_preempted += 1
            return
        self.forget_waiting(req.rid)
        self.requests.pop(req.rid, None)
        if state is RequestState.FINISHED:
            s.requests_finished += 1
            if self.waiting:
                self.refresh_waiting()  # what it inserted may be a waiting request's prefix
        else:
            s.requests_aborted += 1

    def _lock_target(self, node: Node, num_pages: int) -> Node:
        """The node ending exactly at logical page ``num_pages`` on ``node``'s path,
        split out if needed so a lock pins no page the holder does not use."""
        while node.start_page >= num_pages:  # an insert split it after the match
            node = node.parent
        return self.tree.split_at(node, num_pages - node.start_page)

    def alloc_device(self, n: int) -> list[DevicePageId]:
        """``n`` L1 pages held privately by the caller (free them with ``free_device``
        or hand them to the index); evicts without a write-back when short.
        Raises ``OutOfPages`` (allocating nothing) if eviction cannot make room."""
        a = self.device_allocator
        while a.num_free < n:
            if not self.evict(n - a.num_free):
                reqs = sum(r.node is not None for r in self.requests.values())
                transfers = sum(self._ext_locks.values())
                raise OutOfPages(f"L1: need {n} pages, {a.num_free} free and nothing evictable: the "
                                 f"{self.tree.device_ids_held} pages the index holds are pinned by {reqs} "
                                 f"request lock(s) and {transfers} in-flight transfer lock(s) (L2 backups, "
                                 "load backs); " + ("poll() or drain() to finish the transfers, then retry; "
                                 if transfers else "") + "finish or preempt requests, or enlarge "
                                 "pool.device_pages")
        return a.alloc(n)

    def free_device(self, ids: list[DevicePageId]) -> None:
        if ids:
            self.device_allocator.free(ids)

    # ------------------------------------------------------------ tier records
    def owned(self, start_page: int, num_pages: int) -> int:
        """Pages this CP rank owns among logical pages ``[start_page, start_page + num_pages)``."""
        return self.tree.owned(start_page, num_pages)

    @property
    def epoch(self) -> int:
        """Bumps whenever pages leave a tier: a ``MatchResult`` from an older epoch is stale."""
        return self.tree.epoch

    @property
    def has_draft(self) -> bool:
        """The layout has draft planes (their completeness is tracked per node and tier)."""
        return self.tree.draft

    def owns(self, logical_page: int) -> bool:
        """This CP rank holds ``logical_page`` on its tiers."""
        return self.ownership.owner(logical_page) == self.tree.cp_rank

    def nodes(self) -> Iterator[Node]:
        """Every indexed node, parents before children (read-only; do not mutate the
        cache while iterating)."""
        return self.tree.iter_nodes()

    def insert_device(self, key: bytes, namespace: str, device_pages: list[DevicePageId],
                      draft_pages: int = 0) -> InsertResult:
        """Index whole pages ``key`` held in L1 ``device_pages`` outside any request
        (pages loaded from the node's shared L2; see ``RadixTree.insert``)."""
        res = self.tree.insert(key, namespace, list(device_pages), draft_pages)
        self._stats.inserted_pages += res.new_pages
        return res

    def inc_lock(self, node: Node) -> None:
        """Pin ``node``'s path on L1 for a holder outside requests (e.g. a transfer)."""
        self.tree.lock(node)
        self._ext_locks[node] = self._ext_locks.get(node, 0) + 1

    def dec_lock(self, node: Node) -> None:
        self._ext_release(self._ext_locks, node, "dec_lock")
        self.tree.unlock(node)

    def inc_host_lock(self, node: Node) -> None:
        """Pin ``node``'s path on L2 (e.g. while loading it back or backing it up)."""
        self.tree.host_lock(node)
        self._ext_host_locks[node] = self._ext_host_locks.get(node, 0) + 1

    def dec_host_lock(self, node: Node) -> None:
        self._ext_release(self._ext_host_locks, node, "dec_host_lock")
        self.tree.host_unlock(node)

    @staticmethod
    def _ext_release(held: dict[Node, int], node: Node, op: str) -> None:
        n = held.get(node, 0)
        if n == 0:
            raise CacheStateError(f"{op}({node!r}) without a matching inc")
        if n == 1:
            del held[node]
        else:
            held[node] = n - 1

    # ------------------------------------------------------------- statistics
    def stats(self) -> CacheStats:
        """A snapshot (a new object): counters plus current gauges."""
        live = self.requests.values()
        s = dataclasses.replace(
            self._stats,
            device_pages_cached=self.tree.device_ids_held,
            device_pages_private=sum(len(r.private_pages) for r in live),
            device_pages_free=self.device_allocator.num_free,
            host_pages_cached=self.tree.host_ids_held,
            host_pages_free=self.host_allocator.num_free if self.host_allocator else 0,
            nodes=self.tree.num_nodes, live_requests=len(self.requests))
        return s

    # -------------------------------------------------------------- integrity
    def check_integrity(self, *, device_in_flight: Sequence[int] = (),
                        host_in_flight: Sequence[int] = ()) -> None:
        """All five DESIGN.md invariants plus request bookkeeping; raises
        ``IntegrityError``. ``*_in_flight``: ids a controller holds outside the index."""
        census = self.tree.check_integrity()
        check_pool(self.device_allocator, "L1", census.device_ids,
                         [r.private_pages for r in self.requests.values()] + [list(device_in_flight)])
        if self.host_allocator is not None:
            check_pool(self.host_allocator, "L2", census.host_ids, [list(host_in_flight)])
        locks: dict[Node, int] = dict(self._ext_locks)
        for r in self.requests.values():
            check_request(self.tree, r)
            if r.node is not None:
                locks[r.node] = locks.get(r.node, 0) + 1
        waits: dict[Node, int] = {}
        for w in self.waiting.values():
            if w.node is not None:
                waits[w.node] = waits.get(w.node, 0) + 1
        for held, attr in ((locks, "lock_ref"), (self._ext_host_locks, "host_lock_ref"), (waits, "wait_ref")):
            want: dict[Node, int] = {}
            for node, k in held.items():
                n = node
                while n.parent is not None:  # (a waiting request's node may have left the tree)
                    want[n] = want.get(n, 0) + k
                    n = n.parent
            for n in self.tree.iter_nodes():
                if getattr(n, attr) != want.get(n, 0):
                    raise IntegrityError(f"{n!r}: {attr}={getattr(n, attr)} but its holders "
                                         f"account for {want.get(n, 0)}")


class Waiting(NamedTuple):
    """A request noted as waiting (``PrefixCache.note_waiting``)."""

    key: bytes
    namespace: str
    priority: int  # higher: admitted sooner
    seq: int  # order noted (ties of priority: first come first served)
    node: Node | None  # deepest node of its cached prefix when noted (None: nothing cached)
    pages: int  # logical pages of that prefix


def check_pool(alloc: PageAllocator, tier: str, tree_ids: set[int], others: list[list[int]]) -> None:
    alloc.check_integrity()
    seen = set(tree_ids)
    for ids in others:
        for i in ids:
            if i in seen:
                raise IntegrityError(f"{tier} page {i} is held twice (index/requests/in flight)")
            seen.add(i)
    for i in seen:
        if not alloc.is_allocated(i):
            raise IntegrityError(f"{tier} page {i} is held but free in the allocator")
    if len(seen) != alloc.num_used:  # invariant 4: free + held == capacity
        raise IntegrityError(f"{tier}: {alloc.num_used} pages allocated but {len(seen)} held "
                             f"(index {len(tree_ids)}); {alloc.num_used - len(seen)} leaked")


def check_request(tree: RadixTree, r: Request) -> None:
    """``r``'s bookkeeping against the index it holds pages of."""
    ps = tree.page_size
    if r.state is RequestState.PREEMPTED:
        want = tree.owned(r._tail_page, 1) if r._tail_tokens else 0
        if len(r._tail) != want or not 0 <= r._tail_tokens < ps or r.pages:
            raise IntegrityError(f"{r!r}: preempted with tail {r._tail} of {r._tail_tokens} tokens")
        return
    if r.state is RequestState.WAITING:
        if r.pages or r._tail or r.node is not None:
            raise IntegrityError(f"{r!r}: waiting but holds pages or a lock")
        return
    if r.state is not RequestState.RUNNING:
        raise IntegrityError(f"{r!r}: a live request in state {r.state.value}")
    if not (r.computed_tokens <= r.allocated_tokens <= r.num_tokens
            and r.shared_pages == r.computed_tokens // ps and 0 <= r.draft_tokens <= r.computed_tokens):
        raise IntegrityError(f"{r!r}: token accounting broken")
    if len(r.pages) != tree.owned(0, -(-r.allocated_tokens // ps)):
        raise IntegrityError(f"{r!r}: {len(r.pages)} pages for {r.allocated_tokens} allocated tokens")
    h = tree.match(r.key[:r.shared_pages * 4 * ps], r.namespace)
    k = tree.owned(0, r.shared_pages)
    ids = tree.pages(h.device_node, h.device_num_pages)
    if h.device_num_pages != r.shared_pages or ids != r.pages[:k]:
        raise IntegrityError(f"{r!r}: shared pages {r.pages[:k]} are not the index's "
                             f"{ids} ({h.device_num_pages} pages)")
    if r.draft and tree.draft:  # invariant 5: a draft request holds no draft-incomplete page it vouched for
        path = tree.path(h.device_node) if h.device_node is not None else []
        check_request_pages(path, min(r.shared_pages, r.draft_tokens // ps), r)
