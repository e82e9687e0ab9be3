"""TTFT of a hybrid shape, cold (recompute the whole prompt) against warm (load back the full
pages, the SWA window and the state snapshot from pinned L2, then compute the last page).

    PYTHONPATH=. python bench/ttft.py --shape gpt-oss-120b [--tokens 8192] [--reps 5]
    PYTHONPATH=. python bench/ttft.py --shape qwen3-next-80b-a3b

The model is ``bench/hybrid_model.py`` (the real layer pattern and KV / state
shapes, dense stand-ins for the MoE). The prompt's resumable boundary is its
last full page before the last token (``(tokens - 1) // page_size``); the
state group keeps a snapshot there (the request's end mark, as
``HybridState.marks`` does). Warm paths, all through ``hybrid_copy.plan_load``
and ``hybrid_load.HybridLoader`` (a CUDA stream per layer group):

* ``layerwise``: attention layer ``j`` waits (on the device) for its own group's
  copy up to layer ``j``; the first linear layer waits for the snapshot;
* ``serial``: the whole load lands, then the forward runs;
* ``every layer in full`` (gpt-oss): the same, with the SWA group moving every
  page as a layout without groups would.

Before each warm serve the device pools are filled with 0xFF bytes (bf16 NaN):
a page the load did not bring and the forward read would turn the logits NaN.
"""
from __future__ import annotations

import statistics
import time

import torch

from hicache.core.groups import hybrid_layout
from hicache.transfer.hybrid_copy import HybridCopyPlan, plan_load, state_group, state_layout
from hicache.transfer.hybrid_load import HybridLoader
from hicache.kernels.page_copy import copy_pages
from hicache.memory.pools import DevicePool, HostPool
from hicache.core.shapes import model_shape

from hybrid_model import SHAPES, HybridForward, LinearState  # bench-local

DEVICE = "cuda"  # (a CPU smoke run of small shapes sets "cpu")


def _sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


class Setup:
    """Pools, model, page tables and the prompt's boundary for one shape."""

    def __init__(self, name: str, tokens: int, ps: int, host_layout: str):
        self.layout = hybrid_layout(model_shape(name), ps, host_layout=host_layout)
        self.model = HybridForward(SHAPES[name], self.layout, DEVICE)
        self.tokens, self.ps = tokens, ps
        self.pages = -(-tokens // ps)
        self.B = (tokens - 1) // ps  # the resumable boundary, in pages
        g = torch.Generator().manual_seed(1)
        self.dev = DevicePool(self.layout, self.pages, DEVICE)
        self.host = HostPool(self.layout, self.pages + 7, pin=DEVICE == "cuda")
        self.dev_pages = torch.randperm(self.pages, generator=g)
        self.host_pages = torch.randperm(self.pages + 7, generator=g)[:self.pages]
        self.slots = (self.dev_pages[:, None] * ps + torch.arange(ps)).reshape(-1)[:tokens].to(DEVICE)
        sg = state_group(self.layout)
        self.n_linear = len(sg[1].layers) if sg else 0
        self.state_bytes = sg[1].state_bytes if sg else 0
        self.st_dev = self.st_host = None
        if sg:
            sl = state_layout(self.layout)
            self.st_dev, self.st_host = DevicePool(sl, 2, DEVICE), HostPool(sl, 3, pin=DEVICE == "cuda")
        self.loader = HybridLoader(self.host, self.dev, self.st_host, self.st_dev)

    def ids(self):
        """Source (L2) and destination (L1) ids per group for boundary B (module hybrid_copy)."""
        src, dst = [], []
        hp, dp = self.host_pages.tolist(), self.dev_pages.tolist()
        for g in self.layout.groups:
            if g.kind == "state":
                src.append([None] * (self.B - 1) + [2])  # the snapshot lives in L2 slot 2, goes to L1 slot 1
                dst.append([None] * (self.B - 1) + [1])
            else:
                src.append(hp[:self.B])
                dst.append(dp[:self.B])
        return src, dst

    def poison(self) -> None:
        for b in self.dev.buffers:
            b.view(-1).view(torch.uint8).fill_(0xFF)
        if self.st_dev is not None:
            self.st_dev.buffers[0].fill_(0xFF)

    def state(self) -> LinearState:
        return LinearState(self.n_linear, DEVICE, self.state_bytes)


def every_layer_full(plan: HybridCopyPlan) -> HybridCopyPlan:
    """``plan`` with each SWA group moving every page the full group moves (a layout without groups)."""
    full = next(c for c in plan.copies if c.kind == "full")
    copies = tuple(c._replace(src=full.src, dst=full.dst, nbytes=c.nbytes // max(1, len(c.src)) * len(full.src))
                   if c.kind == "swa" else c for c in plan.copies)
    return plan._replace(copies=copies, nbytes=sum(c.nbytes for c in copies))


def cold(s: Setup, prompt: torch.Tensor) -> tuple[float, torch.Tensor]:
    """Full prefill; then (untimed) the boundary's pages and snapshot go to L2."""
    _sync()
    t0 = time.perf_counter()
    st = s.state()
    logits = s.model.forward(s.dev, prompt, 0, s.slots, st, snapshot_at=s.B * s.ps)
    int(logits.argmax())
    dt = time.perf_counter() - t0
    b = s.B
    copy_pages(s.dev, s.host, s.dev_pages[:b].to(DEVICE), s.host_pages[:b].to(DEVICE))
    if s.st_dev is not None:
        s.st_dev.buffers[0].zero_()
        st.snap_to_row(s.st_dev.buffers[0][1])
        copy_pages(s.st_dev, s.st_host, [1], [2])
    _sync()
    return dt, logits


def warm(s: Setup, prompt: torch.Tensor, mode: str, full: bool = False) -> tuple[float, float, torch.Tensor, int]:
    """(TTFT, load landed, logits, bytes moved) of a serve from L2."""
    s.poison()
    _sync()
    t0 = time.perf_counter()
    src, dst = s.ids()
    plan = plan_load(s.layout, s.B, src, dst)
    if full:
        plan = every_layer_full(plan)
    h = s.loader.load(plan)
    st = s.state()

    def state_in() -> None:
        h.wait_state()
        st.from_row(s.st_dev.buffers[0][1])

    loaded = 0.0
    if mode == "serial":
        h.wait()
        _sync()
        loaded = time.perf_counter() - t0
    start = s.B * s.ps
    logits = s.model.forward(s.dev, prompt[start:], start, s.slots, st,
                             before_layer=h.wait_layer if mode == "layerwise" else None,
                             before_state=state_in if s.n_linear else None)
    int(logits.argmax())
    dt = time.perf_counter() - t0
    return dt, loaded, logits, plan.nbytes


def run(name: str, tokens: int, ps: int, reps: int, host_layout: str) -> int:
    s = Setup(name, tokens, ps, host_layout)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, 32000, (tokens,), generator=g).to(DEVICE) for _ in range(reps + 1)]
    modes = [("layerwise", False), ("serial", False)] + ([("layerwise", True), ("serial", True)]
                                                         if any(x.kind == "swa" for x in s.layout.groups) else [])
    cold(s, prompts[-1])  # warm-up: compile, allocate
    for m, f in modes:
        warm(s, prompts[-1], m, f)
    c_t: list[float] = []
    w_t: dict[tuple[str, bool], list[tuple[float, float, int]]] = {m: [] for m in modes}
    diffs, same, nan, scale = [], 0, 0, 0.0
    identical = 0  # reps whose warm serves all gave the same logits, bit for bit
    for i in range(reps):
        dt, lc = cold(s, prompts[i])
        c_t.append(dt)
        outs = []
        for m in modes:
            wt, ld, lw, nb = warm(s, prompts[i], *m)
            w_t[m].append((wt, ld, nb))
            outs.append(lw)
            nan += int(not bool(torch.isfinite(lw).all()))
            if m == ("layerwise", False):
                diffs.append(float((lw - lc).abs().max()))
                scale = max(scale, float(lc.abs().max()))
                same += int(lw.argmax()) == int(lc.argmax())
        identical += all(torch.equal(o, outs[0]) for o in outs)
    _report(s, name, tokens, ps, reps, host_layout, c_t, w_t, diffs, same, nan, scale)
    names = ", ".join(m + (" every layer in full" if f else "") for m, f in modes)
    print(f"warm serves ({names}) gave "
          f"bit-identical logits in {identical}/{reps} reps")
    s.loader.check_integrity()
    s.loader.close()
    return 0 if nan == 0 and identical == reps else 1


def _report(s: Setup, name, tokens, ps, reps, host_layout, c_t, w_t, diffs, same, nan, scale) -> None:
    med = lambda xs: statistics.median(xs) * 1e3  # noqa: E731
    c = med(c_t)
    lay = s.layout
    dev_name = torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu"
    print(f"# TTFT, hybrid {name}, {dev_name}, torch {torch.__version__}, {tokens}-token prompt, "
          f"page {ps}, host layout {host_layout}, boundary {s.B} pages ({s.B * ps} tokens), {reps} reps (median)\n")
    print("| path | TTFT ms | share of cold | bytes loaded MiB | load landed ms (GB/s) |")
    print("|---|---:|---:|---:|---:|")
    print(f"| cold (recompute the whole prompt) | {c:.1f} | 100% | 0 | - |")
    what = {("layerwise", False): "warm, hybrid (full pages + SWA window + snapshot), layer-wise per group",
            ("serial", False): "warm, hybrid, whole load then forward",
            ("layerwise", True): "warm, every layer in full, layer-wise per group",
            ("serial", True): "warm, every layer in full, whole load then forward"}
    for m, rows in w_t.items():
        t, nb = med([r[0] for r in rows]), rows[0][2]
        ld = med([r[1] for r in rows]) if m[0] == "serial" else float("nan")
        rate = f"{ld:.1f} ({nb / (ld * 1e-3) / 1e9:.1f})" if m[0] == "serial" else "beside the forward"
        print(f"| {what[m]} | {t:.1f} | {t / c:.1%} | {nb / 2**20:.1f} | {rate} |")
    src, dst = s.ids()
    plan = plan_load(lay, s.B, src, dst)
    print("\n| group | layers | pages / snapshots moved | MiB |")
    print("|---|---:|---:|---:|")
    for cp, gr in zip(plan.copies, lay.groups):
        print(f"| {gr.kind}{f' (window {gr.window})' if gr.window else ''} | {len(gr.layers)} | {len(cp.src)} "
              f"| {cp.nbytes / 2**20:.1f} |")
    print(f"| **hybrid load** | | | **{plan.nbytes / 2**20:.1f}** |")
    print(f"| every KV layer in full (no groups) | {lay.num_layers} | {s.B} | {plan.every_layer_full / 2**20:.1f} |")
    if s.n_linear:
        ratio = (f"KV bytes as every layer in full ({plan.every_layer_full / 2**20:.1f} MiB) plus one "
                 f"{s.state_bytes * s.n_linear / 2**20:.1f} MiB snapshot; a layout without groups keeps no state, "
                 "so it cannot resume the linear layers at all (recompute)")
    else:
        ratio = f"hybrid / every-layer-in-full bytes: {plan.nbytes / plan.every_layer_full:.1%}"
    print(f"\n{ratio}; warm logits NaN (a page read that the load did not bring) in {nan} serves; warm layerwise "
          f"vs cold: same first token in {same}/{reps} reps, max |logit diff| {max(diffs):.3g} (max |logit| "
          f"{scale:.3g}; bf16 snapshot, another summation order)")
