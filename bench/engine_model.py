"""Reference-model throughput: 8B-shaped sdpa prefill/decode on a GPU, or the tiny
exact (bit-reproducible) model on the CPU. Model only: no cache in the loop.

    PYTHONPATH=. python bench/engine_model.py gpu [--tokens 8192] [--layers 32] [--reps 3]
    PYTHONPATH=. python bench/engine_model.py cpu [--tokens 1024] [--threads 1]

Prints a table.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from hicache.reference.model import ReferenceModel
from hicache.reference.model_spec import ModelSpec
from hicache.memory.pools import DevicePool


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _time(fn, dev: torch.device, reps: int) -> float:
    fn()  # warm-up
    out = []
    for _ in range(reps):
        _sync(dev)
        t = time.perf_counter()
        fn()
        _sync(dev)
        out.append(time.perf_counter() - t)
    return statistics.median(out)


def run(spec: ModelSpec, dev: torch.device, attention: str, tokens: int, page: int, reps: int, draft: bool) -> None:
    t = time.perf_counter()
    model = ReferenceModel(spec, device=dev, attention=attention, draft=draft)
    _sync(dev)
    build_s = time.perf_counter() - t
    pages = tokens // page + 2
    pool = DevicePool(spec.kv_layout(page, draft_layers=int(draft)), pages, device=dev)
    slots = pool.slot_ids(list(range(pages))).to(dev)
    toks = torch.randint(1, spec.vocab, (tokens + 1,), generator=torch.Generator().manual_seed(0)).to(dev)
    cold = _time(lambda: model.forward_chunk(pool, toks[:tokens], 0, slots, draft=draft), dev, reps)
    warm_n = page * 4
    warm = _time(lambda: model.forward_chunk(pool, toks[tokens - warm_n:tokens], tokens - warm_n, slots,
                                             draft=draft), dev, reps)
    dec = _time(lambda: model.decode_step(pool, 7, tokens, slots, draft=draft), dev, reps)
    flops = 2 * spec.num_params() * tokens
    rows = [("build weights", f"{build_s:.2f} s", ""),
            (f"prefill {tokens} tokens (one chunk)", f"{cold * 1e3:.1f} ms",
             f"{flops / cold / 1e12:.0f} TFLOP/s (weights only)" if dev.type == "cuda" else ""),
            (f"prefill last {warm_n} tokens after a {tokens - warm_n}-token hit", f"{warm * 1e3:.1f} ms", ""),
            (f"decode step at position {tokens}", f"{dec * 1e3:.2f} ms", "")]
    print(f"\n{spec.model_id} ({spec.num_params() / 1e6:,.1f} M params, {spec.dtype}, attention={attention}, "
          f"draft={draft}, page {page}) on {torch.cuda.get_device_name(dev) if dev.type == 'cuda' else 'cpu'}")
    print(f"| {'what':<52} | {'time':>10} | note")
    print(f"|{'-' * 54}|{'-' * 12}|------")
    for what, tm, note in rows:
        print(f"| {what:<52} | {tm:>10} | {note}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("where", choices=["gpu", "cpu"])
    ap.add_argument("--tokens", type=int)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--page", type=int, default=16)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--draft", action="store_true")
    a = ap.parse_args()
    if a.where == "gpu":
        spec = ModelSpec.llama3_8b(num_layers=a.layers)
        run(spec, torch.device("cuda"), "sdpa", a.tokens or 8192, a.page, a.reps, a.draft)
    else:
        torch.set_num_threads(a.threads)
        spec = ModelSpec(vocab=512, hidden=64, num_layers=4, num_q_heads=4, num_kv_heads=2, head_dim=32, mlp=128)
        run(spec, torch.device("cpu"), "exact", a.tokens or 1024, a.page, a.reps, a.draft)


if __name__ == "__main__":
    main()
