"""Time to first token of an 8K-token prompt: cold (full prefill) against fully
served from L2 (load back + the last page), on an 8B-shaped model.

    PYTHONPATH=. python bench/ttft.py [--tokens 8192] [--layers 32] [--reps 5] [--profile]
    PYTHONPATH=. python bench/ttft.py --slow-l3 [--l3-gbps 1.0]   # load vs recompute (bench/load_vs_recompute.py)
    PYTHONPATH=. python bench/ttft.py --shape gpt-oss-120b   # a hybrid shape (bench/ttft_hybrid.py)

Warm runs two ways: ``serial`` waits for the whole load back, then computes;
``layerwise`` passes ``Admission.wait_layer`` as the model's ``before_layer``,
so layer i's attention waits (on the GPU, not the host) for layer i's pages
while later layers are still copying. Needs a CUDA GPU (H200: ~16 GB of bf16
weights). Prints markdown tables: TTFT, then where the time goes.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import warnings
from dataclasses import dataclass

import torch

from hicache.core.config import HiCacheConfig
from hicache.reference.model import ReferenceModel
from hicache.reference.model_spec import ModelSpec
from hicache.cache.hicache import HiCache
from hicache.kernels.page_copy import PageCopier
from hicache.transfer.load_graph import LoadGraph
from hicache.transfer.engine import layer_plane_groups

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from load_shape import launch_shape  # noqa: E402  (bench-local)


@dataclass(slots=True)
class Sample:
    """One served request; times in seconds from the start of admission."""

    ttft: float  # admission -> first token on the host
    admit: float  # host time of HiCache.admit (match, lock, launch the load back)
    loaded: float | None  # serial only: every layer of the load back has landed
    enqueued: float  # the forward's last kernel is queued (the host is free)
    syncs: int  # host syncs inside forward_chunk (torch.cuda sync debug mode)
    hit: int  # tokens served from the cache
    first: int  # the first token
    logits: torch.Tensor


def _median(xs: list[float]) -> float:
    return statistics.median(xs) * 1e3


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--host-layout", default="page_first")
    ap.add_argument("--profile", action="store_true", help="torch.profiler breakdown of one layerwise serve")
    ap.add_argument("--load-blocks", default="",
                    help="also serve layerwise with other launch shapes of the load back's kernels, captured "
                         "once each: comma-separated BLOCKS or BLOCKS:TILE_KIB:WARPS (e.g. 4,16,8:32:4)")
    ap.add_argument("--forward-priority", type=int, default=None,
                    help="run admission and forward on a stream of this priority (negative = higher than the "
                         "copy stream's 0), e.g. -1; the block scheduler then prefers the forward's blocks")
    ap.add_argument("--slow-l3", action="store_true",
                    help="instead: the prompt only on an L3 slower than the prefill; the cost model must recompute "
                         "(bench/load_vs_recompute.py)")
    ap.add_argument("--l3-gbps", type=float, default=1.0, help="--slow-l3: the L3's read bandwidth, GB/s")
    ap.add_argument("--shape", default="", choices=["", "gpt-oss-120b", "qwen3-next-80b-a3b"],
                    help="instead: a hybrid shape, cold vs warm (full pages + SWA window + state snapshot; "
                         "bench/ttft_hybrid.py)")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench/ttft.py needs a CUDA GPU", file=sys.stderr)
        return 2
    if a.shape:
        from ttft_hybrid import run as run_hybrid
        return run_hybrid(a.shape, a.tokens, a.page_size, a.reps, a.host_layout)
    spec = ModelSpec(vocab=32000, hidden=4096, num_layers=a.layers, num_q_heads=32, mlp=14336, kind="mha",
                     num_kv_heads=8, head_dim=128, dtype="bfloat16", seed=0, max_seq_len=a.tokens + 64,
                     name="llama-8b-shaped")
    model = ReferenceModel(spec, device="cuda", attention="sdpa", draft=False)
    if a.slow_l3:
        from load_vs_recompute import run
        return 0 if run(model, spec.kv_layout(a.page_size, a.host_layout), tokens=a.tokens,
                        l3_bytes_per_s=a.l3_gbps * 1e9, reps=a.reps, device="cuda:0") else 1
    ps = a.page_size
    pages = a.tokens // ps + 8
    layout = spec.kv_layout(ps, a.host_layout)
    cfg = HiCacheConfig.load(env={}, overrides={
        "storage.url": "", "pool.device": "cuda:0", "pool.device_pages": str(pages * 2),
        "pool.host_pages": str(pages * 3)})
    hc = HiCache(cfg, layout=layout)
    pool = hc.device_pool
    g = torch.Generator().manual_seed(0)

    extra_blocks = [b for b in a.load_blocks.split(",") if b]
    graphs: dict[str | None, object] = {}  # load-back graph per launch shape (None: the tuned default)
    real_copy = PageCopier.copy_pages
    override: list[tuple[int, PageCopier] | None] = [None]
    copiers: list[PageCopier] = []

    def copy_with_shape(self, *args, **kw):
        if override[0] is not None and kw.get("count") is not None:  # the load graph's launches
            blocks, copier = override[0]
            kw["num_blocks"] = blocks
            return real_copy(copier, *args, **kw)
        return real_copy(self, *args, **kw)

    PageCopier.copy_pages = copy_with_shape

    def use_graph(shape: str | None) -> None:
        if shape == "events" and shape not in graphs:  # per-layer completion by event nodes (not flags)
            graphs[shape] = LoadGraph(hc.host_pool, pool, layer_plane_groups(layout), completion="events")
        if shape not in graphs:
            if shape is not None:
                override[0] = launch_shape(shape)
                copiers.append(override[0][1])  # its plans (chunk tables) are read by every replay: keep it alive
            hc.transfers._graph = None
            graphs[shape] = hc.transfers._load_graph()  # captured here, outside any timing
            override[0] = None
        hc.transfers._graph = graphs[shape]

    fwd_stream = None if a.forward_priority is None else torch.cuda.Stream(priority=a.forward_priority)

    def serve(rid: str, prompt: list[int], mode: str) -> Sample:
        if fwd_stream is None:
            return _serve(rid, prompt, mode)
        with torch.cuda.stream(fwd_stream):
            return _serve(rid, prompt, mode)

    def _serve(rid: str, prompt: list[int], mode: str) -> Sample:
        torch.cuda.synchronize()
        hc.transfers._graphs = mode != "layerwise-launches"  # the same run without the CUDA-graph load
        if hc.transfers._graphs:
            use_graph("events" if mode == "layerwise-events" else mode.split("-b", 1)[1] if "-b" in mode else None)
        t0 = time.perf_counter()
        req = hc.new_request(rid, prompt)
        adm = hc.admit(req)
        t_admit = time.perf_counter() - t0
        start = req.computed_tokens
        req.alloc(len(prompt) - start)
        loaded = None
        if mode.startswith("serial"):
            adm.wait()
            torch.cuda.synchronize()  # only to time the load; the forward would wait for it anyway
            loaded = time.perf_counter() - t0
        slots = pool.slot_ids(req.pages)[:len(prompt)]  # host page table: the model uploads it once
        hook = adm.wait_layer if mode.startswith("layerwise") else None
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                out = model.forward_chunk(pool, prompt[start:], start, slots, draft=False, before_layer=hook)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        enq = time.perf_counter() - t0
        if mode.startswith("layerwise"):  # everything is enqueued: timing the load's end changes nothing
            adm.loads[0].transfer.cuda_event.synchronize()
            loaded = time.perf_counter() - t0
        first = int(out.logits_last.argmax())  # the first token (forces the sync)
        dt = time.perf_counter() - t0
        adm.wait()  # (no-op by now) the load's completion is observed by reset()'s drain
        req.commit()
        req.finish()
        syncs = sum("synchroniz" in str(w.message) for w in caught)
        return Sample(dt, t_admit, loaded, enq, syncs, start, first, out.logits_last.float())

    def reset() -> None:
        hc.drain()  # write-through backups to L2 done
        hc.evict(10**9)  # drop L1: the next hit must come from L2
        hc.check_integrity()

    prompts = [torch.randint(1, spec.vocab, (a.tokens,), generator=g).tolist() for _ in range(a.reps + 1)]
    serve("warmup", prompts[-1], "cold")  # compile / allocate
    reset()
    serve("warmup-serial", prompts[-1], "serial")
    reset()
    serve("warmup-layerwise", prompts[-1], "layerwise")
    reset()
    serve("warmup-launches", prompts[-1], "layerwise-launches")
    reset()
    serve("warmup-events", prompts[-1], "layerwise-events")
    reset()
    for b in extra_blocks:
        serve(f"warmup-b{b}", prompts[-1], f"layerwise-b{b}")
        reset()
        serve(f"warmup-sb{b}", prompts[-1], f"serial-b{b}")
        reset()

    hc.evict_host(10**9)
    modes = ("cold", "serial", "layerwise", "layerwise-launches", "layerwise-events",
             *(f"{m}-b{b}" for b in extra_blocks for m in ("layerwise", "serial")))
    runs: dict[str, list[Sample]] = {m: [] for m in modes}
    diffs, same_first, same_logits = [], 0, 0
    want_hit = (a.tokens - 1) // ps * ps
    for i in range(a.reps):
        for mode in modes:
            s = serve(f"{mode}{i}", prompts[i], mode)
            assert s.hit == (0 if mode == "cold" else want_hit), (mode, s.hit)
            runs[mode].append(s)
            reset()
        c, se, lw = runs["cold"][-1], runs["serial"][-1], runs["layerwise"][-1]
        same_first += se.first == c.first == lw.first
        same_logits += torch.equal(se.logits, lw.logits)
        for b in extra_blocks:  # another grid moves the same bytes: the same logits, bit for bit
            for m in ("layerwise", "serial"):
                assert torch.equal(runs[f"{m}-b{b}"][-1].logits, lw.logits), f"{m} with {b}: logits differ"
        diffs.append((lw.logits - c.logits).abs().max().item())
        hc.evict_host(10**9)
    c = _median([s.ttft for s in runs["cold"]])
    name = torch.cuda.get_device_name()
    print(f"# TTFT, {name}, torch {torch.__version__}, {a.layers} layers x 8 KV heads x 128 dims bf16, "
          f"{a.tokens}-token prompt, page {ps}, host layout {a.host_layout}, {a.reps} reps (median)"
          + ("" if fwd_stream is None else f", forward on a stream of priority {a.forward_priority}") + "\n")
    print("| path | TTFT ms | share of cold |")
    print("|---|---:|---:|")
    print(f"| cold (full prefill) | {c:.1f} | 100% |")
    for mode, what in (("serial", "warm, serial: whole load back, then the last page"),
                       ("layerwise", "warm, layerwise: layer i waits for its own pages only"),
                       ("layerwise-launches", "warm, layerwise, one launch per layer (no CUDA graph)"),
                       ("layerwise-events", "warm, layerwise, CUDA graph with an event node per layer")):
        w = _median([s.ttft for s in runs[mode]])
        print(f"| {what} | {w:.1f} | {w / c:.1%} |")

    kv_bytes = want_hit * layout.token_bytes
    se, lw = runs["serial"], runs["layerwise"]
    load = _median([s.loaded for s in se])
    print("\n| where the time goes (median ms) | serial | layerwise |")
    print("|---|---:|---:|")
    print(f"| admit (host: match, lock, launch {a.layers} per-layer copies) | {_median([s.admit for s in se]):.2f} "
          f"| {_median([s.admit for s in lw]):.2f} |")
    lw_load = _median([s.loaded for s in lw])
    print(f"| load back landed (admit included; {kv_bytes / 2**30:.2f} GiB; GB/s) | {load:.1f} "
          f"({kv_bytes / (load * 1e-3) / 1e9:.1f}) | {lw_load:.1f} ({kv_bytes / (lw_load * 1e-3) / 1e9:.1f}), "
          "beside the forward |")
    print(f"| forward queued by the host (from admission) | {_median([s.enqueued for s in se]):.1f} "
          f"| {_median([s.enqueued for s in lw]):.1f} |")
    print(f"| forward alone (last {a.tokens - want_hit} tokens on resident KV) | "
          f"{_median([s.ttft - s.loaded for s in se]):.1f} | - |")
    print(f"| first token on the host (TTFT) | {_median([s.ttft for s in se]):.1f} "
          f"| {_median([s.ttft for s in lw]):.1f} |")
    print(f"| host syncs inside forward_chunk (max over reps) | {max(s.syncs for s in se)} "
          f"| {max(s.syncs for s in lw)} |")
    print(f"\nmax |logit diff| warm vs cold {max(diffs):.3g}; same first token cold/serial/layerwise in "
          f"{same_first}/{a.reps} reps; serial and layerwise logits bit-identical in {same_logits}/{a.reps}")
    w = _median([s.ttft for s in lw])
    print(f"target warm (layerwise) <= 15% of cold: {'met' if w / c <= 0.15 else 'MISSED'} ({w / c:.1%})")
    la = runs["layerwise-launches"]
    adm_g, adm_l = _median([s.admit for s in lw]), _median([s.admit for s in la])
    adm_e = _median([s.admit for s in runs["layerwise-events"]])
    print(f"admission host time: {adm_g:.2f} ms with the CUDA-graph load back "
          f"(completion by {graphs[None].completion}), {adm_e:.2f} ms "
          f"with event nodes, {adm_l:.2f} ms launching per layer; target <= 0.5 ms: {'met' if adm_g <= 0.5 else 'MISSED'}")
    fwd = _median([s.ttft - s.loaded for s in se])
    bound = fwd + adm_g + 1.5 * (load - _median([s.admit for s in se])) / a.layers
    print(f"warm TTFT {w:.1f} ms vs forward alone + admission + 1.5 x one layer's load = {bound:.1f} ms: "
          f"{'met' if w <= bound else 'MISSED'} (launching per layer: {_median([s.ttft for s in la]):.1f} ms)")
    if extra_blocks:
        print("\n| load back launch (blocks[:tile KiB:warps]) | warm layerwise TTFT ms | load landed ms (GB/s), "
              "beside the forward | serial: load alone ms (GB/s) | model kernels' GPU ms beside the load "
              "(one profiled serve; serial: none beside) |")
        print("|---|---:|---:|---:|---:|")
        serial_ms = _model_ms(serve, reset, prompts[0], "serial")  # the reference: no copy beside the model
        for b in (None, *extra_blocks):
            r = runs["layerwise" if b is None else f"layerwise-b{b}"]
            sr = runs["serial" if b is None else f"serial-b{b}"]
            ld, sld = _median([s.loaded for s in r]), _median([s.loaded - s.admit for s in sr])
            print(f"| {'default (8:64:8)' if b is None else b} | {_median([s.ttft for s in r]):.1f} | "
                  f"{ld:.1f} ({kv_bytes / (ld * 1e-3) / 1e9:.1f}) | {sld:.1f} ({kv_bytes / (sld * 1e-3) / 1e9:.1f}) | "
                  f"{_model_ms(serve, reset, prompts[0], 'layerwise' if b is None else f'layerwise-b{b}'):.1f} "
                  f"({serial_ms:.1f}) |")
    if a.profile:
        try:
            _profile(serve, reset, prompts[0])
        except RuntimeError as e:  # the tables above stand without it
            print(f"\nprofile unavailable: {e!r}")
    hc.close()
    return 0


def _model_us(prof) -> float:
    """GPU time of the model's kernels (every GPU event but the page copies) in a profile."""
    return sum(e.time_range.elapsed_us() for e in prof.events()
               if e.device_type.name == "CUDA" and "page_copy" not in e.name)


def _model_ms(serve, reset, prompt: list[int], mode: str) -> float:
    """``_model_us`` of one profiled serve of ``prompt`` in ``mode``, in ms."""
    from torch.profiler import ProfilerActivity, profile

    serve(f"prof-cold-{mode}", prompt, "cold")  # puts the prompt on L2 (reset: backups drained)
    reset()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        serve(f"prof-{mode}", prompt, mode)
    reset()
    return _model_us(prof) / 1e3


def _profile(serve, reset, prompt: list[int]) -> None:
    """GPU kernel time of one layerwise serve, split into page copies and model kernels."""
    from torch.profiler import ProfilerActivity, profile

    serve("prof-cold", prompt, "cold")
    reset()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof_serial:
        serve("prof-serial", prompt, "serial")
    reset()
    # model kernels alone (the load has landed before the forward starts): their GPU time
    # without a copy kernel beside them, to compare with the layerwise serve's below
    serial_model_us = _model_us(prof_serial)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        s = serve("prof-layerwise", prompt, "layerwise")
    reset()
    copy_us = model_us = 0.0
    copies = kernels = 0
    for e in prof.events():
        if e.device_type.name != "CUDA":
            continue
        if "page_copy" in e.name:
            copy_us += e.time_range.elapsed_us()
            copies += 1
        else:
            model_us += e.time_range.elapsed_us()
            kernels += 1
    print("\n| profiled layerwise serve (one, under torch.profiler) | value |")
    print("|---|---:|")
    print(f"| TTFT under the profiler | {s.ttft * 1e3:.1f} ms |")
    print(f"| page-copy kernel time (copy stream) | {copy_us / 1e3:.1f} ms in {copies} launches |")
    print(f"| other GPU work: model kernels, small copies (compute stream) | {model_us / 1e3:.1f} ms in "
          f"{kernels} kernels/copies |")
    print(f"| the same model kernels in a serial serve (no copy beside them) | {serial_model_us / 1e3:.1f} ms |")
    print(f"| host: forward queued / first token | {s.enqueued * 1e3:.1f} ms / {s.ttft * 1e3:.1f} ms |")
    # Timeline on the GPU clock, from the first GPU event: when each layer's copy ended, and
    # how busy the model kernels were before and after the last copy.
    gpu = sorted((e for e in prof.events() if e.device_type.name == "CUDA"), key=lambda e: e.time_range.start)
    if not gpu:
        return
    t0 = gpu[0].time_range.start
    ends = [e.time_range.end - t0 for e in gpu if "page_copy" in e.name]
    model = [e for e in gpu if "page_copy" not in e.name]
    last_copy = max(ends) if ends else 0.0
    last_model = max(e.time_range.end for e in model) - t0 if model else 0.0
    busy_after = sum(max(0.0, e.time_range.end - t0 - max(last_copy, e.time_range.start - t0)) for e in model)
    busy_before = sum(e.time_range.elapsed_us() for e in model) - busy_after
    print("\n| GPU timeline of that serve (us from its first GPU event) | value |")
    print("|---|---:|")
    if ends:
        picks = sorted({0, 1, len(ends) // 2, len(ends) - 2, len(ends) - 1})
        print("| copy kernel i ends at (i: " + ", ".join(str(i) for i in picks) + ") | "
              + ", ".join(f"{ends[i]:.0f}" for i in picks) + " |")
        if len(ends) > 1:
            steps = [b - a for a, b in zip(ends, ends[1:])]
            print(f"| gap between consecutive copy ends: median / max | {statistics.median(steps):.0f} / "
                  f"{max(steps):.0f} |")
    print(f"| last model kernel ends at | {last_model:.0f} |")
    print(f"| model kernel time before / after the last copy ended | {busy_before:.0f} / {busy_after:.0f} |")
    _kernels_slowed(prof_serial, prof)


def _kernels_slowed(alone, beside, top: int = 10) -> None:
    """Which of the model's kernels the copy slows: GPU time per kernel name in a serve with
    no copy beside the forward (``alone``) and in a layerwise one (``beside``)."""
    def by_name(prof) -> dict[str, list[float]]:
        out: dict[str, list[float]] = {}
        for e in prof.events():
            if e.device_type.name == "CUDA" and "page_copy" not in e.name:
                out.setdefault(e.name[:70], []).append(e.time_range.elapsed_us())
        return out
    a, b = by_name(alone), by_name(beside)
    rows = sorted(((sum(b[k]) - sum(a.get(k, [0.0])), k) for k in b), reverse=True)[:top]
    print("\n| model kernel (name, first 70 characters) | launches | GPU us alone | beside the copy | ratio |")
    print("|---|---:|---:|---:|---:|")
    for _, k in rows:
        ta, tb = sum(a.get(k, [0.0])), sum(b[k])
        print(f"| `{k}` | {len(b[k])} | {ta:.0f} | {tb:.0f} | {tb / ta if ta else float('nan'):.2f} |")


if __name__ == "__main__":
    sys.exit(main())
