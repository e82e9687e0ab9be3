"""Prefix match from the engine's own input: a Python list or a numpy array of token ids.

Same trees as ``bench/index.py`` (page 16; a = prompts behind 4 shared 512-token
system prompts, b = 32-turn conversations with a branch per turn), filled to
about 100K cached pages. A full hit of a cached prompt is matched, median of
many calls, with the conversion and range check counted:

  hicache list   ``PrefixCache.match(list_of_ints)``
  hicache numpy  ``PrefixCache.match(np.ndarray int64)`` (what a tokenizer returns)
  hicache array_q ``PrefixCache.match(array('q'))`` (SGLang's per-request buffer type)
  hicache bytes  ``PrefixCache.match(bytes)`` (no conversion: the index alone)
  convert only   ``tokens_to_bytes(list)``
  sglang list    SGLang 0.5.23 ``RadixCache.match_prefix`` given the same list, in the
                 same process, its tree filled with the same prompts (when importable:
                 see ``bench/sglang_import.py``)
  sglang array   the same with ``array('q')`` token ids, what SGLang's own scheduler
                 keeps per request (tree and query both array('q'); no conversion)

    HICACHE_BENCH_SGLANG=/path/to/sglang-site PYTHONPATH=. python bench/index_list.py
"""
from __future__ import annotations

import argparse
import os
import platform
import sys
from array import array

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import sglang_import  # noqa: E402
from index import PS, fill_chat, fill_system, make_cache, median_us  # noqa: E402

from hicache.core.hashing import tokens_to_bytes  # noqa: E402


def sglang_tree(api, prompts: list):
    RadixCache, RadixKey, MatchPrefixParams, InsertParams = api
    tree = RadixCache.create_simulated(page_size=PS)
    for p in prompts:
        tree.insert(InsertParams(key=RadixKey(p)))
    return tree


def run(shape: str, L: int, target: int, reps: int, api) -> dict:
    rng = np.random.default_rng(1)
    cache = make_cache(target + 8 * L // PS)
    prompts, _ = (fill_system if shape == "a" else fill_chat)(cache, rng, L, target)
    keys = [prompts[i % len(prompts)] for i in range(16)]
    lists = [np.frombuffer(k, dtype="<u4").tolist() for k in keys]
    arrays = [np.array(x, dtype=np.int64) for x in lists]
    for k, x, a in zip(keys, lists, arrays):
        assert cache.match(k).device_tokens == cache.match(x).device_tokens == cache.match(a).device_tokens == L
    out = {"shape": shape, "L": L, "pages": cache.tree.device_ids_held, "nodes": cache.tree.num_nodes}

    def cycle(xs):
        it = iter(range(10**9))
        return lambda: xs[next(it) % 16]

    qarrs = [array("q", x) for x in lists]
    for name, xs in (("list", lists), ("numpy", arrays), ("array_q", qarrs), ("bytes", keys)):
        nxt = cycle(xs)
        out[name] = median_us(lambda: cache.match(nxt()), reps, inner=20)
    nxt = cycle(lists)
    out["convert"] = median_us(lambda: tokens_to_bytes(nxt()), reps, inner=20)
    if api is not None:
        all_lists = [np.frombuffer(k, dtype="<u4").tolist() for k in prompts]
        tree = sglang_tree(api, all_lists)
        RadixKey, MatchPrefixParams = api[1], api[2]
        for x in lists:
            assert tree.match_prefix(MatchPrefixParams(key=RadixKey(x))).device_prefix_len == L
        nxt = cycle(lists)
        out["sglang"] = median_us(lambda: tree.match_prefix(MatchPrefixParams(key=RadixKey(nxt()))), reps, inner=20)
        del tree
        tree = sglang_tree(api, [array("q", x) for x in all_lists])
        qs = [array("q", x) for x in lists]
        assert tree.match_prefix(MatchPrefixParams(key=RadixKey(qs[0]))).device_prefix_len == L
        nxt = cycle(qs)
        out["sglang_q"] = median_us(lambda: tree.match_prefix(MatchPrefixParams(key=RadixKey(nxt()))), reps, inner=20)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--pages", type=int, default=100000)
    ap.add_argument("--lengths", default="8192")
    a = ap.parse_args()
    api = sglang_import.load()
    print(f"# {platform.processor() or platform.machine()}, python {platform.python_version()}, page_size={PS}, "
          f"median of {a.reps}x20 calls; sglang {'in process' if api else 'not importable (column omitted)'}")
    cols = ["list", "numpy", "array_q", "bytes", "convert"] + (["sglang", "sglang_q"] if api else [])
    print("| shape | prompt | pages | nodes | " + " | ".join(f"{c} us" for c in cols)
          + (" | sglang list / hicache list | sglang array / hicache list |" if api else " |"))
    print("|---|---:|---:|---:|" + "---:|" * (len(cols) + (2 if api else 0)))
    for shape in ("a", "b"):
        for L in (int(x) for x in a.lengths.split(",")):
            r = run(shape, L, a.pages, a.reps, api)
            cells = " | ".join(f"{r[c]:.1f}" for c in cols)
            ratio = f" | {r['sglang'] / r['list']:.2f}x | {r['sglang_q'] / r['list']:.2f}x |" if api else " |"
            print(f"| {shape} | {L} | {r['pages']} | {r['nodes']} | {cells}{ratio}", flush=True)


if __name__ == "__main__":
    main()
