"""The plans the tier manager (``hicache.tiers.manager``) and the L2 strategies
(``hicache.tiers.l2``) prepare and the transfer engine (``hicache.transfer.engine``)
executes: small typed records, valid from ``prepare_*`` until the matching
``complete_*`` (``LoadRequest``/``Acquired``/``LoadBack``: from ``plan_load``
until ``prepare_load`` or ``cancel_load``)."""
from __future__ import annotations

from typing import NamedTuple

from hicache.index.node import Node
from hicache.core.types import DevicePageId, HostPageId, PageHash

# The ``group`` of every plan: which layer group's pools its ids are in. FULL: the index's
# full-attention pages (the tree's nodes); ``g >= 0``: items of layer group ``g`` of a hybrid
# layout (``hicache.tiers.groups``: SWA pages, state snapshots), keyed by (group, page hash)
# as vLLM's ``OffloadKey`` carries a group index, with ``node`` None.
FULL = -1


class ItemKey(NamedTuple):
    """One item of a layer group: the group's index and the item's page hash."""

    group: int
    hash: PageHash


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


class LoadRequest(NamedTuple):
    """An L2 hit to load back, pinned on L2 and not yet given L1 pages."""

    last: Node  # deepest node to load (its path from ``anchor`` is L2-only)
    path: tuple[Node, ...]  # top-down, below ``anchor``
    anchor: Node | None  # the device hit it continues (pinned on L1 meanwhile)
    num_pages: int  # L1 pages to allocate for it (owned pages)


class Acquired(NamedTuple):
    """Shared-L2 pages locked at the node's service for one request, not yet given L1 pages."""

    anchor: Node | None  # the L1 hit they continue (pinned on L1 until prepared or cancelled)
    first_page: int  # logical page of the request's key the first shared page holds
    host: list[HostPageId]  # the locked shared pages, in order
    hashes: list[PageHash]  # their hashes (what the service's ``release`` takes)
    fetched: int  # of them, pages the service loaded from its L3 for this request
    draft: bool  # their draft rows are valid


class LoadBack(NamedTuple):
    """An L2 hit held for one request by ``plan_load``, not yet given L1 pages.
    Valid until ``prepare_load`` or ``cancel_load`` (exactly one of them)."""

    num_pages: int  # L1 pages the caller must find for it
    end_tokens: int  # where the request's hit ends once it is loaded (whole pages)
    fetched_pages: int  # of ``num_pages``, pages brought from an L3 for this request
    held: LoadRequest | Acquired  # what the strategy pinned (private) or acquired (shared)


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


class StorePlan(NamedTuple):
    """Write L2 pages ``host`` to L3 under ``hashes``."""

    node: Node  # (a layer group's items, ``group >= 0``: None, no node)
    host: list[HostPageId]
    hashes: list[PageHash]  # the L3 keys
    group: int = FULL


class PrefetchPlan(NamedTuple):
    """Read ``hashes`` from L3 into L2 pages ``host`` (a prefix of them may land)."""

    key: bytes  # tokens of the sequence up to the last page asked for
    namespace: str
    first_page: int  # logical index of the first page asked for
    host: list[HostPageId]
    hashes: list[PageHash]
    group: int = FULL
