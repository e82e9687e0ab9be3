"""Scheduler half of an engine KV connector over hicache's index (no engine imports).

The engine owns L1 (its paged KV blocks and its own prefix cache); this index
holds L2 (host pages, in every worker's host pool) and knows which pages L3
holds. Per request, in the engine scheduler's order::

    hit = s.lookup(rid, tokens, engine_hit)      # page-floored hit beyond the engine's own (or waits)
    s.allocated(rid, block_ids, hit.tokens)      # pin L2, reserve L2 for the L3 part
    plan = s.take_plan()                         # -> every worker (plain data)
    s.completed(reports)                         # workers' JobReports, every step
    s.step_save(rid, tokens, computed, block_ids)          # a running request's new full pages
    delay = s.finished(rid, tokens, computed, block_ids)   # store the computed full pages

Blocks are pages (block size == page size). Jobs finish when every rank reported
(``ranks``), their L2 pages pinned until then. Not thread-safe (the scheduler thread).
"""
from __future__ import annotations

import dataclasses
from typing import NamedTuple

from hicache.connector.plan import L2, L3, EventLog, PageEvent
from hicache.connector.plan import JobKind, JobReport, LoadSpec, SaveSpec, StepPlan
from hicache.core.errors import CacheStateError, ConfigError, IntegrityError
from hicache.core.hashing import key_page_hashes
from hicache.core.layout import KVLayout
from hicache.core.stats import ConnectorStats
from hicache.core.types import HostPageId, PageHash
from hicache.index.node import Node
from hicache.index.prefix_cache import PrefixCache, as_key
from hicache.memory.allocator import PageAllocator
from hicache.tiers.cost import CostModel, Decision
from hicache.tiers.manager import TierManager
from hicache.tiers.plans import PrefetchPlan


class Hit(NamedTuple):
    """``lookup``'s answer: tokens to load beyond the engine's own hit (whole pages)."""

    tokens: int  # l2_tokens + l3_tokens
    l2_tokens: int  # from L2
    l3_tokens: int  # from L3, continuing the L2 part
    is_async: bool  # the load runs between steps (the request waits for it)
    decision: Decision | None = None  # the cost model's, None when there was nothing to judge
    # Another request's load in flight writes pages this request would load: ask again once it
    # lands (vLLM: None, "not decided yet"), when the engine's own cache holds those blocks.
    waits: bool = False


WAIT = Hit(0, 0, 0, False, None, True)


@dataclasses.dataclass(slots=True)
class _Load:
    rid: str
    spec: LoadSpec
    anchor: Node | None  # L2 path pinned for the L2 part
    prefetch: PrefetchPlan | None  # L2 pages reserved for the L3 part
    keys: tuple = ()  # the engine's keys of the L3 part's pages (events)
    parent: object | None = None
    tokens: tuple[int, ...] = ()
    reports: list[JobReport] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(slots=True)
class _Save:
    rid: str
    spec: SaveSpec
    key: bytes  # the request's key up to the saved pages' end
    namespace: str
    first_page: int
    anchor: Node | None  # pages before first_page, pinned on L2 until the save is indexed
    node: Node | None = None  # what the index took (pinned on L2 while L3 reads it)
    unused: list[HostPageId] = dataclasses.field(default_factory=list)  # freed once L3 read them
    keys: tuple = ()  # the engine's keys of the saved pages (events)
    parent: object | None = None
    tokens: tuple[int, ...] = ()
    reports: list[JobReport] = dataclasses.field(default_factory=list)
    early: list[JobReport] = dataclasses.field(default_factory=list)  # STORE reports that came before the last SAVE
    stage: JobKind = JobKind.SAVE


class ConnectorJobs:
    """What both L2 strategies share: the plan queue, job ids, reports per rank, counters,
    the cost decision and events. Subclasses: ``ConnectorScheduler`` (the connector's own
    L2, indexed here) and ``hicache.connector.shared.SharedConnectorScheduler``
    (the node service's segment, indexed by the service)."""

    storage = None  # an L3 this half probes (None: none, or the service's, behind its L2)

    def __init__(self, layout: KVLayout, *, cost: CostModel | None, ranks: int, layerwise: bool):
        self.layout = layout
        self.page_size = layout.page_size
        self.cost = cost or CostModel(bytes_per_token=layout.token_bytes, enabled=False)
        self.ranks = ranks
        self.layerwise = layerwise
        self._ps4 = 4 * layout.page_size
        self._hits: dict[str, tuple[Hit, int]] = {}  # rid -> (its last lookup, the engine hit it continued)
        self._loads: dict[int, _Load] = {}  # job -> in-flight load
        self._saves: dict[int, _Save] = {}
        self._loading: dict[str, int] = {}  # rid -> its load's job
        # job -> (namespace, the key up to the load's last page, its first page): what joins it
        self._spans: dict[int, tuple[str, bytes, int]] = {}
        self._sources: dict[str, dict[str, int]] = {}  # rid -> hit tokens by source, for the engine's stats
        self._next_job = 0
        self._plan_loads: list[LoadSpec] = []
        self._plan_saves: list[SaveSpec] = []
        self._lookups = 0
        self._hit_tokens = {"L2": 0, "L3": 0}
        self._c = dict(loaded=0, load_errors=0, saved=0, save_dropped=0, stored=0)
        self.events = EventLog()

    def _allocated_span(self, rid: str, num_external: int) -> tuple[Hit, int, int] | None:
        """``rid``'s last lookup and the pages ``[first, end)`` the engine allocated for
        ``num_external`` tokens of it; None when there is nothing to load. Raises
        ``CacheStateError`` for an allocation that is not whole pages within the hit."""
        entry = self._hits.pop(rid, None)
        if not num_external or entry is None:
            return None
        hit, engine_hit = entry
        ps = self.page_size
        if num_external % ps or num_external > hit.tokens or engine_hit % ps:
            raise CacheStateError(f"request {rid!r}: the engine allocated for {num_external} external tokens "
                                  f"after a hit of {hit.tokens} beyond {engine_hit}; it must be whole pages "
                                  f"of {ps} tokens, at most the hit")
        return hit, engine_hit // ps, (engine_hit + num_external) // ps

    def admitted(self, rid: str) -> None:
        """The engine scheduled ``rid``: no waiting-request state here (the subclass's index may keep some)."""

    def _saveable(self, rid: str, tokens, computed_tokens: int, block_ids, key: bytes | None = None) -> tuple:
        """Forget ``rid``'s lookup; ``(key, n)``: its key and how many full pages of its
        ``computed_tokens`` may be saved (0 while its load is in flight: blocks not final)."""
        self._hits.pop(rid, None)
        self._sources.pop(rid, None)
        key = as_key(tokens) if key is None else key
        if rid in self._loading:
            return key, 0
        return key, self.saveable_pages(tokens, computed_tokens, block_ids)

    def saveable_pages(self, tokens, computed_tokens: int, block_ids) -> int:
        """Full pages of ``computed_tokens`` the engine's ``block_ids`` hold (what an ending
        request may save). Pure."""
        return min(computed_tokens, len(tokens), len(block_ids) * self.page_size) // self.page_size

    def pending_span(self, rid: str, num_external: int) -> tuple[int, int] | None:
        """The pages ``[first, end)`` an allocation of ``num_external`` tokens for ``rid``'s
        last lookup covers; None when there is none. Pure."""
        entry = self._hits.get(rid)
        if not num_external or entry is None:
            return None
        first = entry[1] // self.page_size
        return first, first + num_external // self.page_size

    def cut_hit(self, rid: str, tokens: int) -> Hit:
        """Shorten ``rid``'s last lookup to ``tokens`` (whole pages, at most its hit), the L2
        part first: what a hybrid floor leaves of it."""
        hit, engine_hit = self._hits[rid]
        if tokens % self.page_size or not 0 <= tokens <= hit.tokens:
            raise CacheStateError(f"request {rid!r}: cannot cut a hit of {hit.tokens} tokens to {tokens}")
        if not tokens:
            del self._hits[rid]
            return Hit(0, 0, 0, False, hit.decision)
        l2 = min(hit.l2_tokens, tokens)
        cut = Hit(tokens, l2, tokens - l2, bool(tokens - l2) or not self.layerwise, hit.decision)
        self._hits[rid] = (cut, engine_hit)
        return cut

    def _decide(self, rid: str, engine_hit: int, l2_new: int, l3_new: int) -> Hit:
        """The cost model's verdict on a hit of ``l2_new`` + ``l3_new`` pages beyond ``engine_hit``."""
        ps = self.page_size
        if not l2_new and not l3_new:
            self._hits.pop(rid, None)
            return Hit(0, 0, 0, False)
        d = self.cost.decide(l2_new * ps, l3_new * ps)
        if not d.load_l2:
            l2_new = l3_new = 0
        elif not d.load_l3:
            l3_new = 0
        hit = Hit((l2_new + l3_new) * ps, l2_new * ps, l3_new * ps, bool(l3_new) or not self.layerwise, d)
        self._hits[rid] = (hit, engine_hit)
        return hit if hit.tokens else Hit(0, 0, 0, False, d)

    def page_hashes(self, key: bytes, namespace: str, num_pages: int) -> list[PageHash]:
        """The hashes of the first ``num_pages`` pages of ``key`` in ``namespace`` (the L3 keys). Pure."""
        return key_page_hashes(key, self.page_size, namespace, num_pages)

    def joins_load(self, key: bytes, namespace: str, first: int, cap: int) -> bool:
        """A load in flight for another request writes pages of ``[first, cap)`` of ``key``
        (same namespace, same content up to them): this request waits for it instead of
        loading them a second time. Pure."""
        ps4 = self._ps4
        for ns, span, start in self._spans.values():
            end = min(len(span) // ps4, cap)
            if ns != namespace or end <= max(first, start):
                continue
            lo, hi = 0, end  # pages of common content, found by halving (each test one memcmp)
            while lo < hi:
                mid = (lo + hi + 1) // 2
                if key[:mid * ps4] == span[:mid * ps4]:
                    lo = mid
                else:
                    hi = mid - 1
            if lo > max(first, start):
                return True
        return False

    def _waits(self, rid: str, key: bytes, namespace: str, first: int, cap: int) -> bool:
        """``rid``'s lookup waits for another request's load in flight (``joins_load``); its
        last lookup is then forgotten."""
        if not (self._spans and self.joins_load(key, namespace, first, cap)):
            return False
        self._hits.pop(rid, None)
        return True

    def _queue_load(self, rid: str, ld: "_Load", key: bytes = b"", namespace: str = "", first: int = 0) -> LoadSpec:
        """Queue ``ld``; ``key`` (up to its last page), ``namespace`` and ``first`` page let later
        lookups join it (``joins_load``)."""
        spec = ld.spec
        self._loads[spec.job] = ld
        if key and spec.blocks:
            self._spans[spec.job] = (namespace, key[:(first + len(spec.blocks)) * self._ps4], first)
        self._loading[rid] = spec.job
        ps = self.page_size
        l2, l3 = len(spec.host) * ps, len(spec.l3_host) * ps
        self._sources[rid] = {"L2": l2, "L3": l3}
        self._hit_tokens["L2"] += l2
        self._hit_tokens["L3"] += l3
        self._plan_loads.append(spec)
        return spec

    def _count_load(self, ld: "_Load", ok_pages: int) -> None:
        self._c["loaded"] += ok_pages
        self._c["load_errors"] += len(ld.spec.blocks) - ok_pages
        for r in ld.reports:
            if r.ok and r.seconds > 0 and r.nbytes:
                self.cost.bandwidth.observe("L2", r.nbytes, r.seconds)
            if r.l3_seconds > 0 and r.pages:
                self.cost.bandwidth.observe("L3", r.pages * self.layout.page_bytes, r.l3_seconds)


    def hit_sources(self, rid: str) -> dict[str, int]:
        """Tokens of ``rid``'s last allocated load by source (``{"L2": n, "L3": n}``; pages
        that cannot be served are in neither). Pure."""
        return dict(self._sources.get(rid, {}))

    def new_job(self) -> int:
        """A job id no other job of this scheduler (or a caller sharing its ids) has."""
        self._next_job += 1
        return self._next_job

    def take_plan(self) -> StepPlan:
        """The loads and saves queued since the last call (for every worker)."""
        plan = StepPlan(tuple(self._plan_loads), tuple(self._plan_saves))
        self._plan_loads, self._plan_saves = [], []
        return plan

    def completed(self, reports) -> None:
        """Hand the workers' reports of a step; a job completes once every rank reported."""
        for r in reports:
            if r.kind is JobKind.LOAD:
                ld = self._loads.get(r.job)
                if ld is None:
                    raise CacheStateError(f"a worker reported load job {r.job}, which is not in flight")
                ld.reports.append(r)
                if len(ld.reports) == self.ranks:
                    self._spans.pop(r.job, None)
                    self._complete_load(self._loads.pop(r.job))
            else:
                sv = self._saves.get(r.job)
                if sv is None or (r.kind is JobKind.SAVE and sv.stage is not JobKind.SAVE):
                    raise CacheStateError(f"a worker reported {r.kind} of job {r.job}, which is not in that stage")
                if sv.stage is not r.kind:  # a fast rank's L3 report before a slow rank's copy report
                    sv.early.append(r)
                    continue
                sv.reports.append(r)
                if len(sv.reports) == self.ranks:
                    self._complete_save(sv) if r.kind is JobKind.SAVE else self._complete_store(sv)

    def take_events(self) -> list[PageEvent]:
        """Pages stored to / removed from L2 and stored to L3 since the last call."""
        return self.events.take()

    def loading(self, rid: str) -> bool:
        """``rid`` has a load in flight (its blocks are being written)."""
        return rid in self._loading

    def stats(self) -> ConnectorStats:
        c = self._c
        pages = dict(loaded_pages=c["loaded"], load_error_pages=c["load_errors"], saved_pages=c["saved"],
                     save_dropped_pages=c["save_dropped"], stored_pages=c["stored"])
        return ConnectorStats.of(self._lookups, self._hit_tokens, pages, self.cost.stats)

    @property
    def in_flight(self) -> int:
        """Jobs not yet reported by every rank."""
        return len(self._loads) + len(self._saves)


class ConnectorScheduler(ConnectorJobs):
    """The scheduler half over the connector's own L2 (see the module docstring)."""

    def __init__(self, layout: KVLayout, host_pages: int, *, storage=None, cost: CostModel | None = None,
                 ranks: int = 1, layerwise: bool = False, probe_budget_s: float | None = 0.05,
                 host_eviction: str = "lru"):
        """``storage``: an L3 backend used for probes only (the workers read and write
        it); ``ranks``: workers that report each job; ``layerwise``: L2-only hits
        load synchronously, waited for per layer in the step's forward."""
        if host_pages < 1:
            raise ConfigError(f"the connector's L2 needs host_pages >= 1, got {host_pages}")
        super().__init__(layout, cost=cost, ranks=ranks, layerwise=layerwise)
        self.cache = PrefixCache(layout, PageAllocator(0, "L1"), PageAllocator(host_pages, "L2"),
                                 eviction="lru", host_eviction=host_eviction)
        self.tiers = TierManager(self.cache, debug_states=False)
        self.storage = storage
        self.probe_budget_s = probe_budget_s
        self.staged: set[HostPageId] = set()  # L2 pages handoff jobs hold outside the index (connector.pd)
        self._running: dict[str, int] = {}  # rid -> its step save's job, until every rank copied it

    # ------------------------------------------------------------- admission
    def lookup(self, rid: str, tokens, engine_hit: int, namespace: str = "", key: bytes | None = None) -> Hit:
        """Page-floored tokens beyond ``engine_hit`` (the engine's own, block-aligned hit)
        that L2, then L3, hold for ``tokens``; at least one token stays to compute.
        ``key``: the index key when the pages' content is more than their token ids
        (``hicache.core.hashing.content_key``); every call for ``rid`` passes the same kind.
        The engine asks about waiting requests only: ``rid``'s cached prefix is protected from
        eviction (``PrefixCache.note_waiting``) until ``admitted`` or ``finished``.
        Mutates counters and that protection (and probes L3 within ``probe_budget_s``)."""
        self._lookups += 1
        ps = self.page_size
        key = as_key(tokens) if key is None else key
        cap = max(0, len(key) // 4 - 1) // ps
        m = self.cache.match(key, namespace, max_tokens=cap * ps)
        self.cache.note_waiting(rid, key, namespace, matched=m)  # one tree walk for both
        first = engine_hit // ps
        if self._waits(rid, key, namespace, first, cap):
            return WAIT
        l2 = m.host_tokens // ps
        l3 = 0
        room = self._staging_room()
        if self.storage is not None and l2 < cap and room:
            hashes = self.page_hashes(key, namespace, cap)
            l3 = min(room, self.storage.prefix_hits(hashes[l2:cap], self.probe_budget_s))
        l2_new, l3_new = max(0, l2 - first), (l3 if l2 >= first else max(0, l2 + l3 - first))
        return self._decide(rid, engine_hit, l2_new, l3_new)

    def admitted(self, rid: str) -> None:
        """The engine scheduled ``rid`` (with or without a hit): it no longer waits."""
        self.cache.forget_waiting(rid)

    def allocated(self, rid: str, tokens, block_ids, num_external: int, namespace: str = "",
                  keys=(), key: bytes | None = None) -> LoadSpec | None:
        """The engine gave ``rid`` blocks ``block_ids`` (all of its blocks, in order) for
        ``num_external`` tokens of its last ``lookup``: pin the L2 part, reserve L2 for
        the L3 part and queue the load for the next plan. Pages that cannot be
        served any more are queued as missing (the workers report them failed).
        ``keys``: the engine's key of each page of ``tokens`` (for ``take_events``)."""
        span = self._allocated_span(rid, num_external)
        if span is None:
            return None
        hit, first, end = span
        ps = self.page_size
        key = as_key(tokens) if key is None else key
        blocks = tuple(int(b) for b in block_ids[first:end])
        m = self.cache.match(key, namespace, max_tokens=end * ps)
        l2_end = m.host_tokens // ps
        anchor, host = None, ()
        if l2_end > first:
            anchor = self.tiers.pin_host(m, l2_end)
            host = tuple(m.host_pages[first:l2_end])
        prefetch, l3_host, l3_hashes = None, (), ()
        l3_from = max(first, l2_end)
        if l3_from < end and hit.l3_tokens:
            hashes = self.page_hashes(key, namespace, end)[l3_from:end]
            self._evict(len(hashes))
            prefetch = self.tiers.prepare_prefetch(key, namespace, l3_from, hashes)
            if prefetch is not None:
                # a prefetch may bring only the leading pages L2 has room for: the rest are missing
                l3_host, l3_hashes = tuple(prefetch.host), tuple(hashes[:len(prefetch.host)])
        spec = LoadSpec(self.new_job(), rid, blocks, host, l3_host, l3_hashes, layerwise=not hit.is_async)
        ev = _event_fields(keys, tokens, l3_from, l3_from + len(l3_host), ps)
        return self._queue_load(rid, _Load(rid, spec, anchor, prefetch, *ev), key, namespace, first)

    # ------------------------------------------------------------- storing
    def finished(self, rid: str, tokens, computed_tokens: int, block_ids, namespace: str = "", keys=(),
                 key: bytes | None = None) -> bool:
        """``rid`` ended (finished, aborted or stopped) holding ``block_ids``: queue a
        save of the full pages of its ``computed_tokens`` that L2 lacks. True: the
        engine must keep the blocks until a worker reports the save finished. A
        request whose load is still in flight saves nothing (its blocks are not final).
        ``keys``: the engine's key of each page (for ``take_events``)."""
        self.cache.forget_waiting(rid)
        key, n = self._saveable(rid, tokens, computed_tokens, block_ids, key)
        return self._queue_save(rid, tokens, key, n, block_ids, namespace, keys, running=False)

    def step_save(self, rid: str, tokens, computed_tokens: int, block_ids, namespace: str = "", keys=(),
                  key: bytes | None = None) -> bool | None:
        """``rid`` runs on with ``computed_tokens`` computed in ``block_ids`` (the engine's
        steps so far): queue a save of its full pages that L2 lacks, so that a preempted,
        aborted or long-running request is reusable before it ends. One such save per
        request at a time; the workers finish it within the step it is planned in (the
        engine may free the blocks after that step). True: a save was queued; False:
        none is needed or L2 had no room; None: ``rid``'s load or save is in flight, ask again."""
        if rid in self._loading or rid in self._running:
            return None
        key = as_key(tokens) if key is None else key
        n = self.saveable_pages(tokens, computed_tokens, block_ids)
        return self._queue_save(rid, tokens, key, n, block_ids, namespace, keys, running=True)

    def _queue_save(self, rid: str, tokens, key: bytes, n: int, block_ids, namespace: str, keys,
                    running: bool) -> bool:
        """Queue a save of pages ``[have, n)`` of ``key`` (``have``: what L2 holds, or what a
        step save of ``rid`` in flight brings); True if one was queued."""
        if n == 0:
            return False
        ps = self.page_size
        key = key[:n * self._ps4]
        m = self.cache.match(key, namespace)
        have = m.host_tokens // ps
        inflight = self._running.get(rid)
        first = max(have, self._saves[inflight].first_page + len(self._saves[inflight].spec.host)) \
            if inflight in self._saves else have
        if first >= n:
            return False
        anchor = None
        if have:  # pinned before making room, which must not evict the prefix the save continues
            anchor = self.tiers.pin_host(m, have)
        self._evict(n - first)
        host = self.tiers.alloc_host(n - first)
        if host is None:
            if anchor is not None:
                self.tiers.unpin_host(anchor)
            self._c["save_dropped"] += n - first
            return False
        hashes = tuple(self.page_hashes(key, namespace, n)[first:]) if self.storage is not None else ()
        job = self.new_job()
        spec = SaveSpec(job, rid, tuple(int(b) for b in block_ids[first:n]), tuple(host), hashes, running=running)
        ev_keys, ev_parent, ev_tokens = _event_fields(keys, tokens, first, n, ps)
        self._saves[job] = _Save(rid, spec, key, namespace, first, anchor, keys=ev_keys, parent=ev_parent,
                                 tokens=ev_tokens)
        if running:
            self._running[rid] = job
        self._plan_saves.append(spec)
        return True

    # ------------------------------------------------------------- completion
    def _complete_load(self, ld: _Load) -> None:
        if self._loading.get(ld.rid) == ld.spec.job:
            del self._loading[ld.rid]
        if ld.anchor is not None:
            self.tiers.unpin_host(ld.anchor)
        landed = min(r.pages for r in ld.reports) if all(r.ok for r in ld.reports) else 0
        if ld.prefetch is not None:
            self.tiers.complete_prefetch(ld.prefetch, landed)
            alloc = self.cache.host_allocator
            held = [i for i, h in enumerate(ld.prefetch.host[:landed]) if alloc.is_allocated(h)]
            if held:  # the landed pages the index took (the rest were duplicates, freed)
                a, b = held[0], held[-1] + 1
                self.events.stored(L2, ld.keys[a:b], ld.keys[a - 1] if a else ld.parent,
                                   ld.tokens[a * self.page_size:b * self.page_size], ld.prefetch.host[a:b])
        self._count_load(ld, (len(ld.spec.host) + landed) if all(r.ok for r in ld.reports) else 0)

    def _complete_save(self, sv: _Save) -> None:
        """Every rank copied the blocks (or one failed): index the pages, then wait for L3."""
        spec, reports = sv.spec, sv.reports
        if self._running.get(sv.rid) == spec.job:
            del self._running[sv.rid]
        sv.reports = []
        ok = all(r.ok for r in reports)
        node, unused = (self.tiers.index_host(sv.key, sv.namespace, sv.first_page, list(spec.host),
                                              pin=bool(spec.hashes)) if ok else (None, list(spec.host)))
        if sv.anchor is not None:
            self.tiers.unpin_host(sv.anchor)
        taken = len(spec.host) - len(unused)
        if taken and node is not None:  # the index took the pages after the duplicates at the front
            k = len(unused)
            self.events.stored(L2, sv.keys[k:], sv.keys[k - 1] if k else sv.parent,
                               sv.tokens[k * self.page_size:], spec.host[k:])
        self._c["saved"] += taken
        self._c["save_dropped"] += len(spec.host) - taken
        if not spec.hashes:
            del self._saves[spec.job]
            self.tiers.free_host(unused)
            return
        # Every rank reports the L3 stage too (0 pages where its copy failed); the node stays
        # pinned (index_host) while L3 reads it.
        sv.node, sv.unused, sv.stage = node, unused, JobKind.STORE
        sv.reports, sv.early = sv.early, []
        if len(sv.reports) == self.ranks:
            self._complete_store(sv)

    def _complete_store(self, sv: _Save) -> None:
        del self._saves[sv.spec.job]
        stored = min(r.pages for r in sv.reports)
        self._c["stored"] += stored
        if sv.node is not None:
            whole = stored == len(sv.spec.host) and all(r.ok for r in sv.reports)
            self.tiers.complete_engine_store(sv.node, whole)
            if whole:
                self.events.stored(L3, sv.keys, sv.parent, sv.tokens)
        self.tiers.free_host(sv.unused)

    def _staging_room(self) -> int:
        """L2 pages an L3 part could be staged in now: those no job reserved (pinned
        indexed pages are counted too, so an allocation may still come up short)."""
        reserved = len(self.tiers.host_in_flight) + sum(len(sv.spec.host) for sv in self._saves.values()
                                                        if sv.stage is JobKind.SAVE)
        return max(0, self.cache.host_allocator.capacity - reserved)

    def _evict(self, n: int) -> None:
        """Make ``n`` L2 pages free (unpinned pages go, least recently used first)."""
        short = n - self.cache.host_allocator.num_free
        if short > 0:
            self.events.removed_l2(self.tiers.evict_host(short))

    # ------------------------------------------------------------- state
    def check_integrity(self) -> None:
        """Index invariants, with the L2 pages jobs hold outside it (``IntegrityError``)."""
        held: list[int] = list(self.tiers.host_in_flight) + sorted(self.staged)  # L3 parts', handoffs'
        for sv in self._saves.values():
            held += sv.spec.host if sv.stage is JobKind.SAVE else sv.unused
        self.cache.check_integrity(host_in_flight=held)
        self.tiers.check_integrity()
        self.cost.check_integrity()
        for rid, job in self._loading.items():
            if self._loads[job].rid != rid:
                raise IntegrityError(f"request {rid!r} maps to load job {job} of {self._loads[job].rid!r}")


def _event_fields(keys, tokens, first: int, end: int, ps: int) -> tuple[tuple, object | None, tuple]:
    """(keys, parent key, token ids) of pages ``[first, end)`` for events; () when the engine gave no keys."""
    if len(keys) < end:
        return (), None, ()
    return tuple(keys[first:end]), keys[first - 1] if first else None, tuple(tokens[first * ps:end * ps])
