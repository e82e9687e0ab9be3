"""What a hybrid admission decides (``HybridAdmission``) and how: the floor every
group resumes from over what the group stores hold, agreed across TP/CP ranks,
and the one copy plan that brings the floor's SWA window and snapshot to L1.

Functions over a ``KVLayout`` (its groups and page size), the group stores and
a ``HybridRequest``; they keep no state of their own. ``HybridCache.admit``
calls them in order: ``group_holds``, ``settle_floor`` (then ``agreed_floor``
with a consensus), ``pending_plan`` for the loads it starts.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from hicache.client.consensus import HitConsensus
from hicache.core.errors import IntegrityError
from hicache.tiers.groups import GroupTiers
from hicache.cache.hicache import Admission
from hicache.core.groups import HybridFloor, resumable_floor
from hicache.transfer.hybrid_copy import HybridCopyPlan, on_group_pools, plan_load
from hicache.transfer.hybrid_load import AdmissionWaits
from hicache.cache.hybrid_request import HybridRequest
from hicache.core.layout import KVLayout
from hicache.core.types import PageHash


class HybridAdmission(NamedTuple):
    """What ``HybridCache.admit`` decided. Valid until the request ends or is admitted again.
    Its loads are in flight: wait before a layer reads its pages (``wait_layer``)."""

    full: Admission  # the full groups' admission (HiCache's)
    hit: int  # the full groups' hit, tokens (exact: the request's own partial page included)
    resume: int  # where every group resumes (<= hit); the engine replays [resume, hit)
    limited_by: int | None  # index of the first group that cut the floor below the hit; None if none
    waits: AdmissionWaits  # per group: what layer ``i`` and the snapshot wait for

    @property
    def state(self) -> torch.Tensor | None:
        """The snapshot at ``resume`` (``[layers, state_bytes]`` uint8, a copy), once it is on
        L1 (waits for the state group's copy only); None: no snapshot (resume at 0, at the
        request's own partial page with its live state, or no state group). Read it before
        the request's first ``commit`` / ``advance``, which give its L1 row back (then it
        raises ``CacheStateError``)."""
        return self.waits.snapshot()

    def wait_layer(self, i: int) -> None:
        """KV layer ``i`` of the hybrid layout is on L1: waits for its own group's copies only."""
        self.waits.wait_layer(i)

    def wait(self) -> None:
        self.waits.wait()


def group_holds(layout: KVLayout, stores: dict[int, GroupTiers], hashes: list[PageHash]) -> list[list[bool]]:
    """``resumable_floor``'s rows: full groups hold the whole hit, the others what their
    store holds (a state group's row ``i``: the snapshot at boundary ``i + 1``)."""
    return [[True] * len(hashes) if g.kind == "full" else stores[gi].holding(hashes)
            for gi, g in enumerate(layout.groups)]


def floor_items(layout: KVLayout, hashes: list[PageHash], b: int) -> dict[int, list[tuple[int, PageHash]]]:
    """Per non-full group, the items resuming at boundary ``b`` reads, as ``(row, hash)`` in
    ``group_holds``' rows: each SWA group's window pages before ``b``, the state group's
    snapshot at ``b`` (row ``b - 1``). Pure."""
    out: dict[int, list[tuple[int, PageHash]]] = {}
    for gi, g in enumerate(layout.groups):
        if g.kind == "swa":
            lo = max(0, b * layout.page_size - g.window + 1) // layout.page_size
            out[gi] = [(p, hashes[p]) for p in range(lo, b)]
        elif g.kind == "state" and b:
            out[gi] = [(b - 1, hashes[b - 1])]
    return out


def settle_floor(layout: KVLayout, req: HybridRequest, hashes: list[PageHash], holds: list[list[bool]],
                 exact: int, live_state_tokens: int, cap: int | None = None) -> HybridFloor:
    """The floor over ``holds`` (its first ``cap`` pages when given: no exact tokens then)
    with what resuming there reads taken by ``req``; an item listed but not loadable (e.g.
    a corrupt L3 object) is marked missing (in ``holds`` too) and the floor computed again
    without it."""
    rows = holds if cap is None else [r[:cap] for r in holds]
    while True:
        floor = resumable_floor(layout.groups, layout.page_size, rows, exact_tokens=exact if cap is None else 0,
                                live_state_tokens=live_state_tokens)
        miss = req.take(hashes, floor.pages)
        if miss is None:
            return floor
        gi, page = miss
        rows[gi][page] = holds[gi][page] = False  # (``holds`` too: a lower cap later skips it)


def agreed_floor(consensus: HitConsensus, layout: KVLayout, req: HybridRequest, hashes: list[PageHash],
                 holds: list[list[bool]], floor: HybridFloor) -> HybridFloor:
    """The floor every rank of ``consensus`` resumes from (collectives: every rank makes
    the same calls, as their answers are the same). Ranks that found the same floor keep
    it (a partial page included); otherwise each rank lowers its floor to a boundary it
    can resume from at or below the page-floored minimum, until all name the same one.
    Each round lowers the minimum, so this ends (at boundary 0 at worst).
    ``limited_by`` stays this rank's own."""
    ps = layout.page_size
    lo, neg_hi = consensus.agree([floor.tokens, -floor.tokens])
    while lo != -neg_hi:
        t = lo // ps * ps
        if floor.tokens != t:
            req.release_swa(pinned_only=True)
            floor = settle_floor(layout, req, hashes, holds, 0, 0, cap=t // ps)._replace(limited_by=floor.limited_by)
        lo, neg_hi = consensus.agree([floor.tokens, -floor.tokens])
    return floor


def pending_plan(layout: KVLayout, stores: dict[int, GroupTiers], hashes: list[PageHash], b: int) -> HybridCopyPlan:
    """The stores' pending copies as one ``plan_load`` plan for boundary ``b`` (what the
    groups already hold on L1 is resident), in each store's own planes. Raises
    ``IntegrityError`` when a store has a pending copy the plan does not move."""
    src, dst, resident = [], [], []
    for gi in range(len(layout.groups)):
        pend = stores[gi].pending if gi in stores else {}
        rows = [pend.get(h) for h in hashes[:b]]
        src.append([r[0] if r else None for r in rows])
        dst.append([r[1] if r else None for r in rows])
        resident.append([r is None for r in rows])
    plan = plan_load(layout, b, src, dst, resident)
    moved = {c.group: len(c.src) for c in plan.copies}
    if any(moved[gi] != len(st.pending) for gi, st in stores.items()):
        raise IntegrityError(f"pending copies per store {[len(st.pending) for st in stores.values()]} "
                             f"are not what the plan for boundary {b} moves {moved}: an item taken outside "
                             "the window or snapshot the request reads")
    return on_group_pools(plan, layout, {gi: st.layout for gi, st in stores.items()})
