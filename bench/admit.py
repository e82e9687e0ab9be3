"""Host time of ``HiCache.admit`` for an 8K-token L2 hit, and where it goes.

    PYTHONPATH=. python bench/admit.py [--tokens 8192] [--layers 32] [--reps 50] [--profile] [--no-gc]

No model: the pools of an 8B-shaped layout (32 layers x 8 KV heads x 128 dims,
bf16, page 16, ``page_first``), a prompt cached on L2 only, then admitted
(match, lock, start the layer-wise load back) ``--reps`` times, each followed
by waiting for the load and dropping L1 again. Prints the median admission
with the CUDA-graph load back and with one launch per layer (same process,
interleaved), and with ``--profile`` the functions that take the host time.
Runs on the CPU too (the load back is then a worker thread's job).
``--no-gc``: collect garbage before each admission and keep the collector off
during it, and print the minimum and first quartile too (on a loaded machine a
collection inside the timed region decides the median).
"""
from __future__ import annotations

import argparse
import cProfile
import gc
import io
import pstats
import random
import statistics
import time

import torch

from hicache.core.config import HiCacheConfig
from hicache.cache.hicache import HiCache
from hicache.core.layout import KVLayout
from hicache.transfer.load_graph import LoadGraph
from hicache.transfer.engine import layer_plane_groups


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--profile", action="store_true", help="then profile 20 more graph admissions")
    ap.add_argument("--no-gc", action="store_true", help="collector out of the timed region; also min and p25")
    ap.add_argument("--idle-ms", type=float, default=0.0,
                    help="sleep before each admission (a host that idled runs it slower: clocks, caches)")
    a = ap.parse_args()
    gpu = torch.cuda.is_available()
    heads, dim = (8, 128) if gpu else (1, 8)  # on the CPU only the host side matters
    lay = KVLayout("bench-admit", num_layers=a.layers, num_kv_heads=heads, head_dim=dim, dtype="bfloat16",
                   page_size=16, host_layout="page_first")
    pages = a.tokens // 16 + 16
    cfg = HiCacheConfig.load(env={}, overrides={"storage.url": "", "pool.device": "cuda:0" if gpu else "cpu",
                                                "pool.device_pages": str(pages), "pool.host_pages": str(pages)})
    hc = HiCache(cfg, layout=lay)
    prompt = [random.randrange(1, 32000) for _ in range(a.tokens)]
    req = hc.new_request("fill", prompt)
    hc.admit(req)
    req.alloc(len(prompt))
    req.commit()
    req.finish()
    hc.drain()
    # graph: the CUDA-graph load back as configured (per-layer flags where the driver has stream
    # memory operations); graph-events: the same with an event node after each layer's kernel;
    # launches: one launch per layer.
    modes = ("graph", "graph-events", "launches") if gpu else ("graph",)
    graph_of: dict[str, object] = {}
    if gpu:
        graph_of["graph"] = hc.transfers._load_graph()
        graph_of["graph-events"] = LoadGraph(hc.host_pool, hc.device_pool, layer_plane_groups(lay),
                                             completion="events")
    times: dict[str, list[float]] = {m: [] for m in modes}
    prof = cProfile.Profile()
    profiled = 20 if a.profile else 0
    for i in range(a.reps + 2 + profiled):
        for mode in modes:
            graphs = mode != "launches"
            if i >= a.reps + 2 and mode != "graph":
                continue
            hc.evict(10**9)
            hc.transfers._graphs = graphs and gpu
            hc.transfers._graph = graph_of.get(mode)
            r = hc.new_request(f"r{i}{mode}", prompt)
            if gpu:
                torch.cuda.synchronize()
            if a.idle_ms:
                time.sleep(a.idle_ms / 1e3)
            if i >= a.reps + 2:
                prof.enable()
            if a.no_gc:
                gc.collect()
                gc.disable()
            t0 = time.perf_counter()
            adm = hc.admit(r)
            dt = time.perf_counter() - t0
            gc.enable()
            prof.disable()
            assert adm.host_tokens == (a.tokens - 1) // 16 * 16, adm
            if 2 <= i < a.reps + 2:  # after warm-up (capture, plans, allocator); not profiled
                times[mode].append(dt)
            adm.wait()
            r.finish()
            hc.drain()
    hc.check_integrity()
    where = torch.cuda.get_device_name() if gpu else "CPU"
    print(f"# admission of a {a.tokens}-token L2 hit ({(a.tokens - 1) // 16} pages, {a.layers} layers), {where}, "
          f"{a.reps} reps, idle before each {a.idle_ms:g} ms")
    what = {"graph": f"CUDA-graph load back ({graph_of['graph'].completion if gpu else 'CPU'})",
            "graph-events": "CUDA-graph load back (events)", "launches": "launching per layer"}
    print("median host time: " + ", ".join(f"{statistics.median(times[m]) * 1e3:.3f} ms {what[m]}" for m in modes))
    if a.no_gc:
        print("min / p25 host time: " + ", ".join(
            f"{min(times[m]) * 1e3:.3f} / {statistics.quantiles(times[m], n=4)[0] * 1e3:.3f} ms {what[m]}" for m in modes))
    if a.profile:
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(25)
        print(out.getvalue())
    hc.close()


if __name__ == "__main__":
    main()
