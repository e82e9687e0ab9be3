"""The index's records: ``Node`` (one edge of the radix tree) and the small
typed results tree operations return (``Hit``, ``InsertResult``, ``Dropped``,
``TreeCensus``), and draft-plane completeness read from their flags (``draft_*``).
Plain data: only ``hicache.index.radix.RadixTree`` mutates nodes."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import cast, NamedTuple, Sequence

import numpy as np

from hicache.core.errors import IntegrityError
from hicache.core.types import DevicePageId, HostPageId, PageHash


@dataclass(slots=True, eq=False)
class Node:
    """One edge of the tree. Identity-hashed; fields are mutated only by ``RadixTree``."""

    key: bytes  # token ids of the edge, uint32 LE, a whole number of pages
    num_pages: int  # logical pages on the edge
    start_page: int  # logical index of the edge's first page in its sequence
    parent: "Node | None"  # None only for a namespace root
    namespace: str
    nid: int  # creation order; final tie-break of every eviction policy
    children: dict[bytes, "Node"] = field(default_factory=dict)  # first page bytes -> child
    device_pages: list[DevicePageId] | None = None  # owned L1 page ids; None = not on L1
    host_pages: list[HostPageId] | None = None  # owned L2 page ids; None = not on L2
    hashes: list[PageHash] | None = None  # chained page hashes, computed lazily
    in_storage: bool = False  # L3 holds every page of the edge
    lock_ref: int = 0  # holders of this node or a descendant on L1 (pins L1)
    host_lock_ref: int = 0  # holders of this node or a descendant on L2 (pins L2)
    last_access: int = 0  # tree clock at the last lock/insert
    hit_count: int = 0  # times a request locked this node or a descendant
    wait_ref: int = 0  # waiting requests (arrived, not admitted) whose cached prefix runs through here
    draft_device: bool = False  # every page's draft rows are valid on L1 (False when not on L1)
    draft_host: bool = False  # ... on L2 (False when not on L2)

    @property
    def tokens(self) -> list[int]:
        """Token ids of the edge (a copy)."""
        return cast(list[int], np.frombuffer(self.key, dtype="<u4").tolist())

    def __repr__(self) -> str:
        return (f"Node(nid={self.nid}, pages=[{self.start_page}, {self.start_page + self.num_pages}), "
                f"dev={self.device_pages}, host={self.host_pages}, lock={self.lock_ref}, "
                f"hlock={self.host_lock_ref})")


class DraftCut(enum.IntEnum):
    """Where ``need_draft`` stopped a hit: the first page whose serving tier lacks
    valid draft rows (``NONE``, falsy: the hit was not cut)."""

    NONE = 0
    L1 = 1  # draft planes missing on L1
    L2 = 2  # draft planes missing on L2

    @property
    def reason(self) -> str:
        return "" if self is DraftCut.NONE else f"draft planes missing on {self.name}"


class Hit(NamedTuple):
    """A prefix lookup: counts and end nodes; ids come from ``pages`` on demand."""

    device_num_pages: int  # logical pages hit on L1
    host_num_pages: int  # logical pages hit on L2 after the device hit
    device_node: "Node | None"  # node holding the last device-hit page (root if none; None: no root)
    host_node: "Node | None"  # node holding the last host-hit page (== device_node if none)
    draft_cut: DraftCut = DraftCut.NONE  # where need_draft stopped the hit



class InsertResult(NamedTuple):
    """What ``RadixTree.insert`` did; the caller acts on it (backs up ``created``,
    copies ``draft_copies``, then frees ``duplicates``)."""

    node: Node  # the node holding the key's last page
    pages: list[DevicePageId]  # the tree's owned L1 ids for the whole key (use these from now on)
    duplicates: list[DevicePageId]  # caller's ids the tree did not take (already cached): free them
    new_pages: int  # logical pages that were not in the tree before
    # (caller id, tree id): the tree's page lacked valid draft rows, the caller's has
    # them: copy the caller's draft planes onto the tree's page BEFORE freeing duplicates
    draft_copies: tuple[tuple[DevicePageId, DevicePageId], ...] = ()
    created: tuple[Node, ...] = ()  # nodes that got L1 pages by this insert (new keys), top-down


class Dropped(NamedTuple):
    """What a drop took off one tier: the freed ids (the caller returns them to
    their allocator) and the logical pages evicted."""

    freed: list[int]  # DevicePageId for L1, HostPageId for L2
    pages: int


class TreeCensus(NamedTuple):
    """What ``check_integrity`` counted: every page id the tree holds."""

    device_ids: set[DevicePageId]
    host_ids: set[HostPageId]
    nodes: int


# ---- Draft-plane completeness. A page is complete only when its draft rows are valid too, and an engine that
# does not run its draft head computes pages without them. ``Node.draft_device``
# / ``Node.draft_host`` record, per node and tier, that the draft planes of
# every page hold valid rows. ``RadixTree.match(..., need_draft=True)`` stops at
# the first node whose serving tier lacks them (``Hit.draft_cut``, a ``DraftCut``, names the
# tier), so a hit never returns target planes without their
# draft planes (invariant 5). Who copies draft planes when a request supplies
# the rows a cached page lacked is the caller's business
# (``InsertResult.draft_copies``); this module only reads flags.


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
