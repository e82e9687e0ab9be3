"""Draft-plane completeness (layouts with ``draft_layers``), in one place.

A page is complete only when its draft rows are valid too, and an engine that
does not run its draft head computes pages without them. ``Node.draft_device``
/ ``Node.draft_host`` record, per node and tier, that the draft planes of
every page hold valid rows. ``RadixTree.match(..., need_draft=True)`` stops at
the first node whose serving tier lacks them (``Hit.draft_cut``, a ``DraftCut``, names the
tier), so a hit never returns target planes without their
draft planes (invariant 5). Who copies draft planes when a request supplies
the rows a cached page lacked is the caller's business
(``InsertResult.draft_copies``); this module only reads flags.
"""
from __future__ import annotations

from typing import Sequence

from hicache.core.errors import IntegrityError
from hicache.index.node import Node



def draft_prefix_pages(path: Sequence[Node]) -> int:
    """Logical pages from 0 whose L1 draft planes are complete along ``path``
    (the nodes from just below a root down to some node, top-down)."""
    for n in path:
        if not n.draft_device:
            return n.start_page
    return path[-1].start_page + path[-1].num_pages if path else 0


def check_node_flags(n: Node) -> None:
    """Invariant 5 (draft half): a draft flag only on a tier the node is on. (What
    a request holds is checked by ``PrefixCache``; L3 is written only from
    ``draft_host`` copies.) Raises ``IntegrityError``."""
    if n.draft_device and n.device_pages is None:
        raise IntegrityError(f"radix {n!r}: draft_device set but the node is not on L1")
    if n.draft_host and n.host_pages is None:
        raise IntegrityError(f"radix {n!r}: draft_host set but the node is not on L2")


def check_request_pages(path: Sequence[Node], draft_pages: int, who: object) -> None:
    """A draft request uses no shared page (of the first ``draft_pages`` it
    vouched for) whose L1 draft planes are incomplete. Raises ``IntegrityError``."""
    for n in path:
        if n.start_page < draft_pages and not n.draft_device:
            raise IntegrityError(f"{who!r}: uses {n!r} whose L1 draft planes are incomplete "
                                 f"(its draft rows are valid up to page {draft_pages})")
