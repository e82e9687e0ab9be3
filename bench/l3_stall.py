"""A frozen Redis must not stall the scheduler: admissions through a 10 s SIGSTOP.

    python bench/l3_stall.py [--before 3] [--freeze 10] [--after 3] [--drain none|drain|wait-all]

Starts a private redis-server on a free loopback port (never a shared one),
builds an embedded ``HiCache`` with that Redis as L3 and the ``timeout``
prefetch policy, and admits requests in a loop (the scheduler's side: match,
L3 probe, prefetch wait, L2 load back, lock; then a finish that backs pages
up). L1 and L2 are kept small so most admissions go to L3. After ``--before``
seconds Redis is frozen with SIGSTOP for ``--freeze`` seconds, then resumed.

For each admission it measures the time spent waiting on L3 on the
scheduler thread (the L3 probe plus the prefetch wait) and subtracts the
prefetch policy's budget for that request. Prints one row per phase: steps,
the largest and 99th-percentile L3 wait, and the largest excess over the
budget (target: <= 5 ms during the freeze), and how many steps exceeded the
budget by more than 5 ms and 50 ms (robust to a loaded machine, where the
thread hand-offs themselves can take tens of milliseconds). It also reports
the longest ``drain()`` the loop made (on ``OutOfPages``, to free L1 pages
pinned by backups): it must not wait for an L3 call stuck in the freeze.

Nothing is left behind, whatever ends the run: redis-server runs in its own
session with ``PR_SET_PDEATHSIG`` (it dies with this process, even on
SIGKILL), is stopped in a ``finally`` and by ``atexit``, SIGTERM/SIGINT end
the run through the same path, and it writes no files (no save, no AOF, its
``--dir`` an existing directory), so there is no temporary directory to leak.
"""
from __future__ import annotations

import argparse
import atexit
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

import torch

from hicache.core.config import HiCacheConfig
from hicache.core.errors import OutOfPages
from hicache.cache.hicache import HiCache
from hicache.core.layout import KVLayout

PS = 16


def _die_with_parent() -> None:
    """In the redis-server child: SIGKILL it when this process dies (Linux prctl)."""
    import ctypes
    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def start_redis() -> tuple[subprocess.Popen, int]:
    exe = shutil.which("redis-server")
    if not exe:
        sys.exit("redis-server is not on PATH (apt-get install redis-server)")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                             "--dir", tempfile.gettempdir()], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True, preexec_fn=_die_with_parent)
    atexit.register(stop_redis, proc)
    print(f"redis-server pid {proc.pid} port {port}", flush=True)
    for _ in range(100):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return proc, port
        except OSError:
            time.sleep(0.05)
    stop_redis(proc)
    sys.exit(f"redis-server did not listen on {port}")


def stop_redis(proc: subprocess.Popen) -> None:
    """Stop redis-server (resumed first: a stopped process ignores SIGTERM). Idempotent."""
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGCONT)
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _exit_on_signal(signum: int, frame) -> None:
    # A watchdog first: an exception raised inside a finalizer or GC callback is swallowed,
    # and the run would go on for its whole length. SIGALRM's default action ends the process
    # in 10 s whatever happens; redis-server then dies with it (PR_SET_PDEATHSIG).
    signal.alarm(10)
    raise SystemExit(128 + signum)  # unwinds through the finally that stops redis-server


def budget_ms(cfg: HiCacheConfig, num_tokens: int) -> float:
    p = cfg.policy
    return min(p.prefetch_timeout_cap_ms, p.prefetch_timeout_base_ms + p.prefetch_timeout_per_1k_tokens_ms
               * num_tokens / 1000)


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else 0.0


def run(args: argparse.Namespace, port: int, proc: subprocess.Popen):
    """The admission loop; ``(waits, drains, phase ends, L3 stats)``."""
    layout = KVLayout("bench-stall", num_layers=2, num_kv_heads=1, head_dim=16, dtype="float32", page_size=PS,
                      host_layout="page_first")
    cfg = HiCacheConfig.load(env={}, overrides={
        "storage.url": f"redis://127.0.0.1:{port}/0", "pool.device": "cpu", "pool.device_pages": "32",
        "pool.host_pages": "16", "policy.prefetch_policy": "timeout", "storage.timeout_ms": "50",
        "storage.max_retries": "2"})
    hc = HiCache(cfg, layout=layout)
    waits: list[tuple[float, float, float]] = []  # (time since start, L3 wait ms, budget ms)
    drains: list[tuple[float, float]] = []  # (time since start, drain ms) on the scheduler path
    cur = [0.0]
    probe, wait = hc.transfers.storage_probe, hc.transfers.wait

    def timed(fn):
        def run(*a, **k):
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                cur[0] += (time.perf_counter() - t) * 1e3
        return run
    # The L3 wait is the probe plus the prefetch wait (TransferController.wait;
    # HiCache observes completions after it returns, off this clock).
    hc.transfers.storage_probe, hc.transfers.wait = timed(probe), timed(wait)
    prompts = [[p * 1000 + i for i in range(8 * PS)] for p in range(args.prompts)]
    t0 = time.perf_counter()
    ends = [args.before, args.before + args.freeze, args.before + args.freeze + args.after]
    frozen = False
    n = 0
    try:
        while (now := time.perf_counter() - t0) < ends[2]:
            if not frozen and ends[0] <= now < ends[1]:
                proc.send_signal(signal.SIGSTOP)
                frozen = True
            elif frozen and now >= ends[1]:
                proc.send_signal(signal.SIGCONT)
                frozen = False
            tokens = prompts[n % len(prompts)]
            n += 1
            req = hc.new_request(f"r{n}", tokens)
            cur[0] = 0.0
            adm = hc.admit(req)
            waits.append((time.perf_counter() - t0, cur[0], budget_ms(cfg, len(tokens))))
            adm.wait()
            try:
                req.alloc(len(tokens) - req.computed_tokens)
            except OutOfPages:  # in-flight backups pin L1: finish them (timed as a drain, not an L3 wait)
                hc.transfers.wait = wait
                t = time.perf_counter()
                hc.drain()
                drains.append((t - t0, (time.perf_counter() - t) * 1e3))
                hc.transfers.wait = timed(wait)
                req.alloc(len(tokens) - req.computed_tokens)
            req.commit()
            req.finish()
            hc.poll()
            if args.drain != "none":  # an engine that drains each step (Engine(drain_each_step=True))
                hc.transfers.wait = wait
                t = time.perf_counter()
                if args.drain == "wait-all":  # the reference: wait for every job, L3 included (drain before issue 27)
                    hc.transfers.wait_all()
                    hc.poll()
                else:
                    hc.drain()
                drains.append((t - t0, (time.perf_counter() - t) * 1e3))
                hc.transfers.wait = timed(wait)
    finally:
        if frozen:
            proc.send_signal(signal.SIGCONT)
        hc.transfers.wait = wait
        hc.close()
    return waits, drains, ends, hc.storage.stats() if hc.storage is not None else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--before", type=float, default=3.0)
    ap.add_argument("--freeze", type=float, default=10.0)
    ap.add_argument("--after", type=float, default=3.0)
    ap.add_argument("--prompts", type=int, default=64, help="distinct prompts, cycled")
    ap.add_argument("--drain", choices=["none", "drain", "wait-all"], default="none",
                    help="after each step: nothing, HiCache.drain(), or wait for every transfer (the reference)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _exit_on_signal)
    proc, port = start_redis()
    try:
        waits, drains, ends, stats = run(args, port, proc)
    finally:
        stop_redis(proc)
    phases = ["before", "frozen", "after"]
    print(f"{'phase':8} {'steps':>6} {'max L3 wait ms':>15} {'p99 ms':>8} {'budget ms':>10} "
          f"{'max excess ms':>14} {'steps > budget+5ms':>19} {'> budget+50ms':>14} {'drains':>7} {'max drain ms':>13}")
    start = 0.0
    for name, end in zip(phases, ends):
        ph = [w for w in waits if start <= w[0] < end]
        dr = [d for t, d in drains if start <= t < end]
        start = end
        if not ph:
            continue
        excess = max(w[1] - w[2] for w in ph)
        print(f"{name:8} {len(ph):6d} {max(w[1] for w in ph):15.2f} {pct([w[1] for w in ph], 0.99):8.2f} "
              f"{ph[0][2]:10.2f} {max(0.0, excess):14.2f} {sum(w[1] > w[2] + 5 for w in ph):19d} "
              f"{sum(w[1] > w[2] + 50 for w in ph):14d} {len(dr):7d} {max(dr, default=0.0):13.2f}")
    if stats is not None:
        print(f"L3: hits={stats.hits} misses={stats.misses} errors={stats.errors} reconnects={stats.reconnects} "
              f"lookup_timeouts={stats.lookup_timeouts} put_dropped={stats.put_dropped}")
    print(f"pid {os.getpid()}, {time.strftime('%Y-%m-%d %H:%M:%S')}")


if __name__ == "__main__":
    main()
