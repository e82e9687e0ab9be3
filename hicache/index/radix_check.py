"""``RadixTree``'s integrity check (DESIGN.md invariants 1-3 and 5, and the
tree's own counters), kept apart from the tree so the tree reads as its
operations."""
from __future__ import annotations

from typing import Callable, Mapping, NamedTuple, Sequence

from hicache.index.node import check_node_flags
from hicache.core.errors import IntegrityError
from hicache.index.node import Node, TreeCensus


class TreeFacts(NamedTuple):
    """What ``RadixTree.check_integrity`` hands the check (the check never imports the tree)."""

    roots: Mapping[str, Node]  # namespace -> its root
    nodes: Sequence[Node]  # every non-root node, parents first
    page_bytes: int
    owned: Callable[[int, int], int]  # (start_page, num_pages) -> pages this CP rank owns
    device_leaves: set[Node]  # nodes that are L1 eviction leaves now (recomputed)
    held_leaves: set[Node]  # the leaf set the tree maintains
    counters: tuple[int, int, int]  # the tree's (nodes, L1 ids held, L2 ids held)


def check_tree(tree: TreeFacts) -> TreeCensus:
    """Check invariants 1-3 and 5 of DESIGN.md and the tree's own bookkeeping;
    return every page id held (the cache checks pool accounting, invariant 4)."""
    dev: set[int] = set()
    host: set[int] = set()
    for ns, r in tree.roots.items():
        if (r.namespace != ns or r.key or r.device_pages != [] or r.host_pages != []
                or not (r.draft_device and r.draft_host)):
            raise _bad(r, f"malformed root of namespace {ns!r}")
    for n in tree.nodes:
        _check_node(n, tree.page_bytes, tree.owned, dev, host)
    leaves, held = tree.device_leaves, tree.held_leaves
    if leaves != held:
        raise IntegrityError(f"L1 leaf set is stale: missing {leaves - held}, extra {held - leaves}")
    counted = (len(tree.nodes), len(dev), len(host))
    if counted != tree.counters:
        raise IntegrityError(f"radix counters (nodes, L1 ids, L2 ids) = {tree.counters}, counted {counted}")
    return TreeCensus(dev, host, len(tree.nodes))


def _bad(n: Node, why: str) -> IntegrityError:
    return IntegrityError(f"radix {n!r}: {why}")


def _check_node(n: Node, pb: int, owned: Callable[[int, int], int], dev: set[int], host: set[int]) -> None:
    """One node's invariants; adds its page ids to ``dev`` / ``host`` (each id once)."""
    p = n.parent
    if not n.key or len(n.key) % pb or n.num_pages != len(n.key) // pb:  # invariant 1
        raise _bad(n, f"key of {len(n.key)} bytes is not {n.num_pages} whole pages of {pb}")
    if p.children.get(n.key[:pb]) is not n or n.namespace != p.namespace:
        raise _bad(n, "not reachable from its parent under its first page")
    if n.start_page != p.start_page + p.num_pages:
        raise _bad(n, f"start_page {n.start_page} != parent end {p.start_page + p.num_pages}")
    if n.device_pages is None and n.host_pages is None:
        raise _bad(n, "is on neither L1 nor L2")
    if n.device_pages is not None and p.device_pages is None:  # invariant 2
        raise _bad(n, "on L1 but its parent is not (L1 not prefix-closed)")
    if n.host_pages is not None and p.host_pages is None:
        raise _bad(n, "on L2 but its parent is not (L2 not prefix-closed)")
    if n.lock_ref < sum(c.lock_ref for c in n.children.values()) or \
            n.host_lock_ref < sum(c.host_lock_ref for c in n.children.values()):
        raise _bad(n, "lock count below its children's (locks must cover ancestors)")
    if n.lock_ref and n.device_pages is None:  # invariant 3
        raise _bad(n, "locked but evicted from L1")
    if n.host_lock_ref and n.host_pages is None:
        raise _bad(n, "host-locked but evicted from L2")
    check_node_flags(n)
    want = owned(n.start_page, n.num_pages)  # invariant 5: no page missing on a tier
    for ids, seen, tier in ((n.device_pages, dev, "L1"), (n.host_pages, host, "L2")):
        if ids is None:
            continue
        if len(ids) != want:
            raise _bad(n, f"holds {len(ids)} {tier} pages, owns {want}")
        for i in ids:
            if i in seen:
                raise _bad(n, f"{tier} page {i} is held twice in the tree")
            seen.add(i)
    if n.hashes is not None and len(n.hashes) != n.num_pages:
        raise _bad(n, f"{len(n.hashes)} hashes for {n.num_pages} pages")
