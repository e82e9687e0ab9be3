"""``RadixTree``'s integrity check (DESIGN.md invariants 1-3 and 5, and the
tree's own counters), kept apart from the tree so the tree reads as its
operations."""
from __future__ import annotations

from typing import TYPE_CHECKING

from hicache.draft import check_node_flags
from hicache.errors import IntegrityError
from hicache.node import Node, TreeCensus

if TYPE_CHECKING:
    from hicache.radix import RadixTree


def check_tree(tree: RadixTree) -> TreeCensus:
    """Check invariants 1-3 and 5 of DESIGN.md and the tree's own bookkeeping;
    return every page id held (the cache checks pool accounting, invariant 4)."""
    pb = tree.page_bytes
    dev: set[int] = set()
    host: set[int] = set()
    nodes = dev_n = host_n = 0

    def bad(n: Node, why: str) -> IntegrityError:
        return IntegrityError(f"radix {n!r}: {why}")

    for ns, r in tree._roots.items():
        if (r.namespace != ns or r.key or r.device_pages != [] or r.host_pages != []
                or not (r.draft_device and r.draft_host)):
            raise bad(r, f"malformed root of namespace {ns!r}")
    for n in tree.iter_nodes():
        p = n.parent
        nodes += 1
        if not n.key or len(n.key) % pb or n.num_pages != len(n.key) // pb:  # invariant 1
            raise bad(n, f"key of {len(n.key)} bytes is not {n.num_pages} whole pages of {pb}")
        if p.children.get(n.key[:pb]) is not n or n.namespace != p.namespace:
            raise bad(n, "not reachable from its parent under its first page")
        if n.start_page != p.start_page + p.num_pages:
            raise bad(n, f"start_page {n.start_page} != parent end {p.start_page + p.num_pages}")
        if n.device_pages is None and n.host_pages is None:
            raise bad(n, "is on neither L1 nor L2")
        if n.device_pages is not None and p.device_pages is None:  # invariant 2
            raise bad(n, "on L1 but its parent is not (L1 not prefix-closed)")
        if n.host_pages is not None and p.host_pages is None:
            raise bad(n, "on L2 but its parent is not (L2 not prefix-closed)")
        if n.lock_ref < sum(c.lock_ref for c in n.children.values()) or \
                n.host_lock_ref < sum(c.host_lock_ref for c in n.children.values()):
            raise bad(n, "lock count below its children's (locks must cover ancestors)")
        if n.lock_ref and n.device_pages is None:  # invariant 3
            raise bad(n, "locked but evicted from L1")
        if n.host_lock_ref and n.host_pages is None:
            raise bad(n, "host-locked but evicted from L2")
        check_node_flags(n)
        want = tree.owned(n.start_page, n.num_pages)  # invariant 5: no page missing on a tier
        for ids, seen, tier in ((n.device_pages, dev, "L1"), (n.host_pages, host, "L2")):
            if ids is None:
                continue
            if len(ids) != want:
                raise bad(n, f"holds {len(ids)} {tier} pages, owns {want}")
            for i in ids:
                if i in seen:
                    raise bad(n, f"{tier} page {i} is held twice in the tree")
                seen.add(i)
        dev_n += len(n.device_pages or ())
        host_n += len(n.host_pages or ())
        if n.hashes is not None and len(n.hashes) != n.num_pages:
            raise bad(n, f"{len(n.hashes)} hashes for {n.num_pages} pages")
    leaves = {n for n in tree.iter_nodes() if tree._device_evictable(n, unlocked=False)}
    held = tree.device_candidates.leaves
    if leaves != held:
        raise IntegrityError(f"L1 leaf set is stale: missing {leaves - held}, extra {held - leaves}")
    if (nodes, dev_n, host_n) != (tree.num_nodes, tree.device_ids_held, tree.host_ids_held):
        raise IntegrityError(f"radix counters (nodes, L1 ids, L2 ids) = "
                             f"{(tree.num_nodes, tree.device_ids_held, tree.host_ids_held)}, "
                             f"counted {(nodes, dev_n, host_n)}")
    return TreeCensus(dev, host, nodes)
