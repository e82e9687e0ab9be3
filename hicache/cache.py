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
the caller must copy (``hicache.hicache`` acts on both); ``set_host`` /
``set_device`` record what a tiering controller moved. Not thread-safe: one
scheduler thread.
"""
from __future__ import annotations

import dataclasses
import enum
import logging
from dataclasses import dataclass
from typing import Iterator, NamedTuple, Sequence

import numpy as np
import torch

from hicache.allocator import PageAllocator
from hicache.cp import CPRowOrder, PageOwnership, make_ownership
from hicache.errors import CacheStateError, IntegrityError, OutOfPages, StaleMatch
from hicache.eviction import EvictionPolicy, make_policy
from hicache.hashing import tokens_to_bytes
from hicache.layout import KVLayout
from hicache.pools import DevicePool, HostPool
from hicache.draft import DRAFT_CUTS, check_request_pages, draft_prefix_pages
from hicache.node import Dropped, InsertResult, Node
from hicache.radix import RadixTree
from hicache.types import DevicePageId, HostPageId, PageHash

log = logging.getLogger(__name__)

Tokens = Sequence[int] | np.ndarray | torch.Tensor | bytes


def as_key(tokens: Tokens) -> bytes:
    """Token ids as the index's key (uint32 LE bytes); ``bytes`` pass through."""
    if isinstance(tokens, (bytes, bytearray)):
        if len(tokens) % 4:
            raise ValueError(f"a bytes key holds uint32 ids: length {len(tokens)} is not a multiple of 4")
        return bytes(tokens)
    if isinstance(tokens, torch.Tensor):
        tokens = tokens.detach().cpu().numpy()
    return tokens_to_bytes(tokens)


class MatchResult(NamedTuple):
    """Per-tier hits of one lookup. Valid until the next eviction (``epoch``);
    ``Request.lock`` raises ``StaleMatch`` on an older one."""

    device_tokens: int  # scheduler-visible L1 hit, a whole number of pages
    host_tokens: int  # scheduler-visible L2 hit continuing it, whole pages
    exact_tokens: int  # device + host + the asking request's own private tail continuing them
    device_node: Node | None  # node holding the last device-hit page (lock target)
    host_node: Node | None  # node holding the last host-hit page (== device_node when none)
    epoch: int  # tree epoch when computed
    tree: RadixTree  # to list page ids on demand
    draft_cut: int = 0  # the hit stopped where draft planes are missing (radix.DRAFT_CUTS), else 0
    draft_cut_tokens: int = 0  # whole-page tokens the hit lost to that cut

    @property
    def tokens(self) -> int:
        """Scheduler-visible hit over L1 and L2."""
        return self.device_tokens + self.host_tokens

    @property
    def device_pages(self) -> list[int]:
        """Owned L1 ids of the device hit, logical order (built on each access)."""
        return self.tree.pages(self.device_node, self.device_tokens // self.tree.page_size)

    @property
    def host_pages(self) -> list[int]:
        """Owned L2 ids of the host hit (built on each access); load these back."""
        ps = self.tree.page_size
        return self.tree.pages(self.host_node, self.tokens // ps, self.device_tokens // ps, host=True)

    def host_path(self) -> list[Node]:
        """Nodes of the host hit, top-down (the last may be partly hit)."""
        return self.tree.path(self.host_node, self.device_node) if self.host_tokens else []


@dataclass(slots=True)
class CacheStats:
    """Counters since construction plus gauges at snapshot time. ``as_dict`` for JSON."""

    lookups: int = 0  # PrefixCache.match / Request.match calls
    requests: int = 0  # new_request calls
    requests_finished: int = 0
    requests_aborted: int = 0
    requests_preempted: int = 0
    admitted_tokens: int = 0  # prompt tokens of requests at lock time
    device_hit_tokens: int = 0  # scheduler-visible (page-floored), at lock time
    device_hit_exact_tokens: int = 0  # + own private tails
    host_hit_tokens: int = 0
    host_hit_exact_tokens: int = 0  # == host_hit_tokens: partial pages never reach L2
    inserted_pages: int = 0  # logical pages that entered the index
    duplicate_pages: int = 0  # computed pages freed because the index already had them
    device_evicted_pages: int = 0  # logical pages taken off L1
    host_evicted_pages: int = 0
    draft_truncated_hits: int = 0  # locked hits cut short because draft planes were missing
    draft_truncated_tokens: int = 0  # tokens those hits lost (recomputed instead)
    draft_upgraded_pages: int = 0  # cached pages whose missing draft rows a later request supplied
    device_pages_cached: int = 0  # gauge: owned L1 ids held by the index
    device_pages_private: int = 0  # gauge: owned L1 ids held privately by live requests
    device_pages_free: int = 0
    host_pages_cached: int = 0
    host_pages_free: int = 0
    nodes: int = 0
    live_requests: int = 0

    def as_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)


class RequestState(enum.Enum):
    WAITING = "waiting"  # holds nothing
    RUNNING = "running"  # holds a locked prefix and private pages
    PREEMPTED = "preempted"  # holds at most its private partial page
    FINISHED = "finished"
    ABORTED = "aborted"


class Request:
    """One request's handle. Built by ``PrefixCache.new_request``; every method
    may mutate the cache. ``pages`` is this rank's page table: owned L1 ids for
    logical pages ``[0, ceil(allocated_tokens / page_size))``, the first
    ``shared_pages`` of them held by the index. It is a live list, replaced by
    ``lock`` and rewritten by ``commit`` (duplicates swap to the index's ids):
    re-read it after either."""

    def __init__(self, cache: "PrefixCache", rid: str, key: bytes, namespace: str, draft: bool = False):
        self.cache, self.rid, self.namespace = cache, rid, namespace
        self.draft = draft  # runs the draft head: needs and writes draft rows
        self.draft_tokens = 0  # leading tokens whose draft rows are valid in self.pages
        self._draft_shared = 0  # shared pages the index knows as draft-complete
        self._buf = bytearray(key)
        self._key: bytes | None = key
        self.state = RequestState.WAITING
        self.pages: list[int] = []
        self.shared_pages = 0  # logical pages [0, shared_pages) belong to the index
        self.computed_tokens = 0  # exact: tokens whose KV is in self.pages
        self.allocated_tokens = 0  # tokens with a reserved slot (>= computed)
        self.node: Node | None = None  # the locked node (RUNNING)
        self._tail: list[int] = []  # PREEMPTED: owned id of the private partial page
        self._tail_page = 0  # PREEMPTED: its logical index
        self._tail_tokens = 0  # PREEMPTED: its computed tokens

    # ----------------------------------------------------------------- tokens
    @property
    def key(self) -> bytes:
        if self._key is None:
            self._key = bytes(self._buf)
        return self._key

    @property
    def num_tokens(self) -> int:
        return len(self._buf) // 4

    @property
    def tokens(self) -> list[int]:
        return np.frombuffer(self.key, dtype="<u4").tolist()

    def extend(self, tokens: Tokens) -> None:
        """Append tokens (e.g. the sampled token before a decode step)."""
        self._check(RequestState.WAITING, RequestState.RUNNING, RequestState.PREEMPTED, op="extend")
        self._buf += as_key(tokens)
        self._key = None

    @property
    def private_pages(self) -> list[int]:
        """Owned L1 ids this request holds outside the index (a fresh list)."""
        if self.state is RequestState.PREEMPTED:
            return list(self._tail)
        return self.pages[self.cache.owned(0, self.shared_pages):]

    # ------------------------------------------------------------- lifecycle
    def match(self) -> MatchResult:
        """Refresh: the cache's hit for this request's tokens (at most all but the last).

        Pure apart from ``stats.lookups``. ``exact_tokens`` adds this request's
        own private partial page when it continues the hit (chunked prefill,
        or after ``preempt`` when its prefix survived); other requests never
        see that page.
        """
        c = self.cache
        ps = c.page_size
        cap = max(0, self.num_tokens - 1)
        m = c.match(self.key, self.namespace, max_tokens=cap, need_draft=self.draft)
        hit = m.tokens
        if self.state is RequestState.RUNNING:  # its locked prefix + private pages are its own
            exact = min(self.computed_tokens, cap)
        elif self.state is RequestState.PREEMPTED and self._tail_tokens and hit == self._tail_page * ps:
            exact = min(hit + self._tail_tokens, cap)
        else:
            return m
        return m._replace(exact_tokens=max(exact, hit))

    def lock(self, m: MatchResult) -> None:
        """Pin ``m``'s device hit and take it as this request's computed prefix.

        WAITING or PREEMPTED -> RUNNING. Afterwards ``pages`` holds the hit's
        ids and ``computed_tokens == m.device_tokens`` (+ the private tail when
        ``m`` counted it; a tail that no longer continues the device hit is
        freed). Load an L2 hit back before locking to use it. Raises
        ``StaleMatch`` if an eviction happened since ``m`` was computed.
        """
        self._check(RequestState.WAITING, RequestState.PREEMPTED, op="lock")
        c = self.cache
        if m.epoch != c.tree.epoch:
            raise StaleMatch(f"request {self.rid!r}: match from epoch {m.epoch}, the cache is at "
                             f"epoch {c.tree.epoch} (pages were evicted since); call match() again")
        ps = c.page_size
        self.pages = list(m.device_pages)
        self.shared_pages = m.device_tokens // ps
        self.computed_tokens = m.device_tokens
        tail_kept = (self.state is RequestState.PREEMPTED and m.host_tokens == 0
                     and m.exact_tokens > m.device_tokens and self._tail_page == self.shared_pages)
        if tail_kept:
            self.pages += self._tail
            self.computed_tokens = m.exact_tokens
        elif self._tail:
            c.free_device(self._tail)
        self._tail, self._tail_tokens = [], 0
        self.allocated_tokens = self.computed_tokens
        self.node = c._lock_target(m.device_node, self.shared_pages) if self.shared_pages else None
        self.draft_tokens = c._draft_prefix(self.node) if self.draft else 0
        self._draft_shared = self.draft_tokens // ps
        if self.node is not None:
            c.tree.lock(self.node)
            c.tree.touch(self.node)
        self.state = RequestState.RUNNING
        s = c._stats
        s.admitted_tokens += self.num_tokens
        s.device_hit_tokens += m.device_tokens
        s.device_hit_exact_tokens += self.computed_tokens
        s.host_hit_tokens += m.host_tokens
        s.host_hit_exact_tokens += m.host_tokens
        if m.draft_cut:
            c._draft_truncated(m)

    def alloc(self, num_tokens: int) -> list[int]:
        """Reserve slots for the next ``num_tokens`` tokens; returns the new owned
        L1 ids (appended to ``pages``). Evicts unlocked index pages when the pool
        is short; raises ``OutOfPages`` (and allocates nothing) if that is not enough.
        ``extend`` tokens before allocating their slots."""
        self._check(RequestState.RUNNING, op="alloc")
        end = self.allocated_tokens + num_tokens
        if num_tokens < 0 or end > self.num_tokens:
            raise CacheStateError(f"request {self.rid!r}: alloc({num_tokens}) would reserve {end} "
                                  f"tokens but it has {self.num_tokens}; extend() first")
        ids = self.cache.alloc_device(self._pages_for(end))
        self.pages += ids
        self.allocated_tokens = end
        return ids

    def _pages_for(self, end: int) -> int:
        """Owned L1 pages that reserving slots up to token ``end`` allocates."""
        ps = self.cache.page_size
        first, last = -(-self.allocated_tokens // ps), -(-end // ps)
        return self.cache.owned(first, last - first)

    def commit(self, num_tokens: int | None = None, *, draft_tokens: int | None = None) -> int:
        """Mark ``num_tokens`` more tokens computed (default: all allocated) and
        share their full pages through the index; the partial page stays
        private. Moves this request's lock to the new deepest node. Returns
        ``computed_tokens``.

        ``draft_tokens`` (draft requests): how many leading tokens have valid
        draft rows now. Default ``computed_tokens - 1``: a draft row needs the
        next token, so the last one is pending. Only pages whose draft rows are
        all valid are shared as draft-complete."""
        self._check(RequestState.RUNNING, op="commit")
        self._advance(num_tokens, draft_tokens)
        self._adopt(self._share())
        return self.computed_tokens

    def _advance(self, num_tokens: int | None, draft_tokens: int | None) -> None:
        """``commit``'s accounting: more computed tokens and draft rows."""
        n = self.allocated_tokens - self.computed_tokens if num_tokens is None else num_tokens
        if not 0 <= n <= self.allocated_tokens - self.computed_tokens:
            raise CacheStateError(f"request {self.rid!r}: commit({num_tokens}) but only "
                                  f"{self.allocated_tokens - self.computed_tokens} tokens are allocated "
                                  "and not yet computed")
        self.computed_tokens += n
        if draft_tokens is not None:
            if not self.draft or not 0 <= draft_tokens <= self.computed_tokens:
                raise CacheStateError(f"request {self.rid!r}: commit(draft_tokens={draft_tokens}) needs a "
                                      f"draft request (draft={self.draft}) and 0 <= draft_tokens <= "
                                      f"computed_tokens={self.computed_tokens}")
            self.draft_tokens = draft_tokens
        elif self.draft:
            self.draft_tokens = max(self.draft_tokens, self.computed_tokens - 1)

    def replace_uncommitted(self, tokens: Tokens) -> None:
        """Replace the tokens after ``computed_tokens`` with ``tokens`` (speculative
        decoding: placeholders while drafting, then the accepted drafts). Slots
        already allocated keep their ids up to the new length; pages that no
        longer hold an allocated slot are freed. RUNNING only; mutates ``pages``."""
        self._check(RequestState.RUNNING, op="replace_uncommitted")
        c, ps = self.cache, self.cache.page_size
        self._buf = self._buf[:self.computed_tokens * 4] + as_key(tokens)
        self._key = None
        self.allocated_tokens = min(self.allocated_tokens, self.num_tokens)
        keep = c.owned(0, -(-self.allocated_tokens // ps))
        c.free_device(self.pages[keep:])
        del self.pages[keep:]

    def finish(self) -> None:
        """Share the computed full pages, free every private page, unlock. -> FINISHED."""
        self._check(RequestState.WAITING, RequestState.RUNNING, RequestState.PREEMPTED, op="finish")
        if self.state is RequestState.RUNNING:
            self._adopt(self._share())
        self._end_finish()

    def _end_finish(self) -> None:
        self._release()
        self.state = RequestState.FINISHED
        self.cache._stats.requests_finished += 1

    def abort(self) -> None:
        """Release everything held without sharing anything new. -> ABORTED."""
        self._check(RequestState.WAITING, RequestState.RUNNING, RequestState.PREEMPTED, op="abort")
        self._release()
        self.state = RequestState.ABORTED
        self.cache._stats.requests_aborted += 1

    def preempt(self) -> None:
        """Share the computed full pages, unlock, free private pages except the
        partial last page (at most one page, kept for an exact refresh).
        RUNNING -> PREEMPTED; resume with ``match`` + ``lock``."""
        self._check(RequestState.RUNNING, op="preempt")
        self._adopt(self._share())
        self._end_preempt()

    def _end_preempt(self) -> None:
        c = self.cache
        ps = c.page_size
        tail_tokens = self.computed_tokens - self.shared_pages * ps
        private = self.private_pages
        keep = c.owned(self.shared_pages, 1) if tail_tokens else 0
        tail, rest = private[:keep], private[keep:]
        c.free_device(rest)
        self._unlock()
        self._tail, self._tail_page, self._tail_tokens = tail, self.shared_pages, tail_tokens
        self.pages, self.shared_pages, self.computed_tokens, self.allocated_tokens = [], 0, 0, 0
        self.state = RequestState.PREEMPTED
        c._stats.requests_preempted += 1

    # ---------------------------------------------------------------- helpers
    def _check(self, *ok: RequestState, op: str) -> None:
        if self.state not in ok:
            raise CacheStateError(f"request {self.rid!r}: {op}() needs state "
                                  f"{'/'.join(s.value for s in ok)}, it is {self.state.value}")

    def _share(self) -> InsertResult | None:
        """Insert the computed full pages (and newly valid draft rows); move the lock
        to the new deepest node and take the index's ids. Returns what the insert
        did (None if nothing changed); the caller acts on it (``_adopt``)."""
        c = self.cache
        ps = c.page_size
        full = self.computed_tokens // ps
        dp = min(full, self.draft_tokens // ps)
        if full <= self.shared_pages and dp <= self._draft_shared:
            return None  # (a shared page whose pending draft row was just written is re-inserted)
        k = c.owned(0, full)
        res = c.tree.insert(self.key[:full * 4 * ps], self.namespace, self.pages[:k], dp)
        self._draft_shared = dp
        self.pages[:k] = res.pages
        c.tree.lock(res.node)
        self._unlock()
        self.node, self.shared_pages = res.node, full
        c._stats.inserted_pages += res.new_pages
        c._stats.duplicate_pages += len(res.duplicates)
        return res

    def _adopt(self, res: InsertResult | None) -> None:
        """Free the duplicates of a share: call after the draft planes listed in
        ``res.draft_copies`` were copied (their sources are those duplicates)."""
        if res is None:
            return
        self.cache._stats.draft_upgraded_pages += len(res.draft_copies)
        self.cache.free_device(res.duplicates)

    def _unlock(self) -> None:
        if self.node is not None:
            self.cache.tree.unlock(self.node)
            self.node = None

    def _release(self) -> None:
        c = self.cache
        c.free_device(self.private_pages)
        self._unlock()
        self.pages, self._tail, self._tail_tokens = [], [], 0
        self.shared_pages = self.computed_tokens = self.allocated_tokens = 0
        c.requests.pop(self.rid, None)

    def __repr__(self) -> str:
        return (f"Request({self.rid!r}, {self.state.value}, tokens={self.num_tokens}, "
                f"computed={self.computed_tokens}, allocated={self.allocated_tokens}, "
                f"draft={self.draft_tokens if self.draft else None}, "
                f"shared_pages={self.shared_pages}, pages={self.pages})")


def _allocator(pool: DevicePool | HostPool | PageAllocator | None) -> PageAllocator | None:
    return pool.allocator if isinstance(pool, (DevicePool, HostPool)) else pool


class PrefixCache:
    """Index + allocation for one engine (one CP rank): see the module docstring.

    ``device`` is the L1 pool (or its allocator); ``host`` the L2 pool (or
    allocator) when a tiering controller runs on top. ``eviction`` /
    ``host_eviction`` name policies in ``hicache.eviction.POLICIES``;
    ``ownership`` a CP page ownership in ``hicache.cp.OWNERSHIPS``.

    Layouts with draft planes: requests are draft requests by default (they
    hit only draft-complete pages, see ``RadixTree.match``); an engine that
    does not run its draft head passes ``draft=False`` to ``new_request``.
    When a request supplies the draft rows a cached page lacked, the index
    flags the page complete; copying those rows onto the cached page is the
    caller's (``InsertResult.draft_copies``, done by ``hicache.HiCache``).

    This is the only way into the index: nothing outside reaches ``tree``.
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
        self._draft_warned: set[int] = set()  # causes already logged (one warning per cause)
        self.requests: dict[str, Request] = {}  # live (not finished/aborted) requests by id
        self._stats = CacheStats()
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
        ``hicache.hicache.TieredRequest``); its ``rid`` must not be live."""
        rid = req.rid
        if rid in self.requests:
            raise CacheStateError(f"request id {rid!r} is already live ({self.requests[rid]!r}); "
                                  "finish or abort it first")
        self.requests[rid] = req
        self._stats.requests += 1
        return req

    def match(self, tokens: Tokens, namespace: str = "", *, max_tokens: int | None = None,
              need_draft: bool = False) -> MatchResult:
        """Page-floored hits of ``tokens`` (L1, then L2 continuing it). Mutates only
        ``stats.lookups``; pass a bytes key (``as_key``) to skip conversion.
        ``need_draft``: only pages whose draft planes are complete on the tier
        they would be served from (the hit stops at the first that is not)."""
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
                        DRAFT_CUTS[m.draft_cut])

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
                raise OutOfPages(f"L1: need {n} pages, {a.num_free} free and nothing evictable "
                                 f"({self.tree.device_ids_held} held by the index, all locked); "
                                 "finish or preempt requests, or enlarge the pool")
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

    def pages(self, node: Node | None, end_page: int, first_page: int = 0, *,
              host: bool = False) -> list[int]:
        """Owned L1 (``host``: L2) ids of logical pages ``[first_page, end_page)`` on
        the path to ``node``, which holds page ``end_page - 1``. A fresh list."""
        return self.tree.pages(node, end_page, first_page, host=host)

    def path(self, node: Node, stop: Node | None = None) -> list[Node]:
        """Nodes from just below ``stop`` (default: the root) down to ``node``, top-down."""
        return self.tree.path(node, stop)

    def split_at(self, node: Node, num_pages: int) -> Node:
        """Make a node boundary ``num_pages`` into ``node``; returns the upper part."""
        return self.tree.split_at(node, num_pages)

    def insert_host(self, key: bytes, namespace: str, first_page: int,
                    host_pages: list[HostPageId]) -> tuple[Node | None, list[HostPageId]]:
        """Record L3 pages that landed in L2 (see ``RadixTree.insert_host``): returns
        the deepest new L2 node (None if nothing new) and the ids the index did
        not take, which the caller frees."""
        return self.tree.insert_host(key, namespace, first_page, host_pages)

    def set_host(self, node: Node, host_pages: list[int], *, draft: bool | None = None) -> None:
        """Record complete L2 copies of ``node`` (ids from ``host_allocator``); ``draft``:
        their draft rows are valid (default: ``node.draft_device``, see ``RadixTree.set_host``)."""
        self.tree.set_host(node, host_pages, draft)

    def set_device(self, node: Node, device_pages: list[int]) -> None:
        """Record a completed load back of an L2-only node into these L1 ids."""
        self.tree.set_device(node, device_pages)

    def set_stored(self, node: Node, stored: bool = True) -> None:
        self.tree.set_stored(node, stored)

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

    def hashes(self, node: Node) -> list[PageHash]:
        """Chained page hashes of ``node`` (L3 keys / event ids); computed once."""
        return self.tree.hashes(node)

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
        self._check_pool(self.device_allocator, "L1", census.device_ids,
                         [r.private_pages for r in self.requests.values()] + [list(device_in_flight)])
        if self.host_allocator is not None:
            self._check_pool(self.host_allocator, "L2", census.host_ids, [list(host_in_flight)])
        locks: dict[Node, int] = dict(self._ext_locks)
        for r in self.requests.values():
            self._check_request(r)
            if r.node is not None:
                locks[r.node] = locks.get(r.node, 0) + 1
        for held, attr in ((locks, "lock_ref"), (self._ext_host_locks, "host_lock_ref")):
            want: dict[Node, int] = {}
            for node, k in held.items():
                for n in self.tree.path(node):
                    want[n] = want.get(n, 0) + k
            for n in self.tree.iter_nodes():
                if getattr(n, attr) != want.get(n, 0):
                    raise IntegrityError(f"{n!r}: {attr}={getattr(n, attr)} but its holders "
                                         f"account for {want.get(n, 0)}")

    @staticmethod
    def _check_pool(alloc: PageAllocator, tier: str, tree_ids: set[int], others: list[list[int]]) -> None:
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

    def _check_request(self, r: Request) -> None:
        ps, tree = self.page_size, self.tree
        if r.state is RequestState.PREEMPTED:
            want = tree.owned(r._tail_page, 1) if r._tail_tokens else 0
            if len(r._tail) != want or not 0 <= r._tail_tokens < ps or r.pages:
                raise IntegrityError(f"{r!r}: preempted with tail {r._tail} of {r._tail_tokens} tokens")
            return
        if r.state is RequestState.WAITING:
            if r.pages or r._tail or r.node is not None:
                raise IntegrityError(f"{r!r}: waiting but holds pages or a lock")
            return
        assert r.state is RequestState.RUNNING, r
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
