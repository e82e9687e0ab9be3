"""Host time of replaying the layer-wise load back's CUDA graph, and what it is made of.

    PYTHONPATH=. python3 bench/graph_launch.py [--layers 32] [--reps 200]

An admission's host time is mostly the replay of ``hicache.load_graph.LoadGraph``
(one page-copy kernel and one external event per layer). This captures the same
copies several ways on the 8B-shaped pools (page 16, ``page_first``, 512 pages)
and prints the median host time of ``CUDAGraph.replay()`` for each, the GPU idle
between replays (synchronised, not timed):

* the production graph: one kernel per layer, each followed by an external event;
* the same kernels without the events;
* the events alone;
* one kernel over every plane, then one event.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from hicache.kernels.page_copy import default_copier
from hicache.layout import KVLayout
from hicache.load_graph import LoadGraph
from hicache.pools import DevicePool, HostPool
from hicache.transfer import layer_plane_groups


def capture(fn) -> torch.cuda.CUDAGraph:
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()  # compile / plan outside the capture
    side.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=side, capture_error_mode="thread_local"):
        fn()
    return g


def host_us(fn, reps: int) -> float:
    ts = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    torch.cuda.synchronize()
    return 1e6 * statistics.median(ts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--reps", type=int, default=200)
    a = ap.parse_args()
    lay = KVLayout("bench-graph", num_layers=a.layers, num_kv_heads=8, head_dim=128, dtype="bfloat16",
                   page_size=16, host_layout="page_first")
    n = 512
    dev, host = DevicePool(lay, n + 16, device="cuda"), HostPool(lay, n + 16, pin=True)
    groups = layer_plane_groups(lay)
    lg = LoadGraph(host, dev, groups)
    count, src, dst = lg._buf[0:1], lg._buf[1:1 + lg.capacity], lg._buf[1 + lg.capacity:]
    copier = default_copier()
    ids = list(range(n))
    lg.launch(ids, ids, torch.cuda.current_stream())
    torch.cuda.synchronize()

    def kernels(with_events: bool):
        evs = [torch.cuda.Event(external=True) for _ in groups] if with_events else []

        def fn():
            for k, planes in enumerate(groups):
                if planes:
                    copier.copy_pages(host, dev, src, dst, planes=planes, count=count)
                if with_events:
                    evs[k].record()
        return fn

    events = [torch.cuda.Event(external=True) for _ in groups]
    one_ev = torch.cuda.Event(external=True)
    every = [p for g in groups for p in g]

    def one_kernel():
        copier.copy_pages(host, dev, src, dst, planes=every, count=count)
        one_ev.record()

    variants = {
        f"production: {len(groups)} kernels + {len(groups)} external events": lg.graph,
        f"{len(groups)} kernels, no events": capture(kernels(False)),
        f"{len(groups)} external events, no kernels": capture(lambda: [e.record() for e in events]),
        "1 kernel over every plane + 1 event": capture(one_kernel),
    }
    print(f"# CUDA-graph replay host time, {torch.cuda.get_device_name()}, torch {torch.__version__}, "
          f"{a.layers} layers, median of {a.reps}")
    print("| graph | replay() host us |\n|---|---:|")
    for name, g in variants.items():
        print(f"| {name} | {host_us(g.replay, a.reps):.1f} |")
    print(f"| LoadGraph.launch (upload + production replay) | "
          f"{host_us(lambda: lg.launch(ids, ids, torch.cuda.current_stream()), a.reps):.1f} |")
    stage = lg._stage[0]
    k = 1 + lg.capacity + n

    def upload():
        lg._buf[:k].copy_(stage[:k], non_blocking=True)
    print(f"| the id upload alone (one pinned copy) | {host_us(upload, a.reps):.1f} |")
    for name, g in variants.items():
        print(f"| upload, then replay of: {name} | {host_us(lambda g=g: (upload(), g.replay()), a.reps):.1f} |")
    arr = lg._stage_np[1]
    print(f"| ids from Python lists into the staging array | "
          f"{host_us(lambda: (arr.__setitem__(slice(1, 1 + n), ids), arr.__setitem__(slice(1 + lg.capacity, k), ids)), a.reps):.1f} |")
    ev = torch.cuda.Event()
    print(f"| Event.record() | {host_us(ev.record, a.reps):.1f} |")
    s = torch.cuda.Stream()
    print(f"| Stream.wait_event() | {host_us(lambda: s.wait_event(ev), a.reps):.1f} |")


if __name__ == "__main__":
    main()
