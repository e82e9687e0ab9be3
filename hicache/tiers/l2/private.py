"""``PrivateL2``: this engine's own pinned host pool as L2 (the embedded default).

The index (``PrefixCache``) records which L2 page holds which node's pages,
and ``TierManager`` makes the two-phase plans; this strategy only adapts them
to ``hicache.tiers.l2.base.L2Tier``.
"""
from __future__ import annotations

from hicache.index.prefix_cache import Request
from hicache.core.errors import CacheStateError
from hicache.index.node import Node
from hicache.tiers.plans import BackupPlan, LoadPlan
from hicache.tiers.holds import LoadBack, LoadRequest
from hicache.memory.pools import HostPool
from hicache.index.request import MatchResult
from hicache.tiers.manager import TierManager
from hicache.core.types import DevicePageId


class PrivateL2:
    """L2 in this process's pinned ``HostPool`` (see ``L2Tier`` for the contract)."""

    def __init__(self, pool: HostPool, tiers: TierManager):
        """``tiers``: the tier manager over the index that records L2 pages from ``pool``."""
        if tiers.cache.host_allocator is not pool.allocator:
            raise CacheStateError("PrivateL2: the tier manager's index must be built over this L2's pool")
        self._pool = pool
        self.tiers = tiers

    @property
    def pool(self) -> HostPool:
        return self._pool

    @property
    def private_bytes(self) -> int:
        return self._pool.nbytes()

    def unbacked(self, node: Node) -> bool:
        return node.host_pages is None and node not in self.tiers.backing_up

    def prepare_backup(self, node: Node, *, pin: bool) -> BackupPlan | None:
        return self.tiers.prepare_backup(node, pin=pin)

    def complete_backup(self, plan: BackupPlan, ok: bool) -> list[Node]:
        return self.tiers.complete_backup(plan, ok)

    def plan_load(self, req: Request, m: MatchResult, budget_s: float | None) -> LoadBack | None:
        """The index's L2 hit in ``m`` (``TierManager.plan_load`` pins it); no L3 behind it here."""
        lr = self.tiers.plan_load(m)
        return None if lr is None else LoadBack(lr.num_pages, m.tokens, 0, lr)

    def cancel_load(self, lb: LoadBack) -> None:
        self.tiers.cancel_load(_held(lb))

    def prepare_load(self, req: Request, lb: LoadBack, device_pages: list[DevicePageId]) -> LoadPlan:
        return self.tiers.prepare_load(_held(lb), device_pages)

    def complete_load(self, plan: LoadPlan, ok: bool) -> None:
        self.tiers.complete_load(plan, ok)

    def reconnect(self, idle: bool) -> HostPool | None:
        return None  # in this process: never away

    def check_integrity(self) -> None:
        self._pool.check_integrity()

    def close(self) -> None:
        pass  # the pool is plain (or pinned) process memory, freed with it


def _held(lb: LoadBack) -> LoadRequest:
    if not isinstance(lb.held, LoadRequest):
        raise CacheStateError(f"PrivateL2 was handed another tier's load back ({type(lb.held).__name__})")
    return lb.held
