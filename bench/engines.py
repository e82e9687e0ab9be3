"""vLLM's scheduler path with a CPU offload tier too small for the working set,
with and without hicache's tier under it: hit tokens and bytes moved.

Runs vLLM 0.33.0's real Scheduler, OffloadingConnector and
TieringOffloadingManager through its test RequestRunner (see
tests/integrations/vllm/runner.py; the GPU copy is the only mock). A working
set of ``--prompts`` prompts of ``--blocks`` 16-token blocks is replayed
``--rounds`` times; the CPU tier holds ``--cpu-chunks`` chunks and the GPU
``--gpu-blocks`` blocks, so every replay misses both unless a tier below keeps it.

    bash scripts/setup-engines.sh vllm
    PYTHONPATH=. .venv-vllm/bin/python bench/engines.py [--redis redis://127.0.0.1:6379/0]

SGLang section (bench/engines_sglang.py: HiCacheBackend against SGLang's HiCacheFile at
every listed model's page sizes; redis:// page_first against layer_first):

    PYTHONPATH=. .venv-sglang/bin/python bench/engines.py sglang [--redis URL] [--rounds 7]
"""
from __future__ import annotations

import argparse
import os
import pathlib
import sys
import tempfile
import time
import types

ROOT = pathlib.Path(__file__).resolve().parents[1]
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HOME", str(ROOT / ".engines" / "hf"))
# ``tests`` spans this checkout's tests and vLLM's (as in tests/integrations/vllm/conftest.py).
_pkg = types.ModuleType("tests")
_pkg.__path__ = [str(ROOT / "tests"), str(ROOT / ".engines" / "vllm-0.33.0" / "tests")]
sys.modules["tests"] = _pkg


def run(url: str | None, args) -> dict:
    from tests.integrations.vllm.runner import BLOCK, make_runner, prompt, settle, tiering
    from tests.v1.kv_connector.unit.utils import EOS_TOKEN_ID

    runner = make_runner(url, f"hicache-bench-engines:{time.time_ns()}:", cpu_chunks=args.cpu_chunks,
                         gpu_blocks=args.gpu_blocks)
    loaded = stored = 0
    t0 = time.perf_counter()
    for _ in range(args.rounds):
        for seed in range(args.prompts):
            runner.new_request(prompt(seed + 1, args.blocks))
            runner._run([EOS_TOKEN_ID], True)
            settle(runner)
            loaded += sum(len(t.gpu_blocks) for t in runner.completed_loads)
            stored += sum(len(t.gpu_blocks) for t in runner.completed_stores)
            runner.completed_loads.clear()
            runner.completed_stores.clear()
    elapsed = time.perf_counter() - t0
    manager = tiering(runner)
    out = {"hit_tokens": loaded * BLOCK, "stored_chunks": stored, "l3_loaded": 0, "l3_written_bytes": 0,
           "l3_read_bytes": 0, "elapsed": elapsed, "row_bytes": manager.primary_tier.get_kv_memoryview().shape[1]}
    for tier in manager.secondary_tiers:
        s = tier.stats()
        tier.check_integrity()
        out.update(l3_loaded=s.loaded, l3_written_bytes=s.bytes_written, l3_read_bytes=s.bytes_read)
        tier.storage.clear()
    manager.shutdown()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--redis", default="redis://127.0.0.1:6379/0")
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--blocks", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--cpu-chunks", type=int, default=8)
    ap.add_argument("--gpu-blocks", type=int, default=8)
    args = ap.parse_args()

    # CPUAttentionBackend declares MultipleOf(32) block sizes; RequestRunner uses 16 (vLLM's own
    # kv_connector unit conftest applies the same patch).
    from vllm.v1.attention.backend import MultipleOf
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
    CPUAttentionBackend.get_supported_kernel_block_sizes = staticmethod(lambda kv_cache_spec=None: [MultipleOf(16)])

    total = args.prompts * args.blocks * 16 * args.rounds
    with tempfile.TemporaryDirectory() as d:
        rows = [("vLLM CPU tier only", run(None, args)),
                ("+ HiCacheTier file://", run(f"file://{d}/l3", args)),
                ("+ HiCacheTier redis://", run(args.redis, args))]
    print(f"working set {args.prompts} prompts x {args.blocks} blocks of 16 tokens, {args.rounds} rounds "
          f"({total:,} prompt tokens); CPU tier {args.cpu_chunks} chunks, GPU {args.gpu_blocks} blocks")
    print(f"{'run':<24} {'hit tokens':>10} {'hit rate':>8} {'from L3':>7} {'L3 written':>10} {'L3 read':>9} "
          f"{'time':>6}")
    for name, r in rows:
        print(f"{name:<24} {r['hit_tokens']:>10,} {r['hit_tokens'] / total:>8.1%} {r['l3_loaded'] * 16:>7,} "
              f"{r['l3_written_bytes'] / 1024:>8.0f} K {r['l3_read_bytes'] / 1024:>7.0f} K {r['elapsed']:>5.1f}s")
    print(f"(one chunk = 16 tokens = {rows[0][1]['row_bytes']} bytes in vLLM's CPU region, padded to its alignment)")


if __name__ == "__main__":
    if sys.argv[1:2] == ["sglang"]:  # the SGLang section runs in .venv-sglang
        sys.path.insert(0, str(ROOT / "bench"))
        import engines_sglang
        engines_sglang.main(sys.argv[2:])
    else:
        main()
