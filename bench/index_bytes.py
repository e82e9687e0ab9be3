"""Bytes per page of the radix index at millions of pages, and where they go.

Builds a ``RadixTree`` of ``--pages`` L1 pages from sequences of
``--pages-per-seq`` pages that share a prefix of ``--shared`` pages with an
earlier sequence (a conversation's next turn), measures the resident-memory
growth (RSS, /proc/self/statm) and splits it by what a node holds:

- the edge's token bytes (``4 * page_size`` a page: the index matches on them);
- the L1 page-id list (8 bytes a slot + a 32-byte int object per id above 256);
- the Node object, its children dict, and the child's entry in its parent's dict.

    python bench/index_bytes.py --pages 5000000 --page-size 16
    python bench/index_bytes.py --pages 5000000 --page-size 512 --pages-per-seq 32
"""
from __future__ import annotations

import argparse
import gc
import os
import sys
import time

import numpy as np

from hicache.index.node import Node
from hicache.index.radix import RadixTree


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def build(pages: int, ps: int, per_seq: int, shared: int) -> tuple[RadixTree, float]:
    tree = RadixTree(ps)
    rng = np.random.default_rng(0)
    seqs: list[bytes] = []
    next_id = 0
    t0 = time.perf_counter()
    while next_id < pages:
        fresh = rng.integers(0, 2**32, per_seq * ps, dtype=np.uint32).astype("<u4").tobytes()
        if seqs and shared:
            parent = seqs[int(rng.integers(len(seqs)))]
            key = parent[:shared * ps * 4] + fresh[shared * ps * 4:]
        else:
            key = fresh
        n = len(key) // (4 * ps)
        r = tree.insert(key, "", list(range(next_id, next_id + n)))
        next_id += r.new_pages  # ids the tree did not take are simply not used again
        if len(seqs) < 4096:
            seqs.append(key)
    return tree, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pages", type=int, default=5_000_000)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--pages-per-seq", type=int, default=64)
    ap.add_argument("--shared", type=int, default=16, help="pages each sequence shares with an earlier one")
    a = ap.parse_args()
    gc.collect()
    before = rss()
    tree, secs = build(a.pages, a.page_size, a.pages_per_seq, a.shared)
    gc.collect()
    grown = rss() - before
    held = tree.device_ids_held
    nodes = tree.num_nodes
    node_obj = sys.getsizeof(Node(b"", 0, 0, None, "", 0))
    dict_obj = sys.getsizeof({})
    parts = {
        "token bytes (4 x page_size)": 4 * a.page_size + sys.getsizeof(b"") * nodes / held,
        "L1 id lists (slot + int object)": 8 + 32 * max(0.0, 1 - 257 / held) + 56 * nodes / held,
        "Node object + children dict + parent's entry": (node_obj + dict_obj + 100) * nodes / held,
    }
    print(f"radix index: {held:,} pages in {nodes:,} nodes ({held / nodes:.1f} pages a node), page_size "
          f"{a.page_size}, built in {secs:.1f}s (the samples of --shared reused a 4096-sequence pool)")
    print(f"{'part':<48} {'bytes/page':>10}")
    for k, v in parts.items():
        print(f"{k:<48} {v:>10.1f}")
    print(f"{'estimated total':<48} {sum(parts.values()):>10.1f}")
    print(f"{'measured (RSS growth / pages)':<48} {grown / held:>10.1f}")


if __name__ == "__main__":
    main()
