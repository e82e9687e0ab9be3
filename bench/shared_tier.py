"""The node's shared L2 on a GPU: two engine processes, one host copy of each page.

    PYTHONPATH=. python bench/shared_tier.py [--tokens 8192] [--layers 32] [--reps 5]

Starts a real ``hicache serve`` (engine socket + shared segment, no L3) and
two engine processes, each a ``HiCache`` in service mode
(``storage.url = hicache+unix://``) over an 8B-shaped model (32 layers x 8 KV
heads x 128 dims, bf16). Engine A (a subprocess; on the second GPU when there
is one) prefills a prompt and backs it up into the segment (write-through:
reserve, the page-copy kernel L1 -> segment, commit). Engine B (this process)
then serves the same prompt: admission acquires the shared pages and the
layer-wise load back copies them segment -> L1 with the kernels, released
when done. Measured in the same run:

1. B's TTFT on A's prompt, against B computing a fresh prompt cold, and
   against an embedded ``HiCache`` with a private pinned L2 in the same
   process (the 15%-of-cold target is the embedded one's).
2. Page-copy GB/s between L1 and the segment (registered with
   ``cudaHostRegister``) against a private pinned ``HostPool``, interleaved,
   same random page ids, both directions.
3. Host bytes per cached page: service mode (engine-private + segment) against
   embedded mode, for the two engines of this run.

Prints markdown tables; exits 2 without CUDA.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import torch

from hicache.client.link import ServiceClient
from hicache.core.config import HiCacheConfig
from hicache.reference.model import ReferenceModel
from hicache.reference.model_spec import ModelSpec
from hicache.cache.hicache import HiCache
from hicache.core.layout import KVLayout
from hicache.memory.pools import HostPool


def spec_of(a) -> ModelSpec:
    if a.dry_run:
        return ModelSpec.tiny("mha", max_seq_len=a.tokens + 64)
    return ModelSpec(vocab=32000, hidden=4096, num_layers=a.layers, num_q_heads=32, mlp=14336, kind="mha",
                     num_kv_heads=8, head_dim=128, dtype="bfloat16", seed=0, max_seq_len=a.tokens + 64,
                     name="llama-8b-shaped")


def prompt_of(seed: int, a, vocab: int) -> list[int]:
    g = torch.Generator().manual_seed(1000 + seed)
    return torch.randint(1, vocab, (a.tokens,), generator=g).tolist()


def cache_of(a, layout: KVLayout, device: str, socket: str | None) -> HiCache:
    pages = a.tokens // a.page_size + 8
    cfg = HiCacheConfig.load(env={}, overrides={
        "storage.url": f"hicache+unix://{socket}" if socket else "", "pool.device": device,
        "pool.device_pages": str(pages * 2), "pool.host_pages": str(pages * 2),
        "policy.write_policy": "write_through", "policy.prefetch_policy": "wait_complete"})
    return HiCache(cfg, layout=layout)


def serve(hc: HiCache, model, rid: str, prompt: list[int]) -> dict:
    """One request, layer-wise: TTFT (admission to first token on the host)."""
    _sync()
    t0 = time.perf_counter()
    req = hc.new_request(rid, prompt)
    adm = hc.admit(req)
    t_admit = time.perf_counter() - t0
    start = req.computed_tokens
    req.alloc(len(prompt) - start)
    slots = hc.device_pool.slot_ids(req.pages)[:len(prompt)]
    out = model.forward_chunk(hc.device_pool, prompt[start:], start, slots, draft=False,
                              before_layer=adm.wait_layer)
    enq = time.perf_counter() - t0
    ev = adm.loads[0].transfer.cuda_event if adm.loads else None
    if ev is not None:  # everything is enqueued: timing the load's end changes nothing
        ev.synchronize()
    loaded = time.perf_counter() - t0
    first = int(out.logits_last.argmax())
    ttft = time.perf_counter() - t0
    req.commit()
    req.finish()
    hc.drain()
    return {"ttft": ttft, "admit": t_admit, "enq": enq, "loaded": loaded, "hit": start, "host": adm.host_tokens, "first": first,
            "logits": out.logits_last.float()}


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def reset(hc: HiCache) -> None:
    hc.drain()
    hc.evict(10**9)  # the next hit must come from L2
    hc.check_integrity()


# ------------------------------------------------------------------ engine A
def engine_a(a) -> int:
    """Prefill prompts named on stdin (one seed per line) and back them up to the segment."""
    spec = spec_of(a)
    layout = spec.kv_layout(a.page_size, "page_first")
    model = ReferenceModel(spec, device=a.device, attention="sdpa", draft=False)
    hc = cache_of(a, layout, a.device, a.socket)
    for line in sys.stdin:
        seed = int(line)
        s = serve(hc, model, f"a{seed}", prompt_of(seed, a, spec.vocab))
        reset(hc)
        st = hc.stats().tiers
        print(json.dumps({"seed": seed, "hit": s["hit"], "backup_pages": st.backup_pages,
                          "first": s["first"], "private_l2_bytes": hc.private_host_bytes}), flush=True)
    hc.close()
    return 0


# ------------------------------------------------------------------ service
def start_service(a, layout: KVLayout, d: Path) -> tuple[subprocess.Popen, str]:
    sock, shm = str(d / "e.sock"), f"hcbench-{uuid.uuid4().hex[:8]}"
    lines = ["[model]"] + [f"{k} = {json.dumps(v)}" for k, v in layout.to_dict().items()]
    lines += ["[pool]", f"host_pages = {(a.tokens // a.page_size + 8) * 2}", "[service]",
              f"socket_path = {json.dumps(sock)}", f"shm_name = {json.dumps(shm)}", "port = 0",
              "[storage]", 'url = ""']
    (d / "h.toml").write_text("\n".join(lines) + "\n")
    log = open(d / "serve.log", "w")
    p = subprocess.Popen([sys.executable, "-m", "hicache.node.server", "--config", str(d / "h.toml")],
                         stdout=log, stderr=log)
    deadline = time.monotonic() + 120
    while True:
        if p.poll() is not None:
            raise SystemExit(f"hicache serve exited: {(d / 'serve.log').read_text()[-3000:]}")
        try:
            ServiceClient(sock, layout, timeout=5, pin=False).close()
            return p, sock
        except (FileNotFoundError, ConnectionRefusedError):
            if time.monotonic() > deadline:
                raise SystemExit("hicache serve not ready after 120 s")
            time.sleep(0.1)


# ------------------------------------------------------------------ copies
def copy_rates(hc: HiCache, layout: KVLayout, pages: int, reps: int) -> list[list[str]]:
    """GB/s of the page-copy kernel: L1 <-> segment vs L1 <-> private pinned pool."""
    from hicache.kernels.page_copy import copy_pages
    seg = hc.shared.pool
    private = HostPool(layout, seg.num_pages)
    assert private.pinned
    c = hc.shared.client
    mine = c.reserve(pages)  # D2H writes only into pages this engine reserved
    try:
        g = torch.Generator().manual_seed(7)
        dev = torch.randperm(hc.device_pool.num_pages, generator=g)[:pages].tolist()
        nbytes = pages * layout.page_bytes
        res: dict[tuple[str, str], list[float]] = {}
        for _ in range(reps):
            for name, host, ids in (("segment", seg, mine), ("private pinned", private, mine)):
                for d, (src, dst, s, t) in (("H2D", (host, hc.device_pool, ids, dev)),
                                            ("D2H", (hc.device_pool, host, dev, ids))):
                    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    e0.record()
                    copy_pages(src, dst, s, t)
                    e1.record()
                    e1.synchronize()
                    res.setdefault((name, d), []).append(nbytes / (e0.elapsed_time(e1) * 1e-3) / 1e9)
        # value check: what went to the segment comes back to other L1 pages
        back = dev[::-1]
        copy_pages(hc.device_pool, seg, dev, mine)
        copy_pages(seg, hc.device_pool, mine, back)
        torch.cuda.synchronize()
        for buf in hc.device_pool.buffers:
            v = buf.view(buf.shape[0], -1) if buf.dim() > 1 else buf
            assert torch.equal(v[dev], v[back]) or buf.shape[0] != hc.device_pool.num_pages
    finally:
        c.cancel(mine)
    rows = []
    for d in ("H2D", "D2H"):
        s, p = statistics.median(res[("segment", d)]), statistics.median(res[("private pinned", d)])
        rows.append([d, f"{s:.1f}", f"{p:.1f}", f"{s / p:.1%}"])
    return rows


# ------------------------------------------------------------------ engine B
def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--copy-pages", type=int, default=512)
    ap.add_argument("--dry-run", action="store_true",
                    help="tiny model on the CPU, no copy-rate table: checks the harness, measures nothing")
    ap.add_argument("--role", default="b", choices=["a", "b"], help=argparse.SUPPRESS)
    ap.add_argument("--socket", help=argparse.SUPPRESS)
    ap.add_argument("--device", default="cuda:0", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.dry_run:
        a.device, a.page_size, a.tokens = "cpu", 4, min(a.tokens, 64)
    elif not torch.cuda.is_available():
        print("bench/shared_tier.py needs a CUDA GPU (or --dry-run)", file=sys.stderr)
        return 2
    if a.role == "a":
        return engine_a(a)
    spec = spec_of(a)
    layout = spec.kv_layout(a.page_size, "page_first")
    d = Path(tempfile.mkdtemp(prefix="hcst", dir="/tmp"))
    srv, sock = start_service(a, layout, d)
    dev_b = "cpu" if a.dry_run else "cuda:0"
    dev_a = dev_b if a.dry_run or torch.cuda.device_count() < 2 else "cuda:1"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[1]),
                                                       os.environ.get("PYTHONPATH", "")])}
    eng_a = subprocess.Popen([sys.executable, __file__, "--role", "a", "--socket", sock, "--device", dev_a,
                              "--tokens", str(a.tokens), "--layers", str(a.layers),
                              "--page-size", str(a.page_size)] + (["--dry-run"] if a.dry_run else []),
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)

    def a_prefill(seed: int) -> dict:
        eng_a.stdin.write(f"{seed}\n")
        eng_a.stdin.flush()
        line = eng_a.stdout.readline()
        if not line:
            raise SystemExit(f"engine A exited ({eng_a.wait()})")
        return json.loads(line)

    try:
        model = ReferenceModel(spec, device=dev_b, attention="sdpa", draft=False)
        hc = cache_of(a, layout, dev_b, sock)
        emb = cache_of(a, layout, dev_b, None)
        want = (a.tokens - 1) // a.page_size * a.page_size
        # warm-up: kernels, allocator, both caches
        a_prefill(-1)
        serve(hc, model, "w1", prompt_of(-1, a, spec.vocab))
        reset(hc)
        serve(emb, model, "w2", prompt_of(-2, a, spec.vocab))
        reset(emb)
        serve(emb, model, "w3", prompt_of(-2, a, spec.vocab))
        reset(emb)
        emb.evict_host(10**9)
        runs: dict[str, list[dict]] = {"cold": [], "shared": [], "emb_cold": [], "embedded": []}
        same_first, diffs = 0, []
        for i in range(a.reps):
            pa = a_prefill(i)
            s = serve(hc, model, f"s{i}", prompt_of(i, a, spec.vocab))
            assert s["hit"] == s["host"] == want, (s["hit"], s["host"], want)
            runs["shared"].append(s)
            reset(hc)
            c = serve(hc, model, f"c{i}", prompt_of(100 + i, a, spec.vocab))
            assert c["hit"] == 0
            runs["cold"].append(c)
            reset(hc)
            ec = serve(emb, model, f"ec{i}", prompt_of(i, a, spec.vocab))  # cold: also the value reference
            runs["emb_cold"].append(ec)
            reset(emb)
            e = serve(emb, model, f"e{i}", prompt_of(i, a, spec.vocab))
            assert e["hit"] == e["host"] == want
            runs["embedded"].append(e)
            reset(emb)
            emb.evict_host(10**9)
            same_first += s["first"] == ec["first"] == pa["first"] == e["first"]
            diffs.append((s["logits"] - ec["logits"]).abs().max().item())
        ms = {k: statistics.median(x["ttft"] for x in v) * 1e3 for k, v in runs.items()}
        adm = {k: statistics.median(x["admit"] for x in v) * 1e3 for k, v in runs.items()}
        where = "CPU (dry run)" if a.dry_run else f"{torch.cuda.get_device_name()} x{torch.cuda.device_count()}"
        print(f"# Shared L2 on {where}, torch "
              f"{torch.__version__}: {spec.num_layers} layers x 8 KV heads x 128 dims bf16, {a.tokens}-token prompt, "
              f"page {a.page_size}, {a.reps} reps (median); engine A on {dev_a}, engine B on {dev_b}\n")
        print("| engine B serves | TTFT ms | admit ms | share of cold |")
        print("|---|---:|---:|---:|")
        print(f"| cold (full prefill, service mode) | {ms['cold']:.1f} | {adm['cold']:.2f} | 100% |")
        print(f"| A's prompt from the shared segment (layer-wise) | {ms['shared']:.1f} | {adm['shared']:.2f} | "
              f"{ms['shared'] / ms['cold']:.1%} |")
        print(f"| cold, embedded HiCache | {ms['emb_cold']:.1f} | {adm['emb_cold']:.2f} | "
              f"{ms['emb_cold'] / ms['cold']:.1%} |")
        print(f"| its own prompt from a private pinned L2 (embedded, layer-wise) | {ms['embedded']:.1f} | "
              f"{adm['embedded']:.2f} | {ms['embedded'] / ms['emb_cold']:.1%} of its cold |")
        print("\nper rep, ms (TTFT / forward enqueued by the host / load landed):")
        for k, v in runs.items():
            print(f"- {k}: " + ", ".join(f"{x['ttft'] * 1e3:.1f} / {x['enq'] * 1e3:.1f} / {x['loaded'] * 1e3:.1f}"
                                         for x in v))
        print(f"same first token (A cold, B shared, B cold, embedded warm) in {same_first}/{a.reps} reps; "
              f"max |logit diff| shared vs cold {max(diffs):.3g}")
        share = ms["shared"] / ms["cold"]
        print(f"target shared <= 15% of cold: {'met' if share <= 0.15 else 'MISSED'} ({share:.1%})\n")

        rows = [] if a.dry_run else copy_rates(hc, layout, min(a.copy_pages, hc.shared.pool.num_pages // 2), 7)
        print(f"| page copy ({a.copy_pages} random pages of {layout.page_bytes / 2**20:.1f} MiB) "
              "| segment GB/s | private pinned GB/s | segment / private |")
        print("|---|---:|---:|---:|")
        for r in rows:
            print("| " + " | ".join(r) + " |")

        seg_pages = hc.shared.pool.num_pages
        seg_bytes = hc.shared.client._segment.size
        pa_last = a_prefill(a.reps + 1)
        emb_per = emb.host_pool.nbytes() / emb.host_pool.num_pages
        svc_private = hc.private_host_bytes + pa_last["private_l2_bytes"]
        print("\n| host memory per cached page (2 engines sharing one prefix) | bytes | vs one page |")
        print("|---|---:|---:|")
        pb = layout.page_bytes
        print(f"| embedded: each engine's private L2 holds a copy | {2 * emb_per:,.0f} | {2 * emb_per / pb:.2f}x |")
        print(f"| service mode: engines' private L2 ({svc_private} bytes in all) + the segment "
              f"({seg_bytes:,} bytes / {seg_pages} pages) | {seg_bytes / seg_pages:,.0f} | "
              f"{seg_bytes / seg_pages / pb:.3f}x |")
        hc.close()
        emb.close()
    finally:
        if eng_a.poll() is None:
            eng_a.stdin.close()
            eng_a.wait(60)
        srv.send_signal(signal.SIGTERM)
        srv.wait(60)
        shutil.rmtree(d, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
