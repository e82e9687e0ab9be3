"""The plans the tier manager (``hicache.tiers.manager``) and the L2 strategies
(``hicache.tiers.l2``) prepare: small typed records, valid from ``prepare_*`` until
the matching ``complete_*``. The transfer engine reads only their ``route`` (which
picks its mover), group and ids (``hicache.transfer.media``); the tree nodes and keys they carry are the scheduler
side's, handed back to it at ``complete_*``."""
from __future__ import annotations

from typing import NamedTuple

from hicache.core.types import DevicePageId, HostPageId, PageHash
from hicache.index.node import Node
from hicache.transfer.media import FULL, L1_TO_L2, L2_TO_L1, L2_TO_L3, L3_TO_L2, Route

__all__ = ["FULL", "BackupPlan", "LoadPlan", "StorePlan", "PrefetchPlan", "Plan"]

# A plan's ``group`` (``FULL``: the index's full-attention pages, the tree's nodes; ``g >= 0``:
# items of layer group ``g`` of a hybrid layout, ``hicache.tiers.groups``: SWA pages, state
# snapshots), keyed by (group, page hash) as vLLM's ``OffloadKey`` carries a group index,
# with ``node`` None.


class BackupPlan(NamedTuple):
    """Copy every plane of ``device[i]`` (L1) to ``host[i]`` (L2)."""

    node: Node  # whose L1 pages are copied (a layer group's items, ``group >= 0``: None, no node)
    device: list[DevicePageId]
    host: list[HostPageId]
    draft: bool  # the source's draft rows are valid (what the copy will hold)
    pinned: bool  # ``node`` stays locked on L1 until ``complete_backup``
    # Service mode: ``host`` are pages reserved in the node's shared L2, to be
    # committed under these hashes once filled (None: pages of the private L2).
    shared: list[PageHash] | None = None
    group: int = FULL
    route: Route = L1_TO_L2  # the plan's kind, fixed (never passed): picks its mover


class LoadPlan(NamedTuple):
    """Copy ``host[i]`` (L2) into ``device[i]`` (L1), layer by layer."""

    last: Node
    path: tuple[Node, ...]
    host: list[HostPageId]
    device: list[DevicePageId]
    # Service mode: ``host`` are shared-L2 pages acquired under these hashes,
    # released once the copy completed (None: pages of the private L2).
    shared: list[PageHash] | None = None
    group: int = FULL
    route: Route = L2_TO_L1  # the plan's kind, fixed (never passed): picks its mover


class StorePlan(NamedTuple):
    """Write L2 pages ``host`` to L3 under ``hashes``."""

    node: Node  # (a layer group's items, ``group >= 0``: None, no node)
    host: list[HostPageId]
    hashes: list[PageHash]  # the L3 keys
    group: int = FULL
    route: Route = L2_TO_L3  # the plan's kind, fixed (never passed): picks its mover


class PrefetchPlan(NamedTuple):
    """Read ``hashes`` from L3 into L2 pages ``host`` (a prefix of them may land)."""

    key: bytes  # tokens of the sequence up to the last page asked for
    namespace: str
    first_page: int  # logical index of the first page asked for
    host: list[HostPageId]
    hashes: list[PageHash]
    group: int = FULL
    after: Node | None = None  # the L2 hit the pages continue, pinned on L2 until complete
    route: Route = L3_TO_L2  # the plan's kind, fixed (never passed): picks its mover


Plan = BackupPlan | LoadPlan | StorePlan | PrefetchPlan
