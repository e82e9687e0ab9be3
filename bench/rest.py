"""REST latency under concurrent load: ``/v1/stats`` and ``/v1/lookup``.

Starts ``hicache serve`` as a real process (tmp socket, unique shm name,
``memory://`` L3 unless ``--storage-url``), commits a prefix through the
engine socket so lookups hit, then runs C concurrent httpx clients, each
sending a bounded number of requests, and prints latency percentiles and
throughput per (route, concurrency).

    python bench/rest.py [--requests 400] [--concurrency 1 8 32] [--tokens 2048]
"""
from __future__ import annotations

import argparse
import asyncio
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid

import httpx

from hicache.client.link import ServiceClient
from hicache.core.config import HiCacheConfig
from hicache.core.hashing import page_hashes


def free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(storage_url: str) -> tuple[subprocess.Popen, str, dict[str, str]]:
    d = tempfile.mkdtemp(prefix="hc-bench-")
    port = free_port()
    settings = {"service.port": str(port), "service.socket_path": f"{d}/h.sock",
                "service.shm_name": f"hicache-bench-{uuid.uuid4().hex[:8]}", "storage.url": storage_url,
                "pool.host_pages": "1024"}
    argv = [sys.executable, "-m", "hicache.cli", "serve"] + [a for k, v in settings.items() for a in ("--set", f"{k}={v}")]
    proc = subprocess.Popen(argv)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            if httpx.get(url + "/healthz").status_code == 200 and os.path.exists(settings["service.socket_path"]):
                return proc, url, settings
        except httpx.TransportError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit("hicache serve did not start")
        time.sleep(0.1)


async def load(url: str, method: str, path: str, body: dict | None, conc: int, total: int) -> list[float]:
    lat: list[float] = []
    per = max(total // conc, 1)

    async def worker(c: httpx.AsyncClient) -> None:
        for _ in range(per):
            t = time.perf_counter()
            r = await (c.post(path, json=body) if method == "POST" else c.get(path))
            lat.append(time.perf_counter() - t)
            assert r.status_code == 200, r.text

    limits = httpx.Limits(max_connections=conc, max_keepalive_connections=conc)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=30) as c:
        await worker(c)  # warm-up connection + first request, not timed below
        lat.clear()
        t0 = time.perf_counter()
        await asyncio.gather(*(worker(c) for _ in range(conc)))
        wall = time.perf_counter() - t0
    lat.append(-wall)  # last element carries the wall time
    return lat


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=400, help="requests per (route, concurrency)")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--tokens", type=int, default=2048, help="prompt length of the lookup")
    p.add_argument("--storage-url", default="memory://")
    a = p.parse_args()
    proc, url, settings = start(a.storage_url)
    try:
        cfg = HiCacheConfig.load(None, settings, env={})
        layout = cfg.layout()
        tokens = list(range(a.tokens))
        hashes = page_hashes(tokens, layout.page_size)
        with ServiceClient(settings["service.socket_path"], layout, pin=False) as eng:
            half = hashes[:len(hashes) // 2]
            eng.commit(half, eng.reserve(len(half)))
        routes = [("GET", "/v1/stats", None), ("POST", "/v1/lookup", {"tokens": tokens}),
                  ("POST", "/v1/lookup", {"tokens": tokens, "include_l3": False})]
        print(f"hicache serve REST latency, {a.requests} requests per row, lookup of {a.tokens} tokens "
              f"({len(hashes)} pages, {len(half)} in L2), L3 {a.storage_url}")
        print(f"{'route':<28}{'conc':>5}{'p50 ms':>9}{'p90 ms':>9}{'p99 ms':>9}{'req/s':>9}")
        for method, path, body in routes:
            name = path + (" (no L3)" if body and body.get("include_l3") is False else "")
            for conc in a.concurrency:
                lat = asyncio.run(load(url, method, path, body, conc, a.requests))
                wall = -lat.pop()
                q = statistics.quantiles(lat, n=100, method="inclusive")
                print(f"{name:<28}{conc:>5}{q[49] * 1e3:>9.2f}{q[89] * 1e3:>9.2f}{q[98] * 1e3:>9.2f}"
                      f"{len(lat) / wall:>9.0f}")
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
