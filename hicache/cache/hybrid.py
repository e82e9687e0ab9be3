"""``HybridCache``: a hybrid model's layer groups on the one tier engine, hits floored where
every group can resume.

The full groups' layers are one ``HiCache`` over their planes; each SWA group and the state
group is a ``GroupTiers`` (``hicache.tiers.groups``) registered with that ``HiCache``'s tier
manager and transfer engine, so its items (SWA pages keyed by page hash, snapshots by the
boundary's last page hash) move by the same two-phase plans, complete in the same ``poll``
and count in the same stats. What is hybrid lives here: the *record* of resumable
boundaries (``hicache.cache.hybrid_record``) and the floor every group resumes from
(``hicache.core.groups.resumable_floor``, agreed across TP/CP ranks), with the SWA window
and the snapshot there taken onto L1 (fetched from L3 within the prefetch budget, loaded
layer by layer through one ``LoadPlan`` per group). Between the floor and the full hit the
engine *replays* the SWA and state layers. In service mode (``hicache+unix://``) the full
groups' pages live in the node's shared segment and its L3; the group items stay on this
engine's L1 and L2 (the node service keeps no SWA pages or snapshots).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import NamedTuple

import torch

from hicache.index.prefix_cache import Tokens
from hicache.core.config import HiCacheConfig
from hicache.client.consensus import HitConsensus
from hicache.core.errors import IntegrityError, LayoutError
from hicache.tiers.groups import GroupTiers, TierCounts
from hicache.cache.hicache import HiCache
from hicache.core.groups import HybridFloor, LayerGroup, resumable_floor
from hicache.core.types import PrefetchPolicy
from hicache.cache.hybrid_admission import HybridAdmission, agreed_floor, floor_items, group_holds, settle_floor
from hicache.cache.hybrid_record import DEFAULT_MAX_BOUNDARIES, SWEEP_BATCH, BoundaryRecord
from hicache.cache.hybrid_request import HybridRequest
from hicache.core.layout import KVLayout
from hicache.index.request import RequestState
from hicache.storage import open_storage
from hicache.storage.capacity import backend_options
from hicache.core.types import DevicePageId, JobId, PageHash
from hicache.tiers.plans import BackupPlan


def group_layout(layout: KVLayout, kinds: tuple[str, ...], gi: int = -1) -> KVLayout:
    """The layout of one part of a hybrid ``layout``: ``("full",)`` the planes of every
    full group's layers (in layer order; draft planes kept), ``("swa",)`` group ``gi``'s
    layers (no draft planes), ``("state",)`` the state group's snapshot as one row of
    ``len(layers) * state_bytes`` bytes. The model id names the hybrid's fingerprint, so
    each part's fingerprint changes with any group of the whole."""
    fp = layout.fingerprint()
    if kinds == ("state",):
        g = layout.groups[gi]
        return KVLayout.rows(f"hybrid:{fp}:state{gi}", len(g.layers) * g.state_bytes,
                             {"hybrid": fp, "group": gi, "state_bytes": g.state_bytes, "layers": len(g.layers)})
    if kinds == ("full",):
        n = sum(len(g.layers) for g in layout.groups if g.kind == "full")
        return layout.replace(model_id=f"hybrid:{fp}:full", num_layers=n, groups=())
    g = layout.groups[gi]
    return layout.replace(model_id=f"hybrid:{fp}:swa{gi}", num_layers=len(g.layers), groups=(), draft_layers=0)


@dataclass(frozen=True, slots=True)
class HybridPools:
    """Sizes of the groups' own pools (0: the same page counts as the full groups' pools)
    and of the boundary record."""

    swa_device_pages: int = 0
    swa_host_pages: int = 0
    state_device_slots: int = 0  # 0: device_pages // snapshot_every, at least 4
    state_host_slots: int = 0  # 0: host_pages // snapshot_every, at least 4
    max_boundaries: int = DEFAULT_MAX_BOUNDARIES  # recorded boundaries kept; least recently used forgotten first


class HybridStats(NamedTuple):
    admissions: int
    hit_tokens: int  # the full groups' hits (exact), summed
    resumed_tokens: int  # the floors, summed: tokens reused in every group
    boundaries: int  # recorded boundaries now
    forgotten: int  # boundaries forgotten since the start (the cap, a prefix or an item gone, ``forget``)


class HybridCache:
    """See the module docstring. Not thread-safe: one scheduler thread calls everything."""

    def __init__(self, config: HiCacheConfig | None = None, *, layout: KVLayout | None = None,
                 pools: HybridPools = HybridPools(), storage=None, consensus: HitConsensus | None = None):
        """``consensus``: the TP/CP group's ``HitConsensus`` (``HiCache``'s argument); every
        rank then admits the same full hit and the same floor. Raises ``LayoutError`` for a
        layout without a full group, ``ConfigError`` for a bad ``pools``."""
        cfg = self.config = config or HiCacheConfig.load()
        self.layout = lay = layout or cfg.layout()
        if not lay.groups or not any(g.kind == "full" for g in lay.groups):
            raise LayoutError(f"HybridCache needs a layout with layer groups including a full group; "
                              f"{lay.model_id!r} has {[g.to_list() for g in lay.groups]}; use HiCache")
        self.boundaries = BoundaryRecord(pools.max_boundaries, lay.page_size)
        self.groups: tuple[LayerGroup, ...] = lay.groups
        self.ps = lay.page_size
        self.consensus = consensus
        self.hc = HiCache(cfg, layout=group_layout(lay, ("full",)), storage=storage, consensus=consensus)
        self.stores: dict[int, GroupTiers] = {}
        for gi, g in enumerate(self.groups):
            if g.kind != "full":
                st = self.stores[gi] = self._store(gi, g, pools)
                self.hc.tiers.add_group(gi, st)  # the one tier manager and transfer engine move its items
                self.hc.transfers.add_group(gi, st.device, st.host, st.storage)
        self.state_gi = next((gi for gi, g in enumerate(self.groups) if g.kind == "state"), None)
        self.live: dict[str, HybridRequest] = {}
        self._copies: dict[int, list[JobId]] = {}  # per group, its L1 -> L2 copies submitted (some may be done)
        self._admissions = self._hit = self._resumed = 0
        self._swept_epoch = -1  # the index's epoch at the last sweep of the record

    def _store(self, gi: int, g: LayerGroup, pools: HybridPools) -> GroupTiers:
        cfg, kind = self.config, g.kind
        lay = group_layout(self.layout, (kind,), gi)
        if kind == "swa":
            dev = pools.swa_device_pages or cfg.pool.device_pages
            host = pools.swa_host_pages or cfg.pool.host_pages
        else:
            dev = pools.state_device_slots or max(4, cfg.pool.device_pages // g.snapshot_every)
            host = pools.state_host_slots or max(4, cfg.pool.host_pages // g.snapshot_every)
        l3 = None
        if cfg.storage.url and not cfg.storage.url.startswith("hicache+unix:"):  # service mode: no group items there
            st = cfg.storage
            l3 = open_storage(st.url, fingerprint=lay.fingerprint(), layout=lay, timeout_ms=st.timeout_ms,
                              max_retries=st.max_retries, auth_key=st.resolved_auth_key(), **backend_options(st))
        return GroupTiers(f"{kind}{gi}", lay, dev, host, str(self.hc.device_pool.device), l3, group=gi)

    # ------------------------------------------------------------- requests
    def new_request(self, rid: str, tokens: Tokens, namespace: str = "") -> HybridRequest:
        """A WAITING request over every group (see ``HybridRequest``)."""
        if rid in self.live:
            raise ValueError(f"request id {rid!r} is live already")
        req = self.live[rid] = HybridRequest(self, self.hc.new_request(rid, tokens, namespace))
        return req

    def admit(self, req: HybridRequest, *, live_state_tokens: int = 0) -> HybridAdmission:
        """Schedule ``req``: the full groups' hit through ``HiCache.admit``, then the floor
        every group resumes from, with the SWA window and the snapshot there pinned on L1
        (loads started, not waited for: see ``HybridAdmission``). ``live_state_tokens``:
        tokens the engine still holds the request's recurrent state for (0 after a
        preemption that dropped it). Afterwards ``req.computed_tokens`` is the hit; compute
        ``[adm.resume, hit)`` again for the SWA and state layers only, then the rest.
        Raises as ``HiCache.admit`` (``TransferError`` once a load failed, a group's included)
        and ``OutOfPages``."""
        self.sweep(SWEEP_BATCH)
        ahead = self._load_ahead(req, live_state_tokens)
        full = self.hc.admit(req.inner)
        exact = req.inner.computed_tokens
        hashes = req.hashes(exact // self.ps)
        if ahead is not None and ahead[0] == exact:
            holds, floor = ahead[1], ahead[2]
        else:  # the admission changed the full hit (an L3 prefetch, no L1 room, the cost model): again
            req.release_swa(pinned_only=True)
            holds, floor = self._floor(req, hashes, exact, live_state_tokens)
        if self.consensus is not None:
            floor = agreed_floor(self.consensus, self.layout, req, hashes, holds, floor)
        # (a floor inside a page resumes at the request's own partial page, from the engine's live state)
        if any(st.copies_in_flight() for st in self.stores.values()):
            self.hc.complete_finished()  # copies done free their items' L1 pages for the span replayed
        loads, row = self._start_loads(req, snapshot=floor.tokens == floor.pages * self.ps)
        adm = HybridAdmission(self.layout, full, exact, floor.tokens, floor.limited_by, loads, row)
        if floor.pages:
            self.boundaries.use(hashes[floor.pages - 1], req.inner.node)
        req.prepare(floor.pages, exact, adm)
        self._admissions += 1
        self._hit += exact
        self._resumed += floor.tokens
        req.resume = floor.tokens
        req.fork = exact // self.ps if floor.pages < exact // self.ps else 0
        return adm

    def _floor(self, req: HybridRequest, hashes: list[PageHash], exact: int,
               live_state_tokens: int) -> tuple[list[list[bool]], HybridFloor]:
        """What the stores hold of ``hashes`` (L3 fetched within the budget) and the floor over
        it, with what resuming there reads taken by ``req``."""
        holds = group_holds(self.layout, self.stores, hashes)
        self._fetch(req, hashes, holds, exact, live_state_tokens)
        return holds, settle_floor(self.layout, req, hashes, holds, exact, live_state_tokens)

    def _load_ahead(self, req: HybridRequest, live_state_tokens: int) -> tuple | None:
        """Before ``HiCache.admit``: the floor over the full hit it is about to lock (a pure
        match), its items taken and their loads submitted, so that on the one lane the SWA
        window and the snapshot (small, read by the first layers) go ahead of the full pages
        and the full layers' load runs beside the forward. ``(exact, holds, floor)``; None
        without group stores. ``admit`` starts again when the hit it locks differs."""
        if not self.stores:
            return None
        exact = req.inner.match().exact_tokens
        holds, floor = self._floor(req, req.hashes(exact // self.ps), exact, live_state_tokens)
        for st in self.stores.values():
            plan = st.load_plan()
            if plan is not None:
                st.started(self.hc.transfers.load_handle(self.hc.submit(plan)))
        return exact, holds, floor

    def _fetch(self, req: HybridRequest, hashes: list[PageHash], holds: list[list[bool]], exact: int,
               live_state_tokens: int) -> None:
        """Fetch from L3 to L2 what resuming at the floor over ``holds`` reads and only L3 holds
        (one plan per group), waiting at most what is left of the prefetch policy's budget, as
        ``HiCache`` waits for its own prefetch. What has not landed then is marked missing in
        ``holds`` (it lands on L2 in a later ``poll``) and the lower floor's items are fetched
        in turn. Each round lowers the floor, so this ends."""
        if not any(st.storage is not None for st in self.stores.values()):
            return
        budget = self.hc.prefetch_budget_s(req.num_tokens)
        end = None if budget is None else time.perf_counter() + budget
        wait = self.config.policy.prefetch_policy is not PrefetchPolicy.BEST_EFFORT
        while True:
            floor = resumable_floor(self.layout.groups, self.ps, holds, exact_tokens=exact,
                                    live_state_tokens=live_state_tokens)
            reads = floor_items(self.layout, hashes, floor.pages)
            jobs = [self.hc.submit(p) for gi, items in reads.items()
                    if self.stores[gi].fetch([h for _, h in items]) for p in self.stores[gi].take_plans()]
            for job in jobs if wait else ():
                self.hc.transfers.wait(job, None if end is None else max(0.0, end - time.perf_counter()))
            if jobs:
                self.hc.complete_finished()
            missing = [(gi, i) for gi, items in reads.items() for i, h in items
                       if h not in self.stores[gi].l1 and h not in self.stores[gi].l2]
            if not missing:
                return
            for gi, i in missing:
                holds[gi][i] = False

    def _submit_plans(self) -> None:
        """Submit what the group stores prepared (write-through, L3 writes) to the one engine."""
        for gi, st in self.stores.items():
            for p in st.take_plans():
                job = self.hc.submit(p)
                if isinstance(p, BackupPlan):
                    self._copies.setdefault(gi, []).append(job)

    def alloc_group(self, gi: int, n: int) -> list[DevicePageId]:
        """``n`` private L1 ids of group ``gi``'s store for a request computing. Items whose
        L1 -> L2 copy is in flight cannot leave L1: when short, the copies done are completed
        first and the rest waited for (it must get them, as ``L1Room.room_to_compute``).
        Raises ``OutOfPages`` as ``GroupTiers.alloc``."""
        st = self.stores[gi]
        if st.device.allocator.num_free < n and st.copies_in_flight():
            self.hc.complete_finished()
            while st.copies_in_flight() and self._copies.get(gi):
                self.hc.wait_job(self._copies[gi].pop(0))
        if not st.copies_in_flight():
            self._copies.pop(gi, None)
        return st.alloc(n)

    def _start_loads(self, req: HybridRequest, *, snapshot: bool) -> tuple[dict, torch.Tensor | None]:
        """Start the L2 -> L1 loads of what ``req`` reads at its floor (items a lowered floor no
        longer reads are un-taken first), one ``LoadPlan`` per group on the one transfer
        engine, layer by layer as the full groups' own. Returns, per group, the loads it waits
        for (that one and earlier admissions' still bringing an item it reads) and the
        snapshot's L1 row when ``snapshot`` (the engine resumes from it)."""
        reads = req.reads()
        loads: dict[int, tuple] = {}
        for gi, st in self.stores.items():
            st.cancel_pending(set(reads[gi]))
            plan = st.load_plan()
            if plan is not None:
                st.started(self.hc.transfers.load_handle(self.hc.submit(plan)))
            loads[gi] = tuple({id(h): h for h in (st.loading[x] for x in reads[gi] if x in st.loading)}.values())
        row = None
        if snapshot and self.state_gi is not None and req.state_item is not None:
            st, g = self.stores[self.state_gi], self.groups[self.state_gi]
            row = st.device.buffers[0][req.state_item[1]].view(len(g.layers), g.state_bytes)
        return loads, row

    def full_slot_ids(self, pages: list) -> torch.Tensor:
        """Slot ids of the full groups' L1 ``pages`` (``DevicePool.slot_ids``)."""
        return self.hc.device_pool.slot_ids(pages)

    def request_ended(self, req: HybridRequest, state: RequestState) -> None:
        """``req`` released what it held and is now ``state``: FINISHED and ABORTED leave the
        live set; FINISHED and PREEMPTED sweep the record (``SWEEP_BATCH``)."""
        if state is not RequestState.PREEMPTED:
            del self.live[req.rid]
        if state is not RequestState.ABORTED:
            self.sweep(SWEEP_BATCH)

    # ------------------------------------------------------------- the record
    def record(self, req: HybridRequest, hashes: list[PageHash], b: int, snapshot: list | None) -> None:
        """Record boundary ``b`` of ``req``'s sequence: each SWA group needs its window there
        (taken from ``req``'s pages), the state group the snapshot given. With a state group a
        boundary without a snapshot cannot resume: nothing is recorded for it."""
        key = hashes[b - 1]
        rec = self.boundaries.get(key)
        if self.state_gi is not None and snapshot is None and (rec is None or not rec.snapshot):
            return
        node = req.inner.node  # the index node a running request holds: its path covers page b - 1
        if node is None or node.start_page + node.num_pages < b:
            raise IntegrityError(f"request {req.rid!r}: records boundary {b} but holds no index node through "
                                 f"its last page ({node!r})")
        if rec is not None and rec.pages != b:
            raise IntegrityError(f"boundary {key.hex()} recorded at {rec.pages} pages, again at {b}")
        row, had = None, rec is not None and rec.snapshot
        if self.state_gi is not None and snapshot is not None and (not had or self.stores[self.state_gi].lost(key)):
            row = self._snapshot_row(b, snapshot)  # checked (and its slot taken) before anything is recorded
        if rec is None:
            rec = self.boundaries.add(key, b, node)
        for gi, g in enumerate(self.groups):
            if g.kind == "swa":
                lo = max(0, b * self.ps - g.window + 1) // self.ps
                fresh = gi not in rec.swa
                self.boundaries.set_window(key, gi, tuple(hashes[lo:b]))
                req.keep_window(gi, hashes, lo, b, count=fresh)
        if row is not None and self.state_gi is not None:
            st = self.stores[self.state_gi]
            st.keep(key, row, needed=not had)  # (had: the store lost it; kept again, counted once)
            st.unpin(key)
            rec.snapshot = True
        self.boundaries.use(key, node)
        for old in self.boundaries.over_cap():
            self.forget(old)
        self._submit_plans()

    def _snapshot_row(self, b: int, snapshot: list) -> DevicePageId:
        """A private state-store L1 row holding ``snapshot`` (every state layer's tensor, as
        bytes). Raises ``ValueError`` naming the sizes when they differ, ``OutOfPages``."""
        if self.state_gi is None:
            raise LayoutError(f"a snapshot needs a state group; the layout's groups are "
                              f"{[g.kind for g in self.groups]}", "groups", None)
        st, g = self.stores[self.state_gi], self.groups[self.state_gi]
        raw = torch.cat([t.detach().contiguous().reshape(-1).view(torch.uint8) for t in snapshot])
        if raw.numel() != st.layout.row_bytes:
            raise ValueError(f"snapshot at boundary {b}: {raw.numel()} bytes, the state group holds "
                             f"{st.layout.row_bytes} ({len(g.layers)} layers x {g.state_bytes} bytes)")
        dev = self.alloc_group(self.state_gi, 1)[0]
        row = st.device.buffers[0][dev]
        row.copy_(raw.to(row.device))
        return dev

    def forget(self, key: PageHash) -> None:
        """Drop boundary ``key`` from the record: the SWA pages only it needed and its
        snapshot are freed on every tier (the full groups' pages are ``HiCache``'s).
        Raises ``KeyError`` for a key not recorded."""
        rec = self.boundaries.pop(key)
        for gi, hs in rec.swa.items():
            for h in hs:
                self.stores[gi].unref(h)
        if rec.snapshot and self.state_gi is not None:
            self.stores[self.state_gi].unref(key)

    def sweep(self, limit: int | None = None) -> int:
        """Forget every boundary that can no longer resume (see ``hicache.cache.hybrid_record``):
        an item it needs left every tier of its store, or its full-attention prefix is held
        by no tier (checked once pages left a tier of the index: ``limit`` boundaries per
        call, None: all). Admissions and request ends sweep ``SWEEP_BATCH``, ``evict`` and
        ``evict_host`` all. Returns the boundaries forgotten."""
        lost = {gi: s.take_gone() for gi, s in self.stores.items()}
        epoch = self.hc.cache.epoch
        changed, self._swept_epoch = epoch != self._swept_epoch, epoch
        # (``in_storage`` flags a node that L3 or, in service mode, the node's segment holds)
        below = self.hc.storage is not None or self.config.storage.url.startswith("hicache+unix:")
        stale = self.boundaries.stale(lost, self.state_gi, index_changed=changed, l3=below, limit=limit)
        for key in stale:
            self.forget(key)
        return len(stale)

    # ------------------------------------------------------------- tiers
    def evict(self, num_pages: int) -> int:
        """Take up to ``num_pages`` unpinned pages off L1 in every group (the full groups
        through ``HiCache.evict``); they stay on L2/L3 where written there. Then ``sweep``."""
        got = self.hc.evict(num_pages) + sum(s.evict_l1(num_pages) for s in self.stores.values())
        self.sweep()
        return got

    def evict_host(self, num_pages: int) -> int:
        """Drop up to ``num_pages`` pages from L2 in every group (L3 keeps its copies). Then ``sweep``."""
        got = len(self.hc.evict_host(num_pages)) + sum(s.evict_l2(num_pages) for s in self.stores.values())
        self.sweep()
        return got

    def held_bytes(self) -> dict[str, int]:
        """Bytes of cached pages and snapshots held per tier, every group together
        (L1/L2: indexed by the tree and the stores; running requests' private pages
        excluded; L3: what the stores wrote plus the full groups' stored pages)."""
        full = self.hc.layout.page_bytes
        nodes = list(self.hc.cache.nodes())
        l1 = sum(len(n.device_pages or ()) for n in nodes) * full
        l2 = sum(len(n.host_pages or ()) for n in nodes) * full
        l3 = sum(n.num_pages for n in nodes if n.in_storage) * full
        for s in self.stores.values():
            c, b = s.counts(), s.layout.page_bytes
            l1, l2, l3 = l1 + c.l1 * b, l2 + c.l2 * b, l3 + c.l3 * b
        return {"L1": l1, "L2": l2, "L3": l3}

    def counts(self) -> dict[int, TierCounts]:
        return {gi: s.counts() for gi, s in self.stores.items()}

    def stats(self) -> HybridStats:
        return HybridStats(self._admissions, self._hit, self._resumed, len(self.boundaries),
                           self.boundaries.forgotten)

    def poll(self) -> int:
        """``HiCache.poll``: every transfer done, the groups' included; never blocks. Returns
        the completions observed."""
        return self.hc.poll()

    def drain(self) -> None:
        self.hc.drain()

    def check_integrity(self) -> None:
        """``HiCache``'s checks, every store's, the record's own (cap, anchors), and the
        record against the stores: each store's ``need`` counts equal the recorded
        boundaries that name each item."""
        self.hc.check_integrity()
        for s in self.stores.values():
            s.check_integrity()
        want = self.boundaries.need_counts(list(self.stores), self.state_gi)
        for gi, s in self.stores.items():
            if s.need != want[gi]:
                diff = {h.hex()[:8]: (s.need.get(h), want[gi].get(h)) for h in set(s.need) ^ set(want[gi])
                        or {h for h in s.need if s.need[h] != want[gi].get(h)}}
                raise IntegrityError(f"{s.name}: need counts disagree with the record (store, record): {diff}")
        self.boundaries.check_integrity()
        for r in self.live.values():
            r.check_integrity()

    def close(self) -> None:
        self.hc.close()
        for s in self.stores.values():
            if s.storage is not None:
                s.storage.close()
