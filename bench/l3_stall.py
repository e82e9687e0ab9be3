"""A frozen Redis must not stall the scheduler: admissions through a 10 s SIGSTOP.

    python bench/l3_stall.py [--before 3] [--freeze 10] [--after 3]

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
thread hand-offs themselves can take tens of milliseconds).
"""
from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

import torch

from hicache.config import HiCacheConfig
from hicache.errors import OutOfPages
from hicache.hicache import HiCache
from hicache.layout import KVLayout

PS = 16


def start_redis() -> tuple[subprocess.Popen, int, str]:
    exe = shutil.which("redis-server")
    if not exe:
        sys.exit("redis-server is not on PATH (apt-get install redis-server)")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    d = tempfile.mkdtemp(prefix="hc-stall-redis")
    proc = subprocess.Popen([exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                             "--dir", d], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(100):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return proc, port, d
        except OSError:
            time.sleep(0.05)
    sys.exit(f"redis-server did not listen on {port}")


def budget_ms(cfg: HiCacheConfig, num_tokens: int) -> float:
    p = cfg.policy
    return min(p.prefetch_timeout_cap_ms, p.prefetch_timeout_base_ms + p.prefetch_timeout_per_1k_tokens_ms
               * num_tokens / 1000)


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else 0.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--before", type=float, default=3.0)
    ap.add_argument("--freeze", type=float, default=10.0)
    ap.add_argument("--after", type=float, default=3.0)
    ap.add_argument("--prompts", type=int, default=64, help="distinct prompts, cycled")
    args = ap.parse_args()
    torch.set_num_threads(1)
    proc, port, rdir = start_redis()
    layout = KVLayout("bench-stall", num_layers=2, num_kv_heads=1, head_dim=16, dtype="float32", page_size=PS,
                      host_layout="page_first")
    cfg = HiCacheConfig.load(env={}, overrides={
        "storage.url": f"redis://127.0.0.1:{port}/0", "pool.device": "cpu", "pool.device_pages": "32",
        "pool.host_pages": "16", "policy.prefetch_policy": "timeout", "storage.timeout_ms": "50",
        "storage.max_retries": "2"})
    hc = HiCache(cfg, layout=layout)
    waits: list[tuple[float, float, float]] = []  # (time since start, L3 wait ms, budget ms)
    cur = [0.0]
    probe, wait, poll = hc.transfers.storage_probe, hc.transfers.wait, hc.transfers.poll

    def timed(fn, sign: float = 1.0):
        def run(*a, **k):
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                cur[0] += sign * (time.perf_counter() - t) * 1e3
        return run
    # The L3 wait is the probe plus the prefetch wait, less the completion
    # callbacks that wait() runs through poll() (scheduler work, not waiting).
    hc.transfers.storage_probe, hc.transfers.wait = timed(probe), timed(wait)
    hc.transfers.poll = timed(poll, -1.0)
    prompts = [[p * 1000 + i for i in range(8 * PS)] for p in range(args.prompts)]
    phases = [("before", args.before), ("frozen", args.freeze), ("after", args.after)]
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
            cur[0] = max(0.0, cur[0])  # poll() outside wait() subtracted too: clamp
            waits.append((time.perf_counter() - t0, cur[0], budget_ms(cfg, len(tokens))))
            adm.wait()
            try:
                req.alloc(len(tokens) - req.computed_tokens)
            except OutOfPages:  # in-flight backups pin L1: finish them (off the L3-wait clock)
                hc.drain()
                req.alloc(len(tokens) - req.computed_tokens)
            req.commit()
            req.finish()
            hc.poll()
    finally:
        if frozen:
            proc.send_signal(signal.SIGCONT)
        hc.close()
        proc.terminate()
        proc.wait(10)
        shutil.rmtree(rdir, ignore_errors=True)
    print(f"{'phase':8} {'steps':>6} {'max L3 wait ms':>15} {'p99 ms':>8} {'budget ms':>10} "
          f"{'max excess ms':>14} {'steps > budget+5ms':>19} {'> budget+50ms':>14}")
    start = 0.0
    for (name, _), end in zip(phases, ends):
        ph = [w for w in waits if start <= w[0] < end]
        start = end
        if not ph:
            continue
        excess = max(w[1] - w[2] for w in ph)
        print(f"{name:8} {len(ph):6d} {max(w[1] for w in ph):15.2f} {pct([w[1] for w in ph], 0.99):8.2f} "
              f"{ph[0][2]:10.2f} {max(0.0, excess):14.2f} {sum(w[1] > w[2] + 5 for w in ph):19d} "
              f"{sum(w[1] > w[2] + 50 for w in ph):14d}")
    s = hc.storage.stats() if hc.storage is not None else None
    if s is not None:
        print(f"L3: hits={s.hits} misses={s.misses} errors={s.errors} reconnects={s.reconnects} "
              f"lookup_timeouts={getattr(s, 'lookup_timeouts', 'n/a')} put_dropped={s.put_dropped}")
    print(f"pid {os.getpid()}, {time.strftime('%Y-%m-%d %H:%M:%S')}")


if __name__ == "__main__":
    main()
