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
        out.update(l3_loaded=s.hits, l3_written_bytes=s.bytes_written, l3_read_bytes=s.bytes_read)
        tier.storage.clear()
    manager.shutdown()
    return out


# ----------------------------------------------------------------------------- tiers side by side
# HiCacheTier against vLLM's built-in ``fs`` tier (issue 24, item 6): both built by
# vLLM's TieringOffloadingSpec over the same kind of primary region, store and
# load of whole chunks at real row sizes (16 KiB to 8 MiB), in one run:
#
#     PYTHONPATH=. .venv-vllm/bin/python bench/engines.py --tiers [--reps 5] [--rows 16384,65536]
TIER_ROWS = (16 << 10, 64 << 10, 512 << 10, 2 << 20, 8 << 20)


def _tier_manager(row: int, chunks: int, tier_cfg: dict, engine_id: str = "test-engine"):
    from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

    from tests.v1.kv_offload.conftest import make_offloading_config
    cfg = make_offloading_config(spec_name="TieringOffloadingSpec", cpu_bytes_to_use=chunks * row, engine_id=engine_id,
                                 worker_kv_bytes_per_block=row, extra_config={"secondary_tiers": [tier_cfg]})
    return TieringOffloadingSpec(cfg).get_manager()


def _wait_jobs(tier, ids: set[int]) -> bool:
    ok = True
    while ids:
        for r in tier.get_finished_jobs():
            ids.discard(r.job_id)
            ok &= r.success
        if ids:
            time.sleep(0.0002)
    return ok


def _tier_round(tier, arr, view_rows: int, rep: int, job_chunks: int) -> tuple[float, float]:
    """Store every primary row under fresh keys, then load them all back; (store s, load s)."""
    import numpy as np
    from vllm.v1.kv_offload.base import ReqContext, make_offload_key
    from vllm.v1.kv_offload.tiering.base import TransferJob

    ctx = ReqContext(req_id=f"bench-{rep}")
    ks = [make_offload_key(f"r{rep}-c{c}".encode(), 0) for c in range(view_rows)]
    jobs = [(j, list(range(s, min(s + job_chunks, view_rows)))) for j, s in enumerate(range(0, view_rows, job_chunks))]
    want = arr.copy() if rep == 0 else None
    t0 = time.perf_counter()
    for j, cs in jobs:
        tier.submit_store(TransferJob(job_id=j, keys=[ks[c] for c in cs], chunk_ids=np.array(cs), is_promotion=False,
                                      req_context=ctx))
    assert _wait_jobs(tier, {j for j, _ in jobs}), "a store job failed"
    t_store = time.perf_counter() - t0
    arr[:] = 0
    t0 = time.perf_counter()
    base = len(jobs)
    for j, cs in jobs:
        tier.submit_load(TransferJob(job_id=base + j, keys=[ks[c] for c in cs], chunk_ids=np.array(cs),
                                     is_promotion=True, req_context=ctx))
    assert _wait_jobs(tier, {base + j for j, _ in jobs}), "a load job failed"
    t_load = time.perf_counter() - t0
    if want is not None:
        assert np.array_equal(arr, want), "loaded rows differ from stored rows"
    return t_store, t_load


def row_bench(row: int, setups: list, reps: int, total_bytes: int, job_chunks: int) -> dict[str, tuple]:
    """Per tier: median store and load GB/s at ``row`` bytes per chunk, and the medians of
    its per-round ratios to the round's vLLM fs on the same medium. Every tier is built
    at once (its own engine id, so its own primary region) and the rounds interleave,
    the order reversed every round: load on a shared box drifts between rounds, not
    between the tiers of one round."""
    import statistics

    import numpy as np
    chunks = max(8, min(4096, total_bytes // row))
    managers = {name: _tier_manager(row, chunks, cfg, engine_id=f"bench-{i}-{os.getpid()}")
                for i, (name, cfg, _) in enumerate(setups)}
    cleans = {name: clean for name, _, clean in setups}
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in managers}
    try:
        arrs = {}
        for name, m in managers.items():
            view = m.primary_tier.get_kv_memoryview()
            arrs[name] = np.frombuffer(view, dtype=np.uint8).reshape(view.shape[0], -1)[:, :row]
        order = list(managers)
        for rep in range(reps):
            for name in order if rep % 2 == 0 else order[::-1]:
                (tier,) = managers[name].secondary_tiers
                arr = arrs[name]
                arr[:] = np.random.default_rng(row + rep).integers(0, 256, size=arr.shape, dtype=np.uint8)
                a, b = _tier_round(tier, arr, arr.shape[0], rep, job_chunks)
                times[name].append((arr.shape[0] * row / a / 1e9, arr.shape[0] * row / b / 1e9))
                cleans[name](tier)
    finally:
        for m in managers.values():
            m.shutdown()
    out = {}
    for name, v in times.items():
        ref = times.get(f"vLLM fs ({'disk' if '(disk)' in name else 'tmpfs'})")
        base = times.get(name.replace(" MAC", "")) if " MAC" in name else None
        paired = [statistics.median(x[i] / r[i] for x, r in zip(v, against)) if against else float("nan")
                  for against in (ref, base) for i in (0, 1)]
        out[name] = (statistics.median(x[0] for x in v), statistics.median(x[1] for x in v), *paired)
    return out


def _private_redis(workdir: str):
    import shutil
    import socket
    import subprocess
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([shutil.which("redis-server") or "redis-server", "--port", str(port), "--save", "",
                             "--appendonly", "no", "--dir", workdir], stdout=subprocess.DEVNULL)
    for _ in range(200):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.1).close()
            break
        except OSError:
            time.sleep(0.02)
    return proc, f"redis://127.0.0.1:{port}/0"


def _tier_setups(media: dict[str, str], redis_url: str) -> list[tuple[str, dict, object]]:
    """(name, vLLM secondary_tiers entry, clean) per tier: vLLM fs and HiCacheTier file://
    on each medium, default and MAC'd, then HiCacheTier redis:// default and MAC'd."""
    import shutil

    from engines_corrupt import SECRET

    def hc(url: str, **kw) -> dict:
        return {"type": "HiCacheTier", "module_path": "hicache.integrations.vllm", "url": url, "probe_l3": False, **kw}

    def clean_hicache(tier):
        tier.storage.clear()

    out = []
    for medium, d in media.items():
        out += [(f"vLLM fs ({medium})", {"type": "fs", "root_dir": f"{d}/fs"},
                 lambda tier, root=f"{d}/fs": shutil.rmtree(root, ignore_errors=True)),
                (f"HiCacheTier file:// ({medium})", hc(f"file://{d}/hc"), clean_hicache),
                (f"HiCacheTier file:// MAC ({medium})", hc(f"file://{d}/hcm", auth_key=SECRET), clean_hicache)]
    return out + [("HiCacheTier redis://", hc(redis_url, timeout_ms=5000), clean_hicache),
                  ("HiCacheTier redis:// MAC", hc(redis_url, timeout_ms=5000, auth_key=SECRET), clean_hicache)]


def tiers_main(args) -> None:
    import shutil
    media = {"tmpfs": tempfile.mkdtemp(dir=args.tmpfs, prefix="hicache-bench-tiers-")}
    if args.disk:
        media["disk"] = tempfile.mkdtemp(dir=args.disk, prefix="hicache-bench-tiers-")
    proc, redis_url = (None, args.redis) if args.redis else _private_redis(media["tmpfs"])
    setups = _tier_setups(media, redis_url)
    if args.only:
        setups = [s for s in setups if any(o in s[0] for o in args.only.split(","))]
    rows = []
    try:
        if args.corrupt:
            from engines_corrupt import print_counts, vllm_corrupt
            cfgs = [(n, c) for n, c, _ in setups if "redis" not in n]
            return print_counts(f"vLLM tiers, {args.rows[0] // 1024} KiB rows",
                                vllm_corrupt(args.rows[0], cfgs, _tier_manager, _wait_jobs))
        for row in args.rows:
            rows.append((row, row_bench(row, setups, args.reps, args.total_mib << 20, args.job_chunks)))
            _print_tier_rows([rows[-1]], args, header=len(rows) == 1)
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait()
        for d in media.values():
            shutil.rmtree(d, ignore_errors=True)


def _print_tier_rows(rows, args, header: bool) -> None:
    """GB/s, and medians of per-round ratios: x fs = against vLLM fs on the same medium
    (redis: tmpfs), x def = MAC'd against the same tier without a MAC."""
    if header:
        print(f"store / load GB/s, medians of {args.reps} interleaved rounds; ~{args.total_mib} MiB per round, "
              f"jobs of {args.job_chunks} chunks; ratios: medians of per-round ratios", flush=True)
        print(f"{'row':>8} {'tier':<34} {'store':>6} {'load':>6} {'st x fs':>8} {'ld x fs':>8} "
              f"{'st x def':>8} {'ld x def':>8}", flush=True)
    for row, got in rows:
        for name, (s, ld, sf, lf, sd, lm) in got.items():
            mac = f"{sd:>7.2f}x {lm:>7.2f}x" if " MAC" in name else f"{'':>8} {'':>8}"
            print(f"{row // 1024:>6} K {name:<34} {s:>6.2f} {ld:>6.2f} {sf:>7.2f}x {lf:>7.2f}x {mac}", flush=True)


def tiers_entry() -> None:
    ap = argparse.ArgumentParser(description="HiCacheTier vs vLLM's fs tier: store/load GB/s at real row sizes")
    ap.add_argument("--tiers", action="store_true")
    ap.add_argument("--corrupt", action="store_true", help="count wrong bytes handed to vLLM per damage kind "
                    "(rows: the first of --rows)")
    ap.add_argument("--rows", type=lambda s: [int(x) for x in s.split(",")], default=list(TIER_ROWS))
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--total-mib", type=int, default=64, help="bytes per round (chunks = this / row)")
    ap.add_argument("--job-chunks", type=int, default=16)
    ap.add_argument("--tmpfs", default="/dev/shm")
    ap.add_argument("--disk", default="/var/tmp", help="a directory on a real disk ('' to skip)")
    ap.add_argument("--redis", default="", help="default: a private redis-server started for the run")
    ap.add_argument("--only", default="", help="comma-separated substrings of tier names to run")
    tiers_main(ap.parse_args())


def main() -> None:
    if "--tiers" in sys.argv or "--corrupt" in sys.argv:  # HiCacheTier against vLLM's fs tier (above)
        return tiers_entry()
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
    sys.path.insert(0, str(ROOT / "bench"))
    if sys.argv[1:2] == ["sglang"]:  # the SGLang section runs in .venv-sglang
        import engines_sglang
        engines_sglang.main(sys.argv[2:])
    else:
        main()
