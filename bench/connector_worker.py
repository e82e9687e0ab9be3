"""The vLLM connector's worker path on a GPU: pinned L2 pages <-> vLLM-layout L1 blocks.

    PYTHONPATH=. python bench/connector_worker.py            # H200: under 4 minutes

1. GB/s, per shape (llama-3.1-8b, qwen3-32b, deepseek-v3 MLA, gpt-oss-120b's two groups,
   llama-3.1-8b fp8, deepseek-v3 FlashMLA fp8) and vLLM KV layout (LBNHC: FlashAttention's
   default; LBHNC: FlashInfer on SM100 / CPU): load (L2 -> L1, all layers in one launch, and
   one launch per layer as a layer-wise load issues them) and save (L1 -> L2) of scattered
   blocks, against a contiguous pinned copy of the same bytes in the same run.
2. Layer-wise TTFT of an 8K prompt (bench/ttft.py's 8B-shaped model, attending over the
   vLLM-layout blocks) whose KV comes from L2 through this path, against cold.
Medians of --reps runs with their spread (min-max). Without a GPU: a tiny smoke run.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from hicache.kernels.page_copy import copy_pages
from hicache.memory.paged_kv import adopt_paged_kv, vllm_kv_caches
from hicache.memory.pools import HostPool
from hicache.reference.model import ReferenceModel
from hicache.reference.model_spec import ModelSpec
from hicache.transfer.engine import TransferController
from tests.memory.paged_cases import cases, fill, group_planes

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"


def timed(fn, reps: int) -> list[float]:
    """Seconds of ``fn`` per run (CUDA events on a GPU), after one warm-up run."""
    fn()
    out = []
    for _ in range(reps):
        if CUDA:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            out.append(a.elapsed_time(b) / 1e3)
        else:
            t = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t)
    return out


def rate(nbytes: int, secs: list[float]) -> tuple[float, float, float]:
    """(median, min, max) GB/s."""
    r = [nbytes / s / 1e9 for s in secs]
    return statistics.median(r), min(r), max(r)


def fmt(r: tuple[float, float, float], ref: tuple[float, float, float] | None = None) -> str:
    s = f"{r[0]:.1f} [{r[1]:.1f}-{r[2]:.1f}]"
    return s if ref is None else f"{s} ({r[0] / ref[0]:.0%})"


def bandwidth(case, kv_layout: str, host_layout: str, mib: int, reps: int, host_buf: torch.Tensor) -> list[str]:
    """One table row: load / layer-wise load / save of scattered blocks vs the contiguous copy."""
    lay = case.layout.replace(host_layout=host_layout)
    n = max(2, (mib << 20) // lay.page_bytes) // case.groups * case.groups  # blocks moved per copy
    kv = vllm_kv_caches(lay, 2 * n, kv_layout, groups=case.groups, device=DEV)
    fill(kv, seed=1)
    pool = adopt_paged_kv(lay, kv)
    host = HostPool(lay, 2 * n, buffer=host_buf)
    g = torch.Generator().manual_seed(0)
    blocks, pages = torch.randperm(2 * n, generator=g)[:n], torch.randperm(2 * n, generator=g)[:n]
    per = n // case.groups
    split = [(group_planes(lay, k, case.groups), blocks[k * per:(k + 1) * per].to(DEV),
              pages[k * per:(k + 1) * per].to(DEV)) for k in range(case.groups)]
    layers = [[s.index for s in lay.planes if s.layer == i and not s.draft] for i in range(lay.num_layers)]
    draft = [s.index for s in lay.planes if s.draft]

    def save():
        for planes, b, p in split:
            copy_pages(pool, host, b, p, planes=planes)

    def load():
        for planes, b, p in split:
            copy_pages(host, pool, p, b, planes=planes)

    def load_layerwise():  # one launch per layer (and the draft planes), as a layer-wise load
        for planes, b, p in split:
            for step in (*layers, draft):
                mine = [j for j in step if j in planes]
                if mine:
                    copy_pages(host, pool, p, b, planes=mine)
    save()
    before = {k: t.view(torch.uint8)[blocks].clone() for k, t in list(kv.items())[:3]}
    for t in kv.values():
        t.view(torch.uint8)[blocks.to(DEV)] = 0
    load()
    assert all(torch.equal(kv[k].view(torch.uint8)[blocks], v) for k, v in before.items()), "round trip differs"
    # Each group moves only its own layers' planes: gpt-oss's two groups alias one allocation,
    # so n blocks split over them carry n x (one group's page share), not n whole pages.
    nbytes = sum(len(b) * sum(lay.planes[j].page_bytes for j in planes) for planes, b, _ in split)
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=CUDA)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=DEV)
    h2d = rate(nbytes, timed(lambda: dst.copy_(src, non_blocking=True), reps))
    d2h = rate(nbytes, timed(lambda: src.copy_(dst, non_blocking=True), reps))
    ld, lw, sv = (rate(nbytes, timed(f, reps)) for f in (load, load_layerwise, save))
    return [f"| {case.name} | {kv_layout} | {host_layout} | {n} x {lay.page_bytes >> 10} KiB | {fmt(h2d)} | "
            f"{fmt(ld, h2d)} | {fmt(lw, h2d)} | {fmt(d2h)} | {fmt(sv, d2h)} |"]


def serve(model, pool, tc, prompt: list[int], blocks: list[int], mode: str, hit: int) -> tuple[float, int, torch.Tensor]:
    """One request's TTFT (s), first token and last logits: ``cold`` computes every token;
    ``serial`` loads the first ``hit`` tokens' pages from L2 (pages 0..), then computes the rest;
    ``layerwise`` computes the rest while the load runs, layer i waiting for its own pages."""
    ps = pool.page_size
    slots = pool.slot_ids(blocks)[:len(prompt)].to(DEV)
    if CUDA:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    start, hook = 0, None
    if mode != "cold":
        h = tc.load_back(list(range(hit // ps)), blocks[:hit // ps])
        start = hit
        if mode == "serial":
            h.wait()
        else:
            hook = h.wait_layer
    o = model.forward_chunk(pool, prompt[start:], start, slots, draft=False, before_layer=hook)
    first = int(o.logits_last.argmax())  # on the host: the first token
    dt = time.perf_counter() - t0
    tc.wait_all()
    tc.finished()
    return dt, first, o.logits_last.float()


def ttft(tokens: int, layers: int, reps: int, kv_layout: str) -> list[str]:
    """Cold prefill into vLLM-layout blocks; save them to L2; warm = layer-wise load into other
    blocks beside the forward of the last page (and serial: whole load, then the forward)."""
    big = CUDA
    spec = ModelSpec(vocab=32000, hidden=4096 if big else 256, num_layers=layers, num_q_heads=32 if big else 4,
                     mlp=14336 if big else 512, kind="mha", num_kv_heads=8 if big else 2,
                     head_dim=128 if big else 64, dtype="bfloat16", seed=0, max_seq_len=tokens + 64,
                     name="llama-8b-shaped")
    model = ReferenceModel(spec, device=DEV, attention="sdpa", draft=False)
    ps, n = 16, tokens // 16 + 1
    lay = spec.kv_layout(ps, "page_first")
    kv = vllm_kv_caches(lay, 2 * n, kv_layout, device=DEV)
    pool = adopt_paged_kv(lay, kv)
    tc = TransferController(pool, HostPool(lay, n))
    g = torch.Generator().manual_seed(0)
    hit = (tokens - 1) // ps * ps
    runs: dict[str, list[float]] = {"cold": [], "serial": [], "layerwise": []}
    firsts, diffs = [], []
    for rep in range(reps + 1):  # rep 0 warms up (kernels, graphs)
        prompt = torch.randint(1, spec.vocab, (tokens,), generator=g).tolist()
        a, b = torch.randperm(2 * n, generator=g)[:n].tolist(), torch.randperm(2 * n, generator=g)[:n].tolist()
        out = {}
        for mode in runs:
            dt, first, logits = out[mode] = serve(model, pool, tc, prompt, a if mode == "cold" else b, mode, hit)
            if rep:
                runs[mode].append(dt)
            if mode == "cold":  # save: the cold blocks' pages to L2 pages 0..
                tc.backup(a[:hit // ps], list(range(hit // ps)))
                tc.wait_all()
                tc.finished()
            for t in kv.values():  # the next warm run must read what its load wrote, nothing older
                t.view(torch.uint8)[b] = 0
        if rep:
            firsts.append(out["cold"][1] == out["serial"][1] == out["layerwise"][1])
            diffs.append((out["layerwise"][2] - out["cold"][2]).abs().max().item())
    tc.close()
    c = statistics.median(runs["cold"])
    rows = [f"| {m} | {statistics.median(v) * 1e3:.1f} [{min(v) * 1e3:.1f}-{max(v) * 1e3:.1f}] | "
            f"{statistics.median(v) / c:.1%} |" for m, v in runs.items()]
    rows.append(f"\nsame first token cold/serial/layerwise in {sum(firsts)}/{reps} reps; max |logit diff| "
                f"layerwise vs cold {max(diffs):.3g}; {hit} of {tokens} tokens loaded "
                f"({hit * lay.token_bytes / 2**30:.2f} GiB), {kv_layout} blocks, page_first L2")
    return rows


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=256 if CUDA else 2, help="bytes moved per timed copy")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--tokens", type=int, default=8192 if CUDA else 256)
    ap.add_argument("--layers", type=int, default=32 if CUDA else 2)
    ap.add_argument("--shapes", default="", help="comma-separated case names (default: all)")
    ap.add_argument("--skip-ttft", action="store_true")
    a = ap.parse_args()
    want = [s for s in a.shapes.split(",") if s]
    picked = [c for c in cases() if not want or c.name in want]
    if not CUDA:
        print("(no GPU: a smoke run at tiny sizes on the CPU, not a measurement)\n")
        picked = [c._replace(layout=c.layout.replace(num_layers=2 * c.groups, draft_layers=0)) for c in picked]
    name = torch.cuda.get_device_name() if CUDA else "CPU"
    print(f"# connector worker path, {name}, torch {torch.__version__}, block 16, {a.mib} MiB per copy, "
          f"{a.reps} reps: median [min-max] GB/s (share of the contiguous copy)\n")
    print("| shape | vLLM layout | L2 layout | blocks moved | contiguous H2D | load | load, launch per layer "
          "| contiguous D2H | save |")
    print("|---|---|---|---|---:|---:|---:|---:|---:|")
    most = max(HostPool.nbytes_for(c.layout.replace(host_layout=h), 2 * max(2, (a.mib << 20) // c.layout.page_bytes))
               for c in picked for h in ("layer_first", "page_first"))
    host_buf = torch.zeros(most, dtype=torch.uint8, pin_memory=CUDA)
    for c in picked:
        for kv_layout, host_layout in (("LBNHC", "page_first"), ("LBNHC", "layer_first"), ("LBHNC", "page_first")):
            for row in bandwidth(c, kv_layout, host_layout, a.mib, a.reps, host_buf):
                print(row, flush=True)
    del host_buf
    if not a.skip_ttft:
        print(f"\n# layer-wise TTFT, {a.tokens}-token prompt, {a.layers} layers (bench/ttft.py's model), "
              f"{a.reps} reps: median [min-max] ms\n")
        print("| path | TTFT ms | share of cold |")
        print("|---|---:|---:|")
        for row in ttft(a.tokens, a.layers, a.reps, "LBNHC"):
            print(row, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
