"""Radix index latency: match / insert / evict on two tree shapes.

Shapes (page size 16, random token ids, one namespace):
  a  "system": many independent prompts behind 4 shared 512-token system prompts;
  b  "chat":   multi-turn conversations, 32 turns of prompt_len/32 tokens (256 for an
               8K prompt), with a sibling branch (a regenerated turn) at every turn.

For each (shape, prompt length, cached pages) the tree is filled to the target
size through the real ``PrefixCache``, then:
  match  = ``PrefixCache.match(key)`` of a cached prompt (full hit, precomputed
           bytes key), median over many calls;
  insert = ``RadixTree.insert`` of a new prompt sharing the system prompt (a) /
           a new turn on an existing conversation (b);
  evict  = ``PrefixCache.evict`` (LRU) of the pages that insert added (steady size).
"pages"/"nodes" are the tree's size before the insert/evict cycles.
Medians of --reps repetitions. Usage: python bench/index.py [--quick]
"""
from __future__ import annotations

import argparse
import platform
import statistics
import time

import numpy as np

from hicache.memory.allocator import PageAllocator
from hicache.index.prefix_cache import PrefixCache
from hicache.core.layout import KVLayout

PS = 16


def rand_key(rng: np.random.Generator, n: int) -> bytes:
    return rng.integers(0, 32000, n, dtype=np.uint32).astype("<u4").tobytes()


def make_cache(capacity: int) -> PrefixCache:
    lay = KVLayout("bench", 1, num_kv_heads=1, head_dim=8, page_size=PS)
    return PrefixCache(lay, PageAllocator(capacity, "L1"))


def put(cache: PrefixCache, key: bytes) -> None:
    tree = cache.tree
    ids = cache.device_allocator.alloc(len(key) // (4 * PS))
    res = tree.insert(key, "", ids)
    if res.duplicates:
        cache.device_allocator.free(res.duplicates)


def fill_system(cache, rng, L, target):
    sys_prompts = [rand_key(rng, 512) for _ in range(4)]
    prompts = []
    while cache.tree.device_ids_held + L // PS <= target or not prompts:
        k = sys_prompts[len(prompts) % 4] + rand_key(rng, L - 512)
        put(cache, k)
        prompts.append(k)
    new = [sys_prompts[i % 4] + rand_key(rng, L - 512) for i in range(64)]
    return prompts, new


def fill_chat(cache, rng, L, target):
    turn = L // 32
    convs = []
    while cache.tree.device_ids_held + 2 * L // PS <= target or not convs:
        prefix = b""
        for _ in range(32):
            put(cache, prefix + rand_key(rng, turn))  # the branch: a regenerated turn
            prefix += rand_key(rng, turn)
            put(cache, prefix)
        convs.append(prefix)
    # a new turn on an existing conversation: walks 32 nodes, adds one
    new = [convs[i % len(convs)][:4 * (L - turn)] + rand_key(rng, turn) for i in range(64)]
    return convs, new


def median_us(fn, reps: int, inner: int = 1) -> float:
    out = []
    for _ in range(reps):
        t = time.perf_counter_ns()
        for _ in range(inner):
            fn()
        out.append((time.perf_counter_ns() - t) / inner / 1e3)
    return statistics.median(out)


def bench_one(shape: str, L: int, target: int, reps: int) -> dict | None:
    if 2 * L // PS > target:
        return None
    rng = np.random.default_rng(1)
    cache = make_cache(target + 8 * L // PS)
    prompts, new = (fill_system if shape == "a" else fill_chat)(cache, rng, L, target)
    size, nodes = cache.tree.device_ids_held, cache.tree.num_nodes
    queries = [prompts[i % len(prompts)] for i in range(16)]
    for q in queries:
        assert cache.match(q).device_tokens == L
    it = iter(range(10**9))

    def match():
        cache.match(queries[next(it) % 16])

    t_match = median_us(match, reps, inner=20)
    ins, ev = [], []
    for k in new[:min(len(new), max(8, reps // 50))]:
        ids = cache.device_allocator.alloc(len(k) // (4 * PS))
        t = time.perf_counter_ns()
        res = cache.tree.insert(k, "", ids)
        ins.append((time.perf_counter_ns() - t) / 1e3)
        cache.device_allocator.free(res.duplicates)
        t = time.perf_counter_ns()
        cache.evict(res.new_pages)  # steady state: as many pages out as came in
        ev.append((time.perf_counter_ns() - t) / 1e3)
    return {"shape": shape, "L": L, "pages": size, "nodes": nodes,
            "match": t_match, "insert": statistics.median(ins), "evict": statistics.median(ev)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer sizes and repetitions")
    ap.add_argument("--reps", type=int, default=400)
    a = ap.parse_args()
    lengths = [1024, 8192] if a.quick else [1024, 8192, 32768]
    sizes = [1000, 10000] if a.quick else [1000, 10000, 100000]
    reps = 50 if a.quick else a.reps
    print(f"# {platform.processor() or platform.machine()}, python {platform.python_version()}, "
          f"page_size={PS}, median of {reps}x20 match calls")
    print(f"{'shape':<7}{'prompt':>7}{'pages':>8}{'nodes':>7}{'match us':>10}{'insert us':>11}{'evict us':>10}")
    for shape in ("a", "b"):
        for L in lengths:
            for target in sizes:
                r = bench_one(shape, L, target, reps)
                if r is None:
                    continue
                print(f"{r['shape']:<7}{r['L']:>7}{r['pages']:>8}{r['nodes']:>7}{r['match']:>10.2f}"
                      f"{r['insert']:>11.1f}{r['evict']:>10.1f}", flush=True)


if __name__ == "__main__":
    main()
