"""The L2 tier as one strategy: the interface ``HiCache`` calls, whichever L2 it has.

Two implementations: ``PrivateL2`` (``hicache.tiers.l2.private``: this engine's own
pinned host pool, indexed in its ``PrefixCache``) and ``SharedL2``
(``hicache.tiers.l2.shared``: the node service's shared-memory segment, indexed by
the service). ``HiCache`` holds one and never asks which.

Two movements, each two-phase as vLLM's ``prepare_*``/``complete_*``: a
``prepare_*`` reserves and pins and returns a plan (or ``None``: nothing to
do, or no room); the caller submits the plan to the transfer engine and,
once the bytes moved (or failed to), hands the outcome to ``complete_*``
exactly once. ``complete_*`` always unpins what ``prepare_*`` pinned.
"""
from __future__ import annotations

from typing import NamedTuple, Protocol, cast

from hicache.client.link import SCHEME
from hicache.core.config import HiCacheConfig, PolicyConfig
from hicache.core.layout import KVLayout
from hicache.core.types import DevicePageId
from hicache.index.node import Node
from hicache.index.prefix_cache import Request
from hicache.index.request import MatchResult
from hicache.memory.allocator import PageAllocator
from hicache.memory.pools import HostPool
from hicache.tiers.l2.private import PrivateL2
from hicache.tiers.l2.shared import ServiceHostTier, SharedL2
from hicache.tiers.manager import TierManager
from hicache.tiers.plans import BackupPlan, LoadPlan
from hicache.tiers.holds import LoadBack


class L2Tier(Protocol):
    """What ``HiCache`` asks of its L2.

    * **backup** (L1 -> L2): ``prepare_backup`` / ``complete_backup``.
      ``ok=False``: the L2 pages reserved for it are returned (private: freed to
      the host pool; shared: the service's reservation is cancelled), nothing is
      indexed (no L2 ids on the node, nothing committed at the service), and the
      node is as before ``prepare_backup`` (on L1, unpinned, backable again).
    * **load back** (L2 -> L1): ``plan_load`` (pin or acquire the L2 hit) ->
      the caller finds L1 pages -> ``prepare_load`` (index them as L1 pages,
      pinned until complete) or ``cancel_load`` (no L1 pages: everything
      ``plan_load`` took is given back, nothing indexed) -> ``complete_load``.
      ``ok=False``: the L2 side is released (private: the L2 pin; shared: the
      acquisition), the L1 pages are unpinned but stay indexed, holding unknown
      bytes: the caller must stop serving (``HiCache`` raises ``TransferError``
      from then on). A load cannot un-index what it indexed at ``prepare_load``:
      requests that locked the hit meanwhile already count those pages.

    Not thread-safe: the scheduler thread calls everything.
    """

    @property
    def pool(self) -> HostPool:
        """The host memory the transfer engine copies to and from (the shared
        strategy maps a new one after ``reconnect``)."""

    @property
    def private_bytes(self) -> int:
        """Host memory this engine holds for L2 pages of its own (0: the shared segment)."""

    def unbacked(self, node: Node) -> bool:
        """``node`` has no L2 copy and none is being made (pure)."""

    def prepare_backup(self, node: Node, *, pin: bool) -> BackupPlan | None:
        """Reserve L2 pages for ``node``'s L1 pages not yet in L2. ``pin``: lock the node
        on L1 until ``complete_backup`` (the shared strategy always pins). None:
        nothing to copy, L2 full or unreachable (counted as dropped)."""

    def complete_backup(self, plan: BackupPlan, ok: bool) -> list[Node]:
        """Record (or, ``ok=False``, give back) ``plan``'s copy; the nodes that got
        L2 copies in the index (what may go on to L3)."""

    def plan_load(self, req: Request, m: MatchResult, budget_s: float | None) -> LoadBack | None:
        """Hold the L2 hit continuing ``m`` (``req``'s one lookup) and pin the L1 hit it
        continues; None: nothing to load (no index lookup either way). ``budget_s``:
        how long the request may wait for an L3 behind L2 (None: as long as it takes)."""

    def cancel_load(self, lb: LoadBack) -> None:
        """Give back a ``plan_load`` that got no L1 pages; nothing is indexed."""

    def prepare_load(self, req: Request, lb: LoadBack, device_pages: list[DevicePageId]) -> LoadPlan:
        """Index ``lb``'s pages as L1 pages ``device_pages`` of ``req``'s key, pinned and
        loading until ``complete_load`` (readers wait for the copy)."""

    def complete_load(self, plan: LoadPlan, ok: bool) -> None:
        """Unpin a finished load and release its L2 side (see the class docstring for ``ok=False``)."""

    def reconnect(self, idle: bool) -> HostPool | None:
        """After an outage of a remote L2, map it again when ``idle`` (no transfer
        uses the old mapping); the new pool, or None (nothing changed)."""

    def check_integrity(self) -> None:
        """This tier's own invariants (``IntegrityError``)."""

    def close(self) -> None:
        """Release the tier's resources (after every transfer finished)."""


class L2Memory(NamedTuple):
    """The L2 memory an embedded cache gets, before its index exists (``open_l2``)."""

    pool: HostPool  # what the transfer engine copies to and from
    index_allocator: HostPool | PageAllocator  # what the index records L2 pages from (empty: the service's)
    link: ServiceHostTier | None  # service mode: the connection to the node's segment (None: private L2)
    l3_url: str  # the L3 the caller should open ("" when storage.url named the service: its L3 is behind L2)


def open_l2(cfg: HiCacheConfig, layout: KVLayout, device: str, *, l3_given: bool = False) -> L2Memory:
    """The node service's shared segment when ``storage.url`` names its socket
    (``hicache+unix://``) and no L3 object was passed in (``l3_given``), else a
    private pinned pool of ``pool.host_pages`` (``ConfigError`` when the host
    cannot hold it, or when the service does not answer). Build the index over
    ``index_allocator``, then the strategy (``build_l2``)."""
    url = cfg.storage.url
    if not l3_given and url.startswith(SCHEME + ":"):
        link = ServiceHostTier.open(cfg, layout, device)
        return L2Memory(link.pool, PageAllocator(0, "L2 (shared)"), link, "")
    cfg.check_host_memory(layout, device)  # L1 too when it is on the CPU
    pool = HostPool(layout, cfg.pool.host_pages)
    return L2Memory(pool, pool, None, url)


def build_l2(memory: L2Memory, tiers: TierManager, policy: PolicyConfig) -> L2Tier:
    """The L2 strategy over ``memory``, complete: ``tiers`` (and its index) were built
    over ``memory.index_allocator``."""
    if memory.link is None:
        return PrivateL2(memory.pool, tiers)
    return SharedL2(memory.link, cast(PageAllocator, memory.index_allocator), tiers, policy)  # open_l2's empty one
