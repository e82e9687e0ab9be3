"""Scheduler half of the connector for an engine with several KV cache groups (a hybrid model).

The first full-attention group keys the index: it runs through ``ConnectorScheduler``
(L2 and L3, the cost model, events). Every other group keeps its pages on an L2 of its
own, keyed by page hash (``GroupItems``: a window need not be prefix-closed). A hit is
floored where every group resumes (``hicache.connector.groups.floor_hit``), and each
group moves only what that needs: the index's group every page past the engine's hit,
a sliding-window group the window before the boundary, a state (Mamba) group the state
at the boundary. A request that ends saves, per group, what a later hit at its end would
read; a state group's states are saved as the engine offers them (``boundary_states``:
vLLM's ``align`` hand-offs, the exact block of each state at a block boundary), copied
after the forward that writes them. Each group's specs carry its index
(``LoadSpec.group``), for its own worker (``hicache.connector.worker.GroupWorkers``).
Not thread-safe: the engine's scheduler thread calls everything.
"""
from __future__ import annotations

import dataclasses
import itertools
from collections import Counter, OrderedDict
from typing import Mapping, Sequence

from hicache.connector.groups import EngineGroup, check_groups, floor_hit, needed
from hicache.connector.plan import JobKind, JobReport, LoadSpec, SaveSpec, StepPlan
from hicache.connector.scheduler import ConnectorScheduler, Hit
from hicache.core.errors import CacheStateError, IntegrityError
from hicache.core.layout import KVLayout
from hicache.core.types import HostPageId, PageHash
from hicache.index.prefix_cache import as_key
from hicache.memory.allocator import PageAllocator
from hicache.storage.base import StorageBackend


# A lookup asks a group's L3 about at most this many of the pages before the hit's end
# (one batched exists; pages further back count as missing, which only lowers the floor).
_LANE_PROBE_PAGES = 64


class GroupItems:
    """One group's pages on L2, keyed by page hash, least recently used first."""

    def __init__(self, host_pages: int):
        self.alloc = PageAllocator(host_pages, "L2")
        self.items: OrderedDict[PageHash, HostPageId] = OrderedDict()
        self.pins: Counter[PageHash] = Counter()

    def holds(self, hashes: Sequence[PageHash]) -> list[bool]:
        """Pure."""
        return [h in self.items for h in hashes]

    def pin(self, hashes: Sequence[PageHash]) -> list[HostPageId]:
        """Pin the leading ``hashes`` it holds (until ``unpin``); their L2 ids."""
        out = []
        for h in hashes:
            if h not in self.items:
                break
            self.items.move_to_end(h)
            self.pins[h] += 1
            out.append(self.items[h])
        return out

    def unpin(self, hashes: Sequence[PageHash]) -> None:
        for h in hashes:
            self.pins[h] -= 1
            if not self.pins[h]:
                del self.pins[h]

    def reserve(self, n: int) -> list[HostPageId] | None:
        """``n`` free L2 pages, evicting unpinned items (least recently used first); None
        when pinned items leave too few."""
        short = n - self.alloc.num_free
        for h in [h for h in self.items if h not in self.pins][:max(0, short)]:
            self.alloc.free([self.items.pop(h)])
        return self.alloc.alloc(n) if self.alloc.num_free >= n else None

    def commit(self, hashes: Sequence[PageHash], host: Sequence[HostPageId], ok: bool) -> int:
        """Index saved pages (``ok``) or free them; duplicates are freed. Returns pages indexed."""
        taken = 0
        for h, i in zip(hashes, host):
            if ok and h not in self.items:
                self.items[h] = i
                taken += 1
            else:
                self.alloc.free([i])
        return taken

    def check_integrity(self, held: Sequence[HostPageId]) -> None:
        ids = list(self.items.values()) + list(held)
        if len(set(ids)) != len(ids) or len(ids) + self.alloc.num_free != self.alloc.capacity:
            raise IntegrityError(f"GroupItems: {len(self.items)} items + {len(held)} held by jobs + "
                                 f"{self.alloc.num_free} free != {self.alloc.capacity}, or an id twice")
        if any(h not in self.items for h in self.pins):
            raise IntegrityError(f"GroupItems: pins on items it does not hold: {sorted(self.pins)[:4]}")


@dataclasses.dataclass(slots=True)
class _GroupJob:
    group: int  # position in the scheduler's groups
    spec: LoadSpec | SaveSpec
    hashes: tuple[PageHash, ...]  # load: the pinned items; save: the items to index
    reports: list[JobReport] = dataclasses.field(default_factory=list)

    def stage_done(self, kind: JobKind, ranks: int) -> bool:
        """Every rank reported stage ``kind``."""
        return sum(r.kind is kind for r in self.reports) == ranks


class HybridConnectorScheduler:
    """See the module docstring."""

    def __init__(self, groups: Sequence[EngineGroup], layouts: Sequence[KVLayout], host_pages: Sequence[int], *,
                 ranks: int = 1, lane_storage: Mapping[int, StorageBackend] | None = None, **main_options):
        """``layouts[i]``, ``host_pages[i]``: group ``i``'s page layout and L2 pages;
        ``lane_storage[i]``: the L3 of group ``i`` (not the index group's: that is
        ``main_options["storage"]``), its items kept under their page hashes;
        ``main_options``: ``ConnectorScheduler``'s (storage, cost, layerwise, ...)."""
        check_groups(groups)
        self.groups = tuple(groups)
        self.main = next(i for i, g in enumerate(groups) if g.kind == "full")
        self.core = ConnectorScheduler(layouts[self.main], host_pages[self.main], ranks=ranks, **main_options)
        self.page_size = self.core.page_size
        self.ranks = ranks
        self.lanes = {i: GroupItems(host_pages[i]) for i in range(len(groups)) if i != self.main}
        self._position = {g.index: i for i, g in enumerate(groups)}
        self.lane_storage = {i: st for i, st in (lane_storage or {}).items() if st is not None}
        self._in_l3: dict[str, dict[int, set[PageHash]]] = {}  # rid -> per group, items its lookup found in L3 only
        self._jobs: dict[int, _GroupJob] = {}
        self._plan_loads: list[LoadSpec] = []
        self._plan_saves: list[SaveSpec] = []

    # ------------------------------------------------------------- admission
    def lookup(self, rid: str, tokens, engine_hit: int, namespace: str = "", key: bytes | None = None) -> Hit:
        """``ConnectorScheduler.lookup``, floored where every group resumes."""
        self._in_l3.pop(rid, None)
        hit = self.core.lookup(rid, tokens, engine_hit, namespace, key=key)
        if not hit.tokens:
            return hit
        ps = self.page_size
        first = engine_hit // ps
        end = first + hit.tokens // ps
        hashes = self.core.page_hashes(as_key(tokens) if key is None else key, namespace, end)
        holds = [[True] * end if i == self.main else self._holds(rid, i, hashes, first, hit.is_async)
                 for i in range(len(self.groups))]
        floor = floor_hit(self.groups, ps, first, holds).end
        if floor == end:
            return hit
        return self.core.cut_hit(rid, (floor - first) * ps)

    def _holds(self, rid: str, i: int, hashes: Sequence[PageHash], first: int, is_async: bool) -> list[bool]:
        """Which of ``hashes`` group ``i`` holds: on L2, or (an asynchronous load only: an L3
        part cannot load layer by layer) on its L3, asked once for the last ``_LANE_PROBE_PAGES``
        pages past ``first`` that L2 lacks."""
        held = self.lanes[i].holds(hashes)
        st = self.lane_storage.get(i)
        # the last pages only: a hit ends near the engine's match, and the scheduler thread waits
        miss = [p for p in range(max(first, len(hashes) - _LANE_PROBE_PAGES), len(hashes)) if not held[p]]
        if st is None or not is_async or not miss:
            return held
        found = {hashes[p] for p, ok in zip(miss, st.exists([hashes[p] for p in miss])) if ok}
        if found:
            self._in_l3.setdefault(rid, {})[i] = found
        return [h or k in found for h, k in zip(held, hashes)]

    def allocated(self, rid: str, tokens, block_ids: Sequence[Sequence[int]], num_external: int,
                  namespace: str = "", keys=(), key: bytes | None = None) -> None:
        """The engine gave ``rid`` blocks (per group, all of them, in order) for ``num_external``
        tokens of its last ``lookup``: queue each group's load."""
        ps = self.page_size
        span = self.core.pending_span(rid, num_external)
        spec = self.core.allocated(rid, tokens, block_ids[self.main], num_external, namespace, keys, key=key)
        if spec is None or span is None:
            return
        first, end = span
        hashes = self.core.page_hashes(as_key(tokens) if key is None else key, namespace, end)
        in_l3 = self._in_l3.pop(rid, {})
        for i, items in self.lanes.items():
            pages = needed(self.groups[i], ps, first, end)
            want = [hashes[p] for p in pages]
            host = items.pin(want)
            l3 = [] if spec.layerwise else list(itertools.takewhile(in_l3.get(i, set()).__contains__,
                                                                     want[len(host):]))
            l3_host = items.reserve(len(l3)) if l3 else ()
            if l3_host is None:  # pinned items leave no room: those pages are missing (load errors)
                l3, l3_host = [], ()
            blocks = tuple(int(block_ids[i][p]) for p in pages)
            job = self.core.new_job()
            lspec = LoadSpec(job, rid, blocks, tuple(host), tuple(l3_host), tuple(l3), layerwise=spec.layerwise,
                             group=self.groups[i].index)
            self._jobs[job] = _GroupJob(i, lspec, tuple(want[:len(host)]))
            self._plan_loads.append(lspec)

    # ------------------------------------------------------------- storing
    def finished(self, rid: str, tokens, computed_tokens: int, block_ids: Sequence[Sequence[int]],
                 namespace: str = "", keys=(), key: bytes | None = None) -> bool:
        """``rid`` ended holding ``block_ids`` (per group): save what a hit at the end of its
        computed full pages reads, per group. True: keep the blocks until the saves finished."""
        self._in_l3.pop(rid, None)  # a request that ends waiting (aborted) was never allocated
        n = 0 if self.core.loading(rid) else self.core.saveable_pages(tokens, computed_tokens, block_ids[self.main])
        delay = self.core.finished(rid, tokens, computed_tokens, block_ids[self.main], namespace, keys, key=key)
        if n == 0:
            return delay
        hashes = self.core.page_hashes(as_key(tokens) if key is None else key, namespace, n)
        for i, items in self.lanes.items():
            if self.groups[i].kind == "state":
                continue  # a state is saved as the engine offers it (boundary_states), never by position
            pages = [p for p in needed(self.groups[i], self.page_size, 0, n)
                     if hashes[p] not in items.items and int(block_ids[i][p]) != 0]  # 0: vLLM's null block
            host = items.reserve(len(pages)) if pages else None
            if host is None:
                continue
            job = self.core.new_job()
            items_hashes = tuple(hashes[p] for p in pages)
            spec = SaveSpec(job, rid, tuple(int(block_ids[i][p]) for p in pages), tuple(host),
                            items_hashes if i in self.lane_storage else (), group=self.groups[i].index)
            self._jobs[job] = _GroupJob(i, spec, items_hashes)
            self._plan_saves.append(spec)
            delay = True
        return delay

    def boundary_states(self, rid: str, tokens, offers: Sequence[tuple[int, int, int]], namespace: str = "",
                        key: bytes | None = None) -> int:
        """The engine offers ``rid``'s state blocks: ``(group index, block id, boundary tokens)``,
        each the state of a state group after exactly that many tokens, written by the forward
        of the step being planned (vLLM's Mamba ``align`` hand-offs). Queue a save of each one
        at a page boundary this group does not hold yet, copied after that forward. Returns
        the saves queued; offers of other groups, or not at a page boundary, are left."""
        ps = self.page_size
        want = [(self._position[g], b, t // ps) for g, b, t in offers
                if g in self._position and self.groups[self._position[g]].kind == "state" and t >= ps
                and t % ps == 0 and b != 0]
        if not want:
            return 0
        hashes = self.core.page_hashes(as_key(tokens) if key is None else key, namespace, max(p for *_, p in want))
        queued = 0
        for i, block, p in want:
            items, h = self.lanes[i], hashes[p - 1]  # the state after page p - 1: keyed as floor_hit reads it
            if h in items.items or any(gj.group == i and h in gj.hashes and isinstance(gj.spec, SaveSpec)
                                       for gj in self._jobs.values()):
                continue
            host = items.reserve(1)
            if host is None:
                continue
            job = self.core.new_job()
            spec = SaveSpec(job, rid, (int(block),), tuple(host), (h,) if i in self.lane_storage else (),
                            group=self.groups[i].index, running=True, after_forward=True)
            self._jobs[job] = _GroupJob(i, spec, (h,))
            self._plan_saves.append(spec)
            queued += 1
        return queued

    # ------------------------------------------------------------- a step
    def take_plan(self) -> StepPlan:
        """Every group's loads and saves queued since the last call (for every worker)."""
        idx = self.groups[self.main].index
        core = self.core.take_plan()
        plan = StepPlan(tuple(dataclasses.replace(s, group=idx) for s in core.loads) + tuple(self._plan_loads),
                        tuple(dataclasses.replace(s, group=idx) for s in core.saves) + tuple(self._plan_saves))
        self._plan_loads, self._plan_saves = [], []
        return plan

    def completed(self, reports: Sequence[JobReport]) -> None:
        """Hand the workers' reports; a group's job completes once every rank reported."""
        rest = []
        for r in reports:
            gj = self._jobs.get(r.job)
            if gj is None:
                rest.append(r)
                continue
            if isinstance(gj.spec, SaveSpec) and r.kind is JobKind.STORE and not gj.spec.hashes:
                raise CacheStateError(f"group job {r.job}: a {r.kind} report for a save without L3")
            gj.reports.append(r)
            # a load ends with its LOAD reports; a save with its SAVE reports, or (with L3) its STORE
            # reports: its L2 pages are indexed only once L3 has read them (none is freed under a put)
            last = JobKind.LOAD if isinstance(gj.spec, LoadSpec) else JobKind.STORE if gj.spec.hashes else JobKind.SAVE
            if gj.stage_done(last, self.ranks):
                self._complete(self._jobs.pop(r.job))
        self.core.completed(rest)

    def _complete(self, gj: _GroupJob) -> None:
        items = self.lanes[gj.group]
        spec = gj.spec
        if isinstance(spec, LoadSpec):
            items.unpin(gj.hashes)
            ok = all(r.ok for r in gj.reports)
            landed = min(r.pages for r in gj.reports) if ok else 0  # L3 pages every rank read, verified
            items.commit(spec.l3_hashes[:landed], spec.l3_host[:landed], True)
            items.commit(spec.l3_hashes[landed:], spec.l3_host[landed:], False)
            return
        copied = all(r.ok for r in gj.reports if r.kind is JobKind.SAVE)
        items.commit(gj.hashes, spec.host, copied)

    # ------------------------------------------------------------- state
    def hit_sources(self, rid: str) -> dict[str, int]:
        return self.core.hit_sources(rid)

    def take_events(self):
        return self.core.take_events()

    def stats(self):
        return self.core.stats()

    @property
    def in_flight(self) -> int:
        return self.core.in_flight + len(self._jobs)

    @property
    def cache(self):
        """The index (the index group's pages)."""
        return self.core.cache

    @property
    def storage(self):
        """The index group's L3 (probes only), or None."""
        return self.core.storage

    def close(self) -> None:
        """Close the groups' own L3s (the index group's belongs to the caller)."""
        for st in self.lane_storage.values():
            st.close()

    def check_integrity(self) -> None:
        self.core.check_integrity()
        for i, items in self.lanes.items():
            held = [h for gj in self._jobs.values() if gj.group == i
                    for h in (gj.spec.host if isinstance(gj.spec, SaveSpec) else gj.spec.l3_host)]
            items.check_integrity(held)
