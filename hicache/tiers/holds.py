"""What ``plan_load`` holds for one request (``hicache.tiers.l2``): an L2 hit pinned
(private) or acquired (shared), not yet given L1 pages. Valid from ``plan_load``
until ``prepare_load`` or ``cancel_load`` (exactly one of them). Scheduler-only:
the transfer engine never sees these."""
from __future__ import annotations

from typing import NamedTuple

from hicache.core.types import HostPageId, PageHash
from hicache.index.node import Node


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
