"""``HiCache``: the embedded three-tier cache an engine links against.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from typing import NamedTuple, TypeVar


from hicache.index.prefix_cache import PrefixCache, Request, RequestState, Tokens, as_key
from hicache.core.config import HiCacheConfig
from hicache.client.consensus import HitConsensus, admitted_hit
from hicache.core.errors import OutOfPages, TransferError
from hicache.core.hashing import key_page_hashes
from hicache.core.layout import KVLayout
from hicache.tiers.cost import CostModel
from hicache.index.misses import L2, L3, L3Outcome, MissTracker, admission_misses
from hicache.core.types import PrefetchPolicy, WritePolicy
from hicache.memory.pools import DevicePool
from hicache.core.stats import HiCacheStats, StorageStats
from hicache.index.node import InsertResult, Node
from hicache.tiers.inflight import InFlight
from hicache.tiers.l2.base import L2Tier
from hicache.tiers.l2.base import build_l2, open_l2
from hicache.tiers.l2.shared import ServiceHostTier
from hicache.index.request import MatchResult
from hicache.tiers.room import L1Room, WaitJob, Work
from hicache.tiers.plans import BackupPlan, LoadPlan, Plan, PrefetchPlan, StorePlan
from hicache.tiers.manager import TierManager
from hicache.transfer.engine import LoadHandle, TransferController, TransferKind, TransferResult
from hicache.core.types import JobId

log = logging.getLogger(__name__)
_T = TypeVar("_T")

L3_PLANS = (StorePlan, PrefetchPlan)  # transfers that make L3 calls (drain does not wait on a stalled L3)

# Policy members read once: an enum member lookup costs ~0.8 us on Python 3.11.
_WRITE_THROUGH, _WRITE_THROUGH_SELECTIVE = WritePolicy.WRITE_THROUGH, WritePolicy.WRITE_THROUGH_SELECTIVE
_BEST_EFFORT, _WAIT_COMPLETE = PrefetchPolicy.BEST_EFFORT, PrefetchPolicy.WAIT_COMPLETE


class Admission(NamedTuple):
    """What ``admit`` decided for a request. Valid until the request ends."""

    match: MatchResult  # the final (post-prefetch, post-load) match the request locked
    device_tokens: int  # hit already on L1 before admission
    host_tokens: int  # hit loaded back from L2 (includes pages prefetched from L3)
    storage_tokens: int  # part of host_tokens that came from L3 in this admission
    loads: tuple[LoadHandle, ...]  # loads this request must wait for (its own and shared)

    @property
    def hit_tokens(self) -> int:
        return self.match.device_tokens

    def wait_layer(self, i: int) -> None:
        for h in self.loads:
            h.wait_layer(i)

    def wait(self) -> None:
        for h in self.loads:
            h.wait()


class _Loaded(NamedTuple):
    """What ``HiCache._load_back`` did for one admission."""

    handle: LoadHandle | None  # the load's layer-wise handle (None: nothing loaded)
    match: MatchResult  # the match to lock
    fetched_tokens: int  # tokens of it an L3 behind L2 delivered for this request (the service's)
    no_room_pages: int  # L2-hit logical pages not loaded for want of L1 room (a miss reason)


class _L3Hit(NamedTuple):
    hashes: list  # page hashes of the L3 pages continuing the L1/L2 hit
    probed_at: float  # perf_counter() when the probe began (the prefetch budget covers probe and fetch)
    storage_before: object = None  # the L3 backend's StorageStats before the probe (miss reasons)


class HiCache:
    """Embedded L1/L2/L3 cache.

    It composes the index (``PrefixCache``), the L1/L2 pools, an L3 backend and
    the transfer controller, and implements the write policies, load back and
    prefetch on top of the index. The index never calls up: requests made here
    are ``TieredRequest`` handles, which act on what each index call returns
    (back up the nodes an insert created, wait for loads and copy draft planes
    before adopting the index's pages). Making L1 room (eviction, the write-back
    queue, cleaning ahead) is one component it owns, ``L1Room`` (``hicache.tiers.room``)::

        hc = HiCache(HiCacheConfig.load())
        req = hc.new_request("r1", prompt_ids)
        adm = hc.admit(req)                 # match L1/L2/L3, prefetch, lock, start load back
        req.alloc(len(prompt_ids) - adm.hit_tokens)
        # forward pass: adm.wait_layer(i) before attention of layer i
        req.commit(); req.finish()
        hc.poll()                           # once per scheduler step

    Not thread-safe: one scheduler thread calls everything; completions run in
    that thread during ``poll``.
    """

    def __init__(self, config: HiCacheConfig | None = None, *, layout: KVLayout | None = None,
                 device_buffers=None, storage=None, consensus: HitConsensus | None = None,
                 inline_transfers: bool = False):
        """``consensus``: the TP/CP group's ``HitConsensus``; ``admit`` then locks
        the hit every rank agrees on (see ``hicache.client.consensus``). ``inline_transfers``:
        CPU pools run each copy and L3 call at submit, in this thread (``--simulate``)."""
        self.config = cfg = config or HiCacheConfig.load()
        self.layout = layout or cfg.layout()
        device = cfg.resolved_device()
        # L2 is one strategy: a private pinned pool, or the node service's shared segment.
        l2_memory = open_l2(cfg, self.layout, device, l3_given=storage is not None)
        self.host_pool = l2_memory.pool
        self._link = l2_memory.link
        l3_url = l2_memory.l3_url
        self.device_pool = DevicePool(self.layout, cfg.pool.device_pages, device, buffers=device_buffers)
        if storage is None and l3_url:
            from hicache.storage import open_storage
            from hicache.storage.capacity import backend_options
            storage = open_storage(l3_url, fingerprint=self.layout.fingerprint(), layout=self.layout,
                                   timeout_ms=cfg.storage.timeout_ms, max_retries=cfg.storage.max_retries,
                                   auth_key=cfg.storage.resolved_auth_key(), **backend_options(cfg.storage))
        self.storage = storage
        self.policy = cfg.policy
        self.transfers = TransferController(self.device_pool, self.host_pool, storage, inline=inline_transfers)
        self.cache = PrefixCache(self.layout, self.device_pool, l2_memory.index_allocator,
                                 eviction=cfg.policy.device_eviction, host_eviction=cfg.policy.host_eviction)
        self.tiers = TierManager(self.cache)
        self.l2: L2Tier = build_l2(l2_memory, self.tiers, cfg.policy)
        self.tier_stats = self.tiers.stats
        # In-flight work: every submitted, not yet completed job -> its plan (one map;
        # nodes still filling lead to their load's job). A load's layer-wise handle
        # is the transfer controller's, under the same job id (``load_handle(job)``).
        self._jobs = InFlight()
        self._storage_enabled = storage is not None and self.layout.cp_size == 1
        self._failed: TransferError | None = None  # set by a failed load back; fatal
        self._prefetch_for: dict[JobId, str] = {}  # prefetch job -> the waiting request it is for
        self._prefetched_waiting: set[str] = set()  # waiting requests whose prefetch was started
        self.consensus = consensus
        self.cost = CostModel.from_config(cfg.admission, self.layout.token_bytes)
        self.misses = MissTracker(cfg.policy.miss_window_pages)
        self.room = L1Room(self.cache, self.l2, self._jobs, cfg.policy, self.tier_stats)  # eviction, write-back

    # ------------------------------------------------------------- requests
    def new_request(self, rid: str, tokens: Tokens, namespace: str = "", *, draft: bool | None = None,
                    priority: int = 0) -> Request:
        """A WAITING request handle (see ``hicache.index.prefix_cache.Request``). ``draft``: the
        request runs the draft head (default: the layout has draft planes).

        Call it when the request arrives, before ``admit``: until it is admitted (or ends)
        its cached prefix is evicted only after every other page (``policy.protect_waiting``;
        ``PrefixCache.note_waiting``) and ``poll`` prefetches its L3 pages into L2, the
        next-admitted first (``priority``: higher is admitted sooner)."""
        c = self.cache
        req = c.add_request(TieredRequest(self, rid, as_key(tokens), namespace,
                                          c.has_draft if draft is None else draft))
        if self.policy.protect_waiting:
            c.note_waiting(rid, req.key, namespace, priority=priority)
        return req

    def prefetch_waiting(self) -> int:
        """Start the L3 -> L2 prefetch of the first ``policy.waiting_prefetch_requests``
        waiting requests (next-admitted first) not prefetched yet, without waiting; each
        is noted again once its pages land, so they are protected too. Returns the
        prefetches started. Called by ``poll``."""
        c = self.cache
        done = self._prefetched_waiting
        done.intersection_update(c.waiting)
        if not self._storage_enabled or not c.waiting:
            return 0
        started = 0
        for rid in c.waiting_order()[:self.policy.waiting_prefetch_requests]:
            if rid in done:
                continue
            done.add(rid)
            w = c.waiting[rid]
            m = c.match(w.key, w.namespace)
            hit = self._storage_hit(w.key, w.namespace, len(w.key) // 4, m)
            if hit.hashes:
                started += self._prefetch_ahead(rid, w, m, hit)
        return started

    def _prefetch_ahead(self, rid: str, w, m: MatchResult, hit: "_L3Hit") -> int:
        plan = self.tiers.prepare_prefetch(w.key, w.namespace, m.tokens // self.layout.page_size, hit.hashes,
                                           after=_l2_anchor(m))
        if plan is None:
            return 0
        self._prefetch_for[self._submit(plan)] = rid
        return 1

    def match(self, tokens: Tokens, namespace: str = "", *, storage: bool = False) -> tuple[MatchResult, int]:
        """Page-floored hits per tier without side effects beyond statistics:
        ``(L1/L2 match, L3 tokens continuing it)``; L3 is probed only when asked."""
        m = self.cache.match(tokens, namespace)
        if not storage or not self._storage_enabled:
            return m, 0
        key = as_key(tokens)
        ps = self.layout.page_size
        hashes = self._page_hashes(key, namespace, len(key) // (4 * ps))
        return m, self.transfers.storage_probe(hashes[m.tokens // ps:], self._prefetch_budget_s(len(tokens))) * ps

    def _page_hashes(self, key: bytes, namespace: str, num_pages: int) -> list:
        """Chained hashes (L3 keys) of the first ``num_pages`` pages of a bytes key."""
        return key_page_hashes(key, self.layout.page_size, namespace, num_pages)

    def admit(self, req: Request) -> Admission:
        """Schedule ``req``: match every tier, prefetch from L3 per the policy, load
        the L2 hit back into L1 and lock the whole hit. WAITING/PREEMPTED -> RUNNING.
        Afterwards ``req.computed_tokens`` counts the hit; allocate and compute the rest."""
        self._check_healthy()
        c = self.cache
        m = c.refresh(req)
        device_tokens = m.device_tokens
        l3_hit = self._storage_hit(req.key, req.namespace, req.num_tokens, m)
        # The one cost decision: load the L2 / L3 parts only where that beats recomputing them.
        l3_tokens = len(l3_hit.hashes) * self.layout.page_size
        queued = self.transfers.queued_bytes() if self.cost.enabled and (m.host_tokens or l3_tokens) else None
        plan = self.cost.decide(m.host_tokens, l3_tokens, queued)
        storage_tokens, l3_outcome = self._prefetch(req, m, l3_hit) if plan.load_l3 else (0, None)
        if storage_tokens or m.epoch != self.cache.epoch:
            m = c.refresh(req)  # prefetched pages joined L2, or L2 room was made by eviction
        own: LoadHandle | None = None
        no_room_pages = 0
        if plan.load_l2 or not m.host_tokens:  # the cost model judged the index's L2 hit, if any
            own, m, fetched, no_room_pages = self._load_back(req, m)
            storage_tokens += fetched
        if self.consensus is not None:
            m = self._agreed(req, m)
            device_tokens = min(device_tokens, m.device_tokens)
        c.lock(req, m)
        admission_misses(self.misses, self.cache, req.key, req.namespace, m.device_tokens, m.device_node,
                         l3_outcome, no_room_pages)
        loads = [own] if own is not None else []
        if m.device_node is not None:
            for n in self.cache.tree.path(m.device_node):
                h = self._loading(n)
                if h is not None and h not in loads:
                    loads.append(h)
            if self.policy.write_policy is _WRITE_THROUGH_SELECTIVE:
                self._selective_backup(m.device_node)
        device_tokens = min(device_tokens, m.device_tokens)  # L1 pages evicted meanwhile were not a hit
        host_tokens = m.device_tokens - device_tokens
        self._run_room(self.room.clean_ahead())  # write_back: room for the next admission (starts copies, never waits)
        return Admission(m, device_tokens, host_tokens, min(storage_tokens, host_tokens), tuple(loads))

    def _agreed(self, req: Request, m: MatchResult) -> MatchResult:
        """``m`` cut to the hit every rank of the group admits (a collective)."""
        mine = m.exact_tokens if m.host_tokens == 0 else m.device_tokens  # what lock() would take
        agreed = admitted_hit(self.consensus, mine, self.layout.page_size)
        if agreed == mine:
            return m
        return self.cache.match(req.key, req.namespace, max_tokens=agreed, need_draft=req.draft)

    # ----------------------------------------------------------------- L3 -> L2
    def _storage_hit(self, key: bytes, namespace: str, num_tokens: int, m: MatchResult) -> _L3Hit:
        """The L3 pages continuing ``m`` for a request of ``key`` (probed within the prefetch
        budget); none when there is no L3 or the hit is below ``storage_hit_min_pages``."""
        t0 = time.perf_counter()
        if not self._storage_enabled:
            return _L3Hit([], t0)
        ps = self.layout.page_size
        have = m.tokens // ps
        cap = max(0, num_tokens - 1) // ps
        if cap - have < self.policy.storage_hit_min_pages:
            return _L3Hit([], t0)
        hashes = self._page_hashes(key, namespace, cap)
        self.tier_stats.storage_lookups += 1
        st0 = self.storage.stats()
        s = self.transfers.storage_probe(hashes[have:cap], self._prefetch_budget_s(num_tokens))
        if s < self.policy.storage_hit_min_pages:
            return _L3Hit([], t0)
        self.tier_stats.storage_hit_pages += s
        return _L3Hit(hashes[have:have + s], t0, st0)

    def _prefetch(self, req: Request, m: MatchResult, hit: _L3Hit) -> tuple[int, L3Outcome | None]:
        """Fetch ``hit`` into L2, waiting what is left of the policy's budget: the tokens
        the index took and what the L3 lookup found (None: nothing was looked up).

        The hit the prefetch continues is pinned on L2 while L2 room is made: the
        prefetched pages hang from it (L2 is prefix-closed), so evicting it would drop
        them. What L2 cannot place (no room, or a parent not on L2) is ``no_room``."""
        if not hit.hashes:
            return 0, None
        ps = self.layout.page_size
        have = m.tokens // ps
        plan = self.tiers.prepare_prefetch(req.key, req.namespace, have, hit.hashes, after=_l2_anchor(m))
        if plan is None:
            return 0, _l3_outcome(have, len(hit.hashes), 0, False, hit.storage_before, self.storage.stats(), True)
        budget = self._prefetch_budget_s(req.num_tokens)
        job = self._submit(plan)
        landed, taken = self._wait_prefetch(job, None if budget is None else budget - (time.perf_counter() - hit.probed_at))
        running = job in self._jobs
        outcome = _l3_outcome(have, len(hit.hashes), taken, running, hit.storage_before, self.storage.stats(),
                              not running and taken < landed or len(plan.host) < len(hit.hashes))
        return taken * ps, outcome

    def prefetch_budget_s(self, num_tokens: int) -> float | None:
        """How long the scheduler may wait on L3 for a request of ``num_tokens`` (``_prefetch_budget_s``)."""
        return self._prefetch_budget_s(num_tokens)

    def _prefetch_budget_s(self, num_tokens: int) -> float | None:
        """How long the scheduler may wait on L3 for one request (probe and fetch together);
        None: as long as it takes (``wait_complete``)."""
        p = self.policy
        if p.prefetch_policy is _WAIT_COMPLETE:
            return None
        if p.prefetch_policy is _BEST_EFFORT:  # the probe only; the fetch is never waited for
            return p.prefetch_timeout_base_ms / 1e3
        return min(p.prefetch_timeout_cap_ms,
                   p.prefetch_timeout_base_ms + p.prefetch_timeout_per_1k_tokens_ms * num_tokens / 1000) / 1e3

    def _wait_prefetch(self, job: JobId, timeout: float | None) -> tuple[int, int]:
        """Wait for the prefetch ``job`` up to ``timeout`` (what is left of the policy's
        budget) and complete it if it landed: the pages it brought into L2 and those the
        index took (0, 0: still running). Other jobs complete in ``poll``."""
        if self.policy.prefetch_policy is not _BEST_EFFORT:
            t0 = time.perf_counter()
            self.transfers.wait(job, None if timeout is None else max(0.0, timeout))
            self.tier_stats.prefetch_waited_ms += (time.perf_counter() - t0) * 1e3
        landed = taken = 0
        for r in self.transfers.finished(job):
            landed += r.pages
            taken += self._complete(self._jobs.pop(r.job), r)
        return landed, taken

    # ----------------------------------------------------------------- L2 -> L1
    def _load_back(self, req: Request, m: MatchResult) -> "_Loaded":
        """Give the L2 hit continuing ``m``'s L1 hit L1 pages and start copying it in
        (see ``_Loaded`` for what it returns).

        Without a second lookup: ``plan_load`` pins the device hit on L1 and holds
        the L2 hit (pinned in the private pool, acquired at the service) before
        room is made, so whatever eviction the allocation does leaves the hit
        whole, and once it has its L1 pages the hit is all on L1 and ends at the
        load's last node. Only a plan that failed (no room) matches again, and
        only when an eviction happened meanwhile."""
        pool = self.l2.reconnect(idle=not self._jobs)
        if pool is not None:
            self.host_pool = self.transfers.host_pool = pool
        lb = self.l2.plan_load(req, m, self._prefetch_budget_s(req.num_tokens))
        if lb is None:
            return _Loaded(None, m, 0, 0)
        try:
            self._run_room(self.room.make_room(lb.num_pages))
            dev = self.cache.alloc_device(lb.num_pages)
        except OutOfPages:  # a miss, counted: L1 is pinned or still writing its victims back
            self.l2.cancel_load(lb)
            self.tier_stats.load_back_no_room_pages += lb.num_pages
            no_room = (lb.end_tokens - m.device_tokens) // self.layout.page_size  # logical pages
            return _Loaded(None, m if m.epoch == self.cache.epoch else self.cache.refresh(req), 0, no_room)
        plan = self.l2.prepare_load(req, lb, dev)
        handle = self._start_load(plan)
        end = lb.end_tokens
        return _Loaded(handle, m._replace(device_tokens=end, host_tokens=0, exact_tokens=req.exact_tokens_for(end),
                                          device_node=plan.last, host_node=plan.last, epoch=self.cache.epoch),
                       lb.fetched_pages * self.layout.page_size, 0)

    def _start_load(self, plan: LoadPlan) -> LoadHandle:
        """Submit a prepared load back; its layer-wise handle (the controller keeps it until
        ``finished`` reports the job)."""
        return self.transfers.load_handle(self._submit(plan))

    # ----------------------------------------------------------------- L1 -> L2
    def _selective_backup(self, deepest: Node) -> None:
        for n in self.cache.tree.path(deepest):
            if self.l2.unbacked(n) and n.hit_count >= self.policy.write_through_threshold:
                self.start_backup(n)

    def start_backup(self, node: Node) -> JobId | None:
        """Start copying ``node`` to L2 (it stays pinned on L1 until the copy completes
        in ``poll()``); the job id, or None (nothing to copy, or no L2 room)."""
        plan = self.l2.prepare_backup(node, pin=True)
        return None if plan is None else self._submit(plan)

    def _store(self, node: Node) -> None:
        """L2 -> L3 once the L2 copy is complete."""
        if self._storage_enabled:
            plan = self.tiers.prepare_store(node)
            if plan is not None:
                self._submit(plan)

    # --------------------------------------------------------- completions
    def submit(self, plan: Plan) -> JobId:
        """Start a plan of a layer group's items (``plan.group >= 0``, ``hicache.cache.hybrid``);
        it completes in ``poll`` / ``drain`` as the index's plans do."""
        return self._submit(plan)

    def _submit(self, plan: Plan) -> JobId:
        job = self.transfers.submit(plan)
        self._jobs.add(job, plan)
        return job

    def complete_finished(self, job: JobId | None = None) -> int:
        """Hand every finished transfer (``job``: only that one) to the tier manager,
        never waiting; returns how many."""
        return len(self._complete_results(job))

    def _complete_results(self, job: JobId | None = None) -> list[TransferResult]:
        """The one place completions are pulled: every finished transfer (``job``: only
        that one) goes to its ``complete_*``; their results."""
        results = self.transfers.finished(job)
        for r in results:
            self._complete(self._jobs.pop(r.job), r)
        return results

    def _complete(self, plan: Plan, r: TransferResult) -> int:
        """Hand ``r`` to its plan's ``complete_*``; the pages the index took (prefetches), else 0."""
        tiers = self.tiers
        if plan.group >= 0:  # a layer group's items (hicache.tiers.groups): keyed (group, page hash)
            for nxt in tiers.complete_group(plan, r.ok, r.pages):
                self._submit(nxt)
            if isinstance(plan, LoadPlan) and not r.ok:
                self._failed = TransferError(f"load back of layer group {plan.group}'s items {plan.device[:8]} "
                                             f"failed ({r.error!r}); their L1 pages hold unknown bytes, so this "
                                             "cache refuses to serve; rebuild it")
            return 0
        if r.seconds and r.ok and r.kind in (TransferKind.H2D, TransferKind.L3_GET):  # the cost model's bandwidths
            self.cost.bandwidth.observe("L2" if r.kind is TransferKind.H2D else "L3", r.pages * self.layout.page_bytes,
                                        r.seconds)
        if isinstance(plan, BackupPlan):
            for n in self.l2.complete_backup(plan, r.ok):
                self.misses.reached(self.cache.tree.hashes(n), L2)
                self._store(n)
            self.room.written(r.job, plan.node)
        elif isinstance(plan, LoadPlan):
            self.l2.complete_load(plan, r.ok)
            if not r.ok:
                h, d = plan.host, plan.device
                self._failed = TransferError(
                    f"load back of L2 pages {h[:8]}{'...' if len(h) > 8 else ''} into L1 "
                    f"pages {d[:8]}{'...' if len(d) > 8 else ''} failed ({r.error!r}); those L1 pages "
                    "are indexed with unknown bytes, so this cache refuses to serve; rebuild it")
        elif isinstance(plan, StorePlan):
            tiers.complete_store(plan, r.pages if r.ok else 0)
            self.misses.reached(plan.hashes[:r.pages if r.ok else 0], L3)
        else:
            taken = tiers.complete_prefetch(plan, r.pages)
            rid = self._prefetch_for.pop(r.job, None)
            w = self.cache.waiting.get(rid) if rid is not None else None
            if w is not None and taken:  # still waiting: protect what landed too
                self.cache.note_waiting(rid, w.key, w.namespace, priority=w.priority)
            return taken
        return 0

    def wait_job(self, job: JobId, timeout: float | None = None) -> None:
        """Block until ``job`` is done (or ``timeout`` s), then complete what finished."""
        if self.transfers.wait(job, timeout):
            self.complete_finished()

    def _run_room(self, work: Work[_T]) -> _T:
        """Drive one ``L1Room`` operation: submit the backup plans it returns, wait for and
        complete the jobs it names, in its order; its result (its errors propagate)."""
        reply = None
        while True:
            try:
                step = work.send(reply)
            except StopIteration as done:
                return done.value
            if isinstance(step, BackupPlan):
                reply = self._submit(step)
            elif isinstance(step, WaitJob):
                reply = self.wait_job(step.job)
            else:
                reply = self.complete_finished(step.job)

    # ------------------------------------------------------------- eviction
    def evict(self, num_pages: int) -> int:
        """Take at least ``num_pages`` logical pages off L1 (see ``L1Room.evict``: under
        ``write_back`` this waits for the victims' copies to L2). Returns pages evicted
        (fewer only when nothing else is evictable)."""
        return self._run_room(self.room.evict(num_pages))

    def evict_host(self, num_pages: int) -> list[int]:
        """Drop at least ``num_pages`` logical pages from L2 (never pages a transfer
        holds); returns the freed L2 ids (already free in the host pool)."""
        return self.tiers.evict_host(num_pages)

    # ------------------------------------------------------------- sharing
    def _settle_share(self, req: Request, res: InsertResult | None) -> None:
        """Act on what a request's insert returned: wait for loads still filling the
        index pages it now uses, copy the draft planes it supplied onto them,
        free its duplicates, then back up the new nodes (write_through)."""
        if res is None:
            return
        self._wait_loads(res.node)
        if res.draft_copies:  # before the duplicates (the copies' sources) are freed
            self._copy_draft(res.draft_copies)
        req._adopt(res)
        if self.policy.write_policy is _WRITE_THROUGH:
            for n in res.created:
                self.start_backup(n)

    def _copy_draft(self, pairs) -> None:
        """Copy the draft planes of L1 page ``a`` onto page ``b`` for each ``(a, b)``."""
        from hicache.kernels.page_copy import copy_pages
        planes = [s.index for s in self.layout.planes if s.draft]
        copy_pages(self.device_pool, self.device_pool, [a for a, _ in pairs], [b for _, b in pairs],
                   planes=planes)

    # ------------------------------------------------------------- lifecycle
    def poll(self) -> int:
        """Observe finished transfers without blocking; returns how many. Raises
        ``TransferError`` once a load back has failed (see ``_check_healthy``)."""
        n = self.complete_finished()
        self._check_healthy()
        self._run_room(self.room.clean_ahead())
        self.prefetch_waiting()
        return n

    def _check_healthy(self) -> None:
        if self._failed is not None:
            raise self._failed

    def _wait_loads(self, node: Node) -> None:
        """A request is about to use the index's L1 pages on ``node``'s path (or
        write draft rows into them): wait for loads still filling them."""
        for n in self.cache.tree.path(node):
            h = self._loading(n)
            if h is not None:
                h.wait()

    def _loading(self, n: Node) -> LoadHandle | None:
        """The handle of the load still filling ``n``'s L1 pages (None: none is)."""
        job = self._jobs.load_job(n)
        return None if job is None else self.transfers.load_handle(job)

    def drain(self) -> None:
        """Block until every transfer has finished and been observed, except L3
        transfers while L3 is not answering (``StorageBackend.stalled``): those
        stay pending, their pages pinned, until a later ``poll``/``drain``
        observes them. So a scheduler that drains (to free L1 pages pinned by
        backups) never waits on an L3 call stuck in a frozen L3, past one
        attempt's ``storage.timeout_ms``; ``close`` waits for everything."""
        while self._jobs:
            copy = next((j for j, p in self._jobs.items() if not isinstance(p, L3_PLANS)), None)
            if copy is not None or self.storage is None:
                self.wait_job(next(iter(self._jobs)) if copy is None else copy)
            elif self.storage.stalled():
                self.complete_finished()
                return
            else:  # only L3 jobs left: wait in slices, re-checking that L3 answers
                self.wait_job(next(iter(self._jobs)), self.storage.options.timeout_s / 4)

    @property
    def shared(self) -> ServiceHostTier | None:
        """Service mode: the connection to the node's service and its segment (None: private L2)."""
        return self._link

    @property
    def private_host_bytes(self) -> int:
        """Host memory this engine holds for L2 pages of its own: the pinned L2 pool, or 0
        when its L2 is the node's shared segment."""
        return self.l2.private_bytes

    def stats(self) -> HiCacheStats:
        """A snapshot (new objects): index, tier movements, bytes moved, L3 backend."""
        return HiCacheStats(self.cache.stats(), dataclasses.replace(self.tier_stats),
                            dict(self.transfers.bytes_moved),
                            {"L1": self.device_pool.num_pages, "L2": self.host_pool.num_pages},
                            None if self.storage is None else self.storage.stats(),
                            dataclasses.replace(self.cost.stats), self.misses.snapshot())

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        """The engine computed ``tokens`` prefill tokens in ``seconds`` (one forward):
        feeds the cost model's measured prefill rate (``admission.prefill_tokens_per_s = 0``)."""
        self.cost.observe_prefill(tokens, seconds)

    def check_integrity(self) -> None:
        """Index invariants + pool accounting, counting pages held by transfers."""
        self.cache.check_integrity(host_in_flight=self.tiers.host_in_flight)
        self.tiers.check_integrity()
        self.misses.check_integrity()
        self.device_pool.check_integrity()
        self.transfers.check_integrity()
        self.cost.check_integrity()
        self._jobs.check_integrity()
        self.room.check_integrity()
        self.l2.check_integrity()
        if self.storage is not None:
            self.storage.check_integrity()

    def close(self) -> None:
        self.drain()
        self.transfers.close()  # waits for every job, L3 included

        if self.storage is not None:
            self.storage.close()
        self.l2.close()



def _l2_anchor(m: MatchResult) -> Node | None:
    """The L2 node an L3 prefetch for ``m`` continues (None: it starts at the root, or ``m``'s
    hit is not on L2)."""
    n = m.host_node
    return n if m.tokens and n is not None and n.host_pages is not None else None


def _l3_outcome(first_page: int, held: int, delivered: int, running: bool, before: StorageStats,
                after: StorageStats, no_room: bool = False) -> L3Outcome:
    """What an admission's L3 lookup found (``hicache.index.misses``), from the backend's counters."""
    return L3Outcome(first_page, held, delivered, running,
                     (after.errors - before.errors) + (after.corrupt - before.corrupt),
                     after.fingerprint_mismatch - before.fingerprint_mismatch, no_room)


class TieredRequest(Request):
    """A request of a ``HiCache``: the same handle and states as ``Request``; each
    step that changes the index hands the index's answer to its ``HiCache``,
    which acts on it (see ``HiCache._settle_share`` and ``L1Room.room_to_compute``)."""

    def __init__(self, hc: HiCache, rid: str, key: bytes, namespace: str, draft: bool):
        super().__init__(hc.cache, rid, key, namespace, draft)
        self._hc = hc

    def alloc(self, num_tokens: int) -> list[int]:
        end = self.allocated_tokens + num_tokens
        if self.state is RequestState.RUNNING and 0 <= num_tokens and end <= self.num_tokens:
            self._hc._run_room(self._hc.room.room_to_compute(self._pages_for(end)))
        return super().alloc(num_tokens)

    def commit(self, num_tokens: int | None = None, *, draft_tokens: int | None = None) -> int:
        self._check(RequestState.RUNNING, op="commit")
        self._advance(num_tokens, draft_tokens)
        self._hc._settle_share(self, self._share())
        return self.computed_tokens

    def finish(self) -> None:
        self._check(RequestState.WAITING, RequestState.RUNNING, RequestState.PREEMPTED, op="finish")
        if self.state is RequestState.RUNNING:
            self._hc._settle_share(self, self._share())
        self._end_finish()

    def preempt(self) -> None:
        self._check(RequestState.RUNNING, op="preempt")
        self._hc._settle_share(self, self._share())
        self._end_preempt()
