"""What a hybrid admission decides (``HybridAdmission``) and how: the floor every
group resumes from over what the group stores hold, agreed across TP/CP ranks,
and the items resuming there reads (``floor_items``). Functions over a
``KVLayout``, the group stores and a ``HybridRequest``; they keep no state.
``HybridCache.admit`` calls ``group_holds``, ``settle_floor`` (then ``agreed_floor``
with a consensus); ``HybridAdmission`` waits per layer on its group's loads.
"""
from __future__ import annotations

import torch

from hicache.client.consensus import HitConsensus
from hicache.core.errors import CacheStateError
from hicache.tiers.groups import GroupTiers
from hicache.cache.hicache import Admission
from hicache.core.groups import HybridFloor, resumable_floor
from hicache.transfer.engine import LoadHandle
from hicache.tiers.plans import FULL
from hicache.cache.hybrid_request import HybridRequest
from hicache.core.layout import KVLayout
from hicache.core.types import PageHash


class HybridAdmission:
    """What ``HybridCache.admit`` decided. Valid until the request ends or is admitted again.

    Its loads are in flight on the one transfer engine: a full-attention layer waits on
    ``full`` (``HiCache``'s load of the full groups, whose layer ``j`` is the ``j``-th full
    layer of the hybrid layout), a layer of another group only on that group's loads in
    ``loads[g]`` (this admission's and earlier ones' still bringing an item it reads), the
    snapshot only on the state group's. ``wait_*`` raise as ``LoadHandle``'s."""

    __slots__ = ("full", "hit", "resume", "limited_by", "loads", "_row", "_released", "_layer", "_state_gi")

    def __init__(self, layout: KVLayout, full: Admission, hit: int, resume: int, limited_by: int | None,
                 loads: dict[int, tuple[LoadHandle, ...]], state_row: torch.Tensor | None):
        self.full = full  # the full groups' admission (HiCache's)
        self.hit = hit  # the full groups' hit, tokens (exact: the request's own partial page included)
        self.resume = resume  # where every group resumes (<= hit); the engine replays [resume, hit)
        self.limited_by = limited_by  # the first group that cut the floor below the hit; None if none
        self.loads = loads
        self._row, self._released = state_row, False  # the snapshot's L1 row ([layers, state_bytes] uint8)
        fulls = sorted(i for g in layout.groups if g.kind == "full" for i in g.layers)
        self._layer = {layer: (FULL, j) for j, layer in enumerate(fulls)}  # KV layer -> (group, its layer there)
        self._layer.update({layer: (gi, k) for gi, g in enumerate(layout.groups) if g.kind == "swa"
                            for k, layer in enumerate(g.layers)})
        self._state_gi = next((gi for gi, g in enumerate(layout.groups) if g.kind == "state"), None)

    def wait_layer(self, i: int) -> None:
        """KV layer ``i`` of the hybrid layout is on L1 (GPU: the current stream waits): its own
        group's loads only."""
        if i not in self._layer:
            raise IndexError(f"layer {i} is in no attention group of the layout ({len(self._layer)} layers)")
        g, k = self._layer[i]
        if g == FULL:
            self.full.wait_layer(k)
            return
        for h in self.loads.get(g, ()):
            h.wait_layer(k)

    def wait_state(self) -> None:
        """The snapshot at the floor is on L1 (no-op without one)."""
        for h in self.loads.get(self._state_gi, ()) if self._state_gi is not None else ():
            h.wait()

    @property
    def state(self) -> torch.Tensor | None:
        """The snapshot at ``resume`` (``[layers, state_bytes]`` uint8, a copy), once it is on
        L1 (waits for the state group's load only); None: no snapshot (resume at 0, at the
        request's own partial page with its live state, or no state group). Read it before
        the request's first ``commit`` / ``advance``, which give its L1 row back (then it
        raises ``CacheStateError``)."""
        if self._released:
            raise CacheStateError("the snapshot at the floor was given back when the request first advanced; "
                                  "read HybridAdmission.state before its first commit or advance")
        if self._row is None:
            return None
        self.wait_state()
        return self._row.clone()

    def release_state(self) -> None:
        """The request gave the snapshot's L1 row back (``state`` raises from now on)."""
        self._released = self._row is not None

    def wait(self) -> None:
        self.full.wait()
        for hs in self.loads.values():
            for h in hs:
                h.wait()


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
