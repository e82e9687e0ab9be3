"""Local engine API round trip: lookup of an 8K-token prompt (512 page hashes, page 16).

Starts ``python -m hicache.node.server`` as its own process (so client and
server do not share a GIL), fills L2 with the prompt's pages, then times
synchronous round trips from one ``ServiceClient``. Prints a table.

    python bench/service.py [--iters 3000] [--tokens 8192]
"""
from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from hicache.client.link import ServiceClient
from hicache.core.config import HiCacheConfig
from hicache.core.hashing import page_hashes


def start_server(d: Path, host_pages: int) -> tuple[subprocess.Popen, HiCacheConfig]:
    shm = f"hicache-bench-{os.getpid()}"
    toml = d / "bench.toml"
    toml.write_text(f'[pool]\nhost_pages = {host_pages}\n[service]\nsocket_path = "{d}/e.sock"\n'
                    f'shm_name = "{shm}"\n')
    cfg = HiCacheConfig.load(toml, env={})
    proc = subprocess.Popen([sys.executable, "-m", "hicache.node.server", "--config", str(toml)],
                            env={k: v for k, v in os.environ.items() if not k.startswith("HICACHE_")})
    deadline = time.monotonic() + 60
    while not os.path.exists(cfg.service.socket_path):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"engine server did not start (exit {proc.poll()})")
        time.sleep(0.05)
    return proc, cfg


def timed(fn, iters: int) -> list[float]:
    for _ in range(min(200, iters)):
        fn()
    out = []
    for _ in range(iters):
        t0 = time.perf_counter_ns()
        fn()
        out.append((time.perf_counter_ns() - t0) / 1000)
    return out


def row(name: str, us: list[float]) -> str:
    us = sorted(us)
    p99 = us[min(len(us) - 1, int(0.99 * len(us)))]
    return f"| {name:<34} | {statistics.median(us):>9.1f} | {p99:>9.1f} | {statistics.fmean(us):>9.1f} |"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iters", type=int, default=3000)
    ap.add_argument("--tokens", type=int, default=8192)
    args = ap.parse_args()
    d = Path(tempfile.mkdtemp(prefix="hcb", dir="/tmp"))
    proc, cfg = start_server(d, host_pages=2 * args.tokens // cfg_page(args))
    try:
        layout = cfg.layout()
        hashes = page_hashes(list(range(args.tokens)), layout.page_size)
        cold = page_hashes(list(range(args.tokens)), layout.page_size, namespace="cold")
        with ServiceClient(cfg.service.socket_path, layout) as c:
            c.commit(hashes, c.reserve(len(hashes)))
            assert c.lookup(hashes).num_pages == len(hashes)

            def acq_rel() -> None:
                c.release(hashes[:len(c.acquire(hashes))])

            cases = [
                ("stats (empty round trip)", lambda: c.stats()),
                ("lookup 1 page hash", lambda: c.lookup(hashes[:1])),
                (f"lookup {len(hashes)} hashes, all hit", lambda: c.lookup(hashes)),
                (f"lookup {len(hashes)} hashes, first misses", lambda: c.lookup(cold)),
                (f"acquire+release {len(hashes)} (2 trips)", acq_rel),
            ]
            print(f"local engine API, {args.tokens}-token prompt = {len(hashes)} pages of {layout.page_size}; "
                  f"{args.iters} iterations; microseconds")
            print("| case                               | median us |    p99 us |   mean us |")
            print("|------------------------------------|-----------|-----------|-----------|")
            for name, fn in cases:
                print(row(name, timed(fn, args.iters)))
            c.check_integrity()
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
        for f in d.iterdir():
            f.unlink()
        d.rmdir()


def cfg_page(args: argparse.Namespace) -> int:
    return HiCacheConfig.load(env={}).model.page_size


if __name__ == "__main__":
    main()
