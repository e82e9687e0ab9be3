"""TTFT of a hybrid shape, cold (recompute the whole prompt) against warm (load back the full
pages, the SWA window and the state snapshot from pinned L2, then compute the last page).

    PYTHONPATH=. python bench/ttft.py --shape gpt-oss-120b [--tokens 8192] [--reps 5]
    PYTHONPATH=. python bench/ttft.py --shape qwen3-next-80b-a3b

The model is ``bench/hybrid_model.py`` (the real layer pattern and KV / state
shapes, dense stand-ins for the MoE). The prompt's resumable boundary is its
last full page before the last token (``(tokens - 1) // page_size``); the
state group keeps a snapshot there. Warm paths go through the one transfer
engine as ``HybridCache``'s loads do (``TransferController.add_group``: one
``LoadPlan`` per layer group, full pages last, on the one copy stream, each
load one CUDA-graph replay): ``layerwise`` (attention layer ``j`` waits on the
device for its own group's load up to layer ``j``; the first linear layer for
the snapshot), ``serial`` (the whole load lands, then the forward), and both
again with the SWA group moving every page (every layer in full). Each rep
serves cold and every warm path on the same prompt, so the table's cold and
warm medians and spreads come from the same run. Before each warm serve the
device pools hold 0xFF (bf16 NaN): a page the load did not bring turns the
logits NaN.
"""
from __future__ import annotations

import statistics
import time

import torch

from hicache.cache.hybrid import group_layout
from hicache.core.groups import hybrid_layout
from hicache.kernels.page_copy import copy_pages
from hicache.memory.pools import DevicePool, HostPool
from hicache.core.shapes import model_shape
from hicache.transfer.engine import TransferController
from hicache.tiers.plans import LoadPlan

from hybrid_model import SHAPES, HybridForward, LinearState  # bench-local

DEVICE = "cuda"  # (a CPU smoke run of small shapes sets "cpu")
SNAP_L2, SNAP_L1 = 2, 1  # the snapshot's slot in the state pools


def _sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


class Setup:
    """Pools, model, page tables, the one transfer engine and the prompt's boundary for one shape."""

    def __init__(self, name: str, tokens: int, ps: int, host_layout: str):
        self.layout = lay = hybrid_layout(model_shape(name), ps, host_layout=host_layout)
        self.model = HybridForward(SHAPES[name], lay, DEVICE)
        self.tokens, self.ps = tokens, ps
        self.pages = -(-tokens // ps)
        self.B = (tokens - 1) // ps  # the resumable boundary, in pages
        g = torch.Generator().manual_seed(1)
        self.dev = DevicePool(lay, self.pages, DEVICE)
        self.host = HostPool(lay, self.pages + 7, pin=DEVICE == "cuda")
        self.dev_pages = torch.randperm(self.pages, generator=g)
        self.host_pages = torch.randperm(self.pages + 7, generator=g)[:self.pages]
        self.slots = (self.dev_pages[:, None] * ps + torch.arange(ps)).reshape(-1)[:tokens].to(DEVICE)
        self.state_gi = next((gi for gi, x in enumerate(lay.groups) if x.kind == "state"), None)
        sg = lay.groups[self.state_gi] if self.state_gi is not None else None
        self.n_linear, self.state_bytes = (len(sg.layers), sg.state_bytes) if sg else (0, 0)
        self.st_dev = self.st_host = None
        self.tc = TransferController(self.dev, self.host)
        self.local: dict[int, tuple[int, int]] = {}  # attention layer -> (group, its layer in that group's loads)
        for gi, x in enumerate(lay.groups):
            if x.kind == "state":
                sl = group_layout(lay, ("state",), gi)
                self.st_dev, self.st_host = DevicePool(sl, 2, DEVICE), HostPool(sl, 3, pin=DEVICE == "cuda")
                self.tc.add_group(gi, self.st_dev, self.st_host)
            else:  # the KV groups share the layout's pools; each loads its own layers
                self.tc.add_group(gi, self.dev, self.host, layers=x.layers)
                self.local.update({layer: (gi, k) for k, layer in enumerate(x.layers)})

    def plans(self, full: bool = False) -> list[LoadPlan]:
        """One load per group for boundary B, full groups last (as ``HybridCache`` submits them):
        every page for a full group (and an SWA group with ``full``), the window's for an SWA
        group, the snapshot for the state group."""
        hp, dp = self.host_pages.tolist(), self.dev_pages.tolist()
        out = []
        for gi, x in sorted(enumerate(self.layout.groups), key=lambda e: e[1].kind == "full"):
            if x.kind == "state":
                out.append(LoadPlan(None, (), [SNAP_L2], [SNAP_L1], None, group=gi))
                continue
            lo = 0 if x.kind == "full" or full else max(0, self.B * self.ps - x.window + 1) // self.ps
            out.append(LoadPlan(None, (), hp[lo:self.B], dp[lo:self.B], None, group=gi))
        return out

    def nbytes(self, plan: LoadPlan) -> int:
        x = self.layout.groups[plan.group]
        per = (x.state_bytes * len(x.layers) if x.kind == "state"
               else sum(p.page_bytes for i in x.layers for p in self.layout.planes_of_layer(i)))
        return per * len(plan.host)

    def poison(self) -> None:
        for b in self.dev.buffers:
            b.view(-1).view(torch.uint8).fill_(0xFF)
        if self.st_dev is not None:
            self.st_dev.buffers[0].fill_(0xFF)

    def state(self) -> LinearState:
        return LinearState(self.n_linear, DEVICE, self.state_bytes)


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
        st.snap_to_row(s.st_dev.buffers[0][SNAP_L1])
        copy_pages(s.st_dev, s.st_host, [SNAP_L1], [SNAP_L2])
    _sync()
    return dt, logits


def warm(s: Setup, prompt: torch.Tensor, mode: str, full: bool = False) -> tuple[float, float, torch.Tensor, int]:
    """(TTFT, load landed, logits, bytes moved) of a serve from L2."""
    s.poison()
    _sync()
    t0 = time.perf_counter()
    plans = s.plans(full)
    handles = {p.group: s.tc.load_handle(s.tc.submit(p)) for p in plans}
    st = s.state()

    def layer_in(j: int) -> None:
        gi, k = s.local[j]
        handles[gi].wait_layer(k)

    def state_in() -> None:
        handles[s.state_gi].wait()
        st.from_row(s.st_dev.buffers[0][SNAP_L1])

    loaded = 0.0
    if mode == "serial":
        for h in handles.values():
            h.wait()
        _sync()
        loaded = time.perf_counter() - t0
    start = s.B * s.ps
    logits = s.model.forward(s.dev, prompt[start:], start, s.slots, st,
                             before_layer=layer_in if mode == "layerwise" else None,
                             before_state=state_in if s.n_linear else None)
    int(logits.argmax())
    dt = time.perf_counter() - t0
    s.tc.wait_all()
    s.tc.finished()
    return dt, loaded, logits, sum(s.nbytes(p) for p in plans)


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
    s.tc.check_integrity()
    s.tc.close()
    return 0 if nan == 0 and identical == reps else 1


def _ms(xs: list[float]) -> str:
    """Median and spread (min-max) in ms."""
    return f"{statistics.median(xs) * 1e3:.1f} ({min(xs) * 1e3:.1f}-{max(xs) * 1e3:.1f})"


def _report(s: Setup, name, tokens, ps, reps, host_layout, c_t, w_t, diffs, same, nan, scale) -> None:
    c = statistics.median(c_t)
    dev_name = torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu"
    print(f"# TTFT, hybrid {name}, {dev_name}, torch {torch.__version__}, {tokens}-token prompt, page {ps}, "
          f"host layout {host_layout}, boundary {s.B} pages ({s.B * ps} tokens), {reps} reps: median (min-max), "
          "cold and every warm path served on the same prompt in each rep\n")
    print("| path | TTFT ms | share of cold | bytes loaded MiB | load landed ms (GB/s) |")
    print("|---|---:|---:|---:|---:|")
    print(f"| cold (recompute the whole prompt) | {_ms(c_t)} | 100% | 0 | - |")
    what = {("layerwise", False): "warm, hybrid (full pages + SWA window + snapshot), layer-wise",
            ("serial", False): "warm, hybrid, whole load then forward",
            ("layerwise", True): "warm, every layer in full, layer-wise",
            ("serial", True): "warm, every layer in full, whole load then forward"}
    for m, rows in w_t.items():
        t, nb = [r[0] for r in rows], rows[0][2]
        ld = statistics.median([r[1] for r in rows]) if m[0] == "serial" else 0.0
        rate = f"{ld * 1e3:.1f} ({nb / ld / 1e9:.1f})" if m[0] == "serial" else "beside the forward"
        print(f"| {what[m]} | {_ms(t)} | {statistics.median(t) / c:.1%} | {nb / 2**20:.1f} | {rate} |")
    hy = statistics.median([r[0] for r in w_t[("layerwise", False)]])
    if ("layerwise", True) in w_t:
        full = statistics.median([r[0] for r in w_t[("layerwise", True)]])
        print(f"\nwarm hybrid layer-wise: {hy / c:.1%} of cold (target <= 12%), {hy / full:.2f}x every layer in "
              "full layer-wise (target <= 0.75x)")
    else:
        print(f"\nwarm hybrid layer-wise: {hy / c:.1%} of cold (target <= 12%)")
    _report_groups(s, reps, diffs, same, nan, scale)


def _report_groups(s: Setup, reps, diffs, same, nan, scale) -> None:
    lay = s.layout
    plans, every = s.plans(), s.plans(full=True)
    print("\n| group | layers | pages / snapshots moved | MiB |")
    print("|---|---:|---:|---:|")
    for p in plans:
        gr = lay.groups[p.group]
        print(f"| {gr.kind}{f' (window {gr.window})' if gr.window else ''} | {len(gr.layers)} | {len(p.host)} "
              f"| {s.nbytes(p) / 2**20:.1f} |")
    hybrid = sum(s.nbytes(p) for p in plans)
    kv_full = sum(s.nbytes(p) for p in every if lay.groups[p.group].kind != "state")
    print(f"| **hybrid load** | | | **{hybrid / 2**20:.1f}** |")
    print(f"| every KV layer in full (no groups) | {lay.num_layers} | {s.B} | {kv_full / 2**20:.1f} |")
    if s.n_linear:
        ratio = (f"KV bytes as every layer in full ({kv_full / 2**20:.1f} MiB) plus one "
                 f"{s.state_bytes * s.n_linear / 2**20:.1f} MiB snapshot; a layout without groups keeps no state, "
                 "so it cannot resume the linear layers at all (recompute)")
    else:
        ratio = f"hybrid / every-layer-in-full bytes: {hybrid / kv_full:.1%}"
    print(f"\n{ratio}; warm logits NaN (a page read that the load did not bring) in {nan} serves; warm layerwise "
          f"vs cold: same first token in {same}/{reps} reps, max |logit diff| {max(diffs):.3g} (max |logit| "
          f"{scale:.3g}; bf16 snapshot, another summation order)")
