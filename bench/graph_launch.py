"""Host time of replaying the layer-wise load back's CUDA graph, and what it is made of.

    PYTHONPATH=. python3 bench/graph_launch.py [--layers 32] [--reps 200]

An admission's host time is mostly the replay of ``hicache.transfer.load_graph.LoadGraph``
(one page-copy kernel and one external event per layer). This captures the same
copies several ways on the 8B-shaped pools (page 16, ``page_first``, 512 pages)
and prints the median host time of ``CUDAGraph.replay()`` for each, the GPU idle
between replays (synchronised, not timed):

* the default graph: one kernel per layer, each writing its layer's flag;
* one kernel per layer, each followed by an external event (where flags do not work);
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
from hicache.core.layout import KVLayout
from hicache.transfer.load_graph import LoadGraph
from hicache.memory.pools import DevicePool, HostPool
from hicache.transfer.engine import layer_plane_groups


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


def launch_steps(g: LoadGraph, ids: list[int], reps: int) -> dict[str, float]:
    """``LoadGraph.launch``'s steps, timed one by one (the same calls, in order)."""
    from hicache.transfer.load_graph import LayerFlag, _HEAD
    stream, cap, n = torch.cuda.current_stream(), g.capacity, len(ids)
    out: dict[str, list[float]] = {}
    for r in range(reps):
        torch.cuda.synchronize()
        t = [time.perf_counter()]
        i = g._next
        g._next = (i + 1) % len(g._stage)
        done = g._stage_done[i]
        assert done is None or done.query()
        t.append(time.perf_counter())
        stage, arr = g._stage[i], g._stage_np[i]
        g._epoch += 1
        arr[0], arr[1] = n, g._epoch
        arr[_HEAD:_HEAD + n] = ids
        arr[_HEAD + cap:_HEAD + cap + n] = ids
        t.append(time.perf_counter())
        with torch.cuda.stream(stream):
            t.append(time.perf_counter())
            g._buf[:_HEAD + cap + n].copy_(stage[:_HEAD + cap + n], non_blocking=True)
            t.append(time.perf_counter())
            ev = g._stage_done[i] = torch.cuda.Event()
            ev.record(stream)
            t.append(time.perf_counter())
            g.graph.replay()
            t.append(time.perf_counter())
        t.append(time.perf_counter())
        [LayerFlag(g, k, g._epoch) for k in g._owner]
        t.append(time.perf_counter())
        for name, a, b in (("ring query", 0, 1), ("fill ids", 1, 2), ("stream ctx enter", 2, 3), ("upload", 3, 4),
                           ("new event + record", 4, 5), ("replay", 5, 6), ("ctx exit", 6, 7), ("flags list", 7, 8)):
            out.setdefault(name, []).append(1e6 * (t[b] - t[a]))
    torch.cuda.synchronize()
    return {k: statistics.median(v) for k, v in out.items()}


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
    lg = LoadGraph(host, dev, groups, completion="events")
    flags = LoadGraph(host, dev, groups)  # the default where stream memory operations work
    head = 2  # [count, epoch] ahead of the ids
    count, src, dst = lg._buf[0:1], lg._buf[head:head + lg.capacity], lg._buf[head + lg.capacity:]
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
        f"completion by flags ({flags.completion}): {len(groups)} kernels": flags.graph,
        f"completion by events: {len(groups)} kernels + {len(groups)} external events": lg.graph,
        f"{len(groups)} kernels, no events": capture(kernels(False)),
        f"{len(groups)} external events, no kernels": capture(lambda: [e.record() for e in events]),
        "1 kernel over every plane + 1 event": capture(one_kernel),
    }
    print(f"# CUDA-graph replay host time, {torch.cuda.get_device_name()}, torch {torch.__version__}, "
          f"{a.layers} layers, median of {a.reps}")
    print("| graph | replay() host us |\n|---|---:|")
    for name, g in variants.items():
        print(f"| {name} | {host_us(g.replay, a.reps):.1f} |")
    for g in (flags, lg):
        print(f"| LoadGraph.launch, completion by {g.completion} (upload + replay) | "
              f"{host_us(lambda g=g: g.launch(ids, ids, torch.cuda.current_stream()), a.reps):.1f} |")
    stage = lg._stage[0]
    k = head + lg.capacity + n

    def upload():
        lg._buf[:k].copy_(stage[:k], non_blocking=True)
    print(f"| the id upload alone (one pinned copy) | {host_us(upload, a.reps):.1f} |")
    for name, g in variants.items():
        print(f"| upload, then replay of: {name} | {host_us(lambda g=g: (upload(), g.replay()), a.reps):.1f} |")
    arr = lg._stage_np[1]
    print(f"| ids from Python lists into the staging array | "
          f"{host_us(lambda: (arr.__setitem__(slice(head, head + n), ids), arr.__setitem__(slice(head + lg.capacity, k), ids)), a.reps):.1f} |")
    ev = torch.cuda.Event()
    print(f"| Event.record() | {host_us(ev.record, a.reps):.1f} |")
    s = torch.cuda.Stream()
    print(f"| Stream.wait_event(event) | {host_us(lambda: s.wait_event(ev), a.reps):.1f} |")
    print(f"| torch.cuda.Event() created and recorded | {host_us(lambda: torch.cuda.Event().record(s), a.reps):.1f} |")
    print(f"| Event.query() | {host_us(ev.query, a.reps):.1f} |")

    def ctx():
        with torch.cuda.stream(s):
            pass
    print(f"| with torch.cuda.stream(s): pass | {host_us(ctx, a.reps):.1f} |")
    steps = launch_steps(flags, ids, a.reps)
    print("| LoadGraph.launch step by step (median us): " + ", ".join(f"{k} {v:.1f}" for k, v in steps.items()) + " | |")
    if flags.completion == "flags":
        f = flags.launch(ids, ids, torch.cuda.current_stream())
        torch.cuda.synchronize()
        print(f"| Stream.wait_event(layer flag): cuStreamWaitValue64 | {host_us(lambda: s.wait_event(f[5]), a.reps):.1f} |")
        print(f"| layer flag query() (host read) | {host_us(f[5].query, a.reps):.1f} |")


if __name__ == "__main__":
    main()
