"""What the boundary record's prefix check costs (``hicache.cache.hybrid_record``).

``HybridCache.sweep`` checks, after pages left a tier of the index, whether each
recorded boundary's full-attention prefix is still held: a walk up the index
from the boundary's anchor node. This times that check on the real classes
(``BoundaryRecord`` over ``Node`` objects of a radix-tree path, every boundary
anchored at its own node, none stale) for a full check (``limit=None``: what
``evict`` runs) and for one admission's budget (``SWEEP_BATCH``). Medians of
``--repeat`` runs; wall time, so the box's load shows.

    python bench/hybrid_record.py [--boundaries 1024 4096 16384] [--repeat 9]
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

from hicache.cache.hybrid_record import SWEEP_BATCH, BoundaryRecord
from hicache.index.node import Node
from hicache.core.types import PageHash

PAGE_SIZE = 16


def build(n: int) -> BoundaryRecord:
    """``n`` boundaries, one per page of one cached path of ``n`` single-page nodes."""
    rec = BoundaryRecord(n, PAGE_SIZE)
    parent = Node(b"", 0, 0, None, "", 0)
    for i in range(n):
        key = os.urandom(4 * PAGE_SIZE)
        node = Node(key, 1, i, parent, "", i + 1)
        parent.children[key] = node
        parent = node
        rec.add(PageHash(os.urandom(16)), i + 1, node)
    return rec


def time_check(rec: BoundaryRecord, limit: int | None, repeat: int) -> float:
    """Median seconds of one ``stale`` call right after the index changed."""
    out = []
    for _ in range(repeat):
        t = time.perf_counter()
        stale = rec.stale({}, None, index_changed=True, l3=False, limit=limit)
        out.append(time.perf_counter() - t)
        assert not stale, "the bench's boundaries are all held"
    return statistics.median(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--boundaries", type=int, nargs="+", default=[1024, 4096, 16384])
    ap.add_argument("--repeat", type=int, default=9)
    args = ap.parse_args()
    print(f"{'boundaries':>10} {'full check ms':>14} {'us/boundary':>12} {f'batch of {SWEEP_BATCH} ms':>16}")
    for n in args.boundaries:
        rec = build(n)
        full = time_check(rec, None, args.repeat)
        batch = time_check(rec, SWEEP_BATCH, args.repeat)
        print(f"{n:>10} {full * 1e3:>14.2f} {full / n * 1e6:>12.2f} {batch * 1e3:>16.3f}")


if __name__ == "__main__":
    main()
