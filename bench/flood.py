"""/healthz and engine-socket latency while floods arrive (issue 27, items 2 and 3).

Starts ``hicache serve`` as a real process per setting, then for each flood
pings ``/healthz`` (REST floods) or sends ``lookup`` on a second engine
connection (socket flood) every 10 ms and reports the worst and median
answer time during the flood, the flood's status codes, and the server's
peak RSS (VmHWM):

* ``rest-items``: 10 concurrent ~8 MiB lookup bodies holding 1.39M tokens
  (more than a lookup may carry; the issue's case);
* ``rest-valid``: 10 concurrent ~8 MiB lookup bodies of exactly 1M tokens (valid);
* ``hello``: one 7.5 MiB hello (800K extra planes) sent as fast as the socket takes it.

``--max-body-requests 1024`` is the reference (no admission bound).

    python bench/flood.py [--max-body-requests 1024 2]
"""
from __future__ import annotations

import argparse
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid

import httpx
import msgpack

from hicache.client.link import ServiceClient
from hicache.core.config import HiCacheConfig
from hicache.core.hashing import page_hashes
from hicache.client.protocol import HEADER, hello_request


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_peak_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return float("nan")


class Pinger(threading.Thread):
    def __init__(self, fn):
        super().__init__(daemon=True)
        self.fn, self.lat, self.stop = fn, [], threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            t = time.perf_counter()
            self.fn()
            self.lat.append(time.perf_counter() - t)
            time.sleep(0.01)


def rest_flood(url: str, body_file: str, n: int = 10) -> list[int]:
    """``n`` concurrent POSTs of ``body_file``, each by its own curl process (so the
    senders share no interpreter, and no GIL, with the pinger)."""
    procs = [subprocess.Popen(["curl", "-s", "-o", "/dev/null", "-w", "%{http_code}", "-H",
                               "content-type: application/json", "--data-binary", f"@{body_file}",
                               url + "/v1/lookup"], stdout=subprocess.PIPE, text=True) for _ in range(n)]
    return [int(p.communicate()[0] or 0) for p in procs]


def hello_frame(layout) -> bytes:
    d = layout.to_dict() | {"extra_planes": [[f"p{i}", 1] for i in range(800_000)]}
    body = msgpack.packb(hello_request(d, layout.fingerprint(), 1), use_bin_type=True)
    return HEADER.pack(len(body)) + body


def hello_flood(sock_path: str, frame: bytes) -> tuple[str, float]:
    s = socket.socket(socket.AF_UNIX)
    s.connect(sock_path)
    t = time.perf_counter()
    try:
        s.sendall(frame)
    except (BrokenPipeError, ConnectionResetError):
        pass  # refused from the header: the server hung up while we sent
    head = s.recv(4)
    rep = msgpack.unpackb(s.recv(HEADER.unpack(head)[0]), raw=False) if len(head) == 4 else {"kind": "closed"}
    dt = time.perf_counter() - t
    s.close()
    return rep.get("kind", "ok"), dt


def measure(mbr: int, flood: str) -> dict:
    d = tempfile.mkdtemp(prefix="hc-flood-")
    settings = {"service.port": str(free_port()), "service.socket_path": f"{d}/h.sock",
                "service.shm_name": f"hicache-bench-{uuid.uuid4().hex[:8]}", "storage.url": "memory://",
                "pool.host_pages": "1024", "service.max_body_requests": str(mbr)}
    proc, url = start_with(settings)
    try:
        layout = HiCacheConfig.load(overrides=settings, env={}).layout()
        client = ServiceClient(settings["service.socket_path"], layout)
        hashes = page_hashes(list(range(64)), layout.page_size)
        ping = (lambda: httpx.get(url + "/healthz", timeout=60)) if flood != "hello" else (lambda: client.lookup(hashes))
        body = os.path.join(d, "body.json")  # built before the pings start
        tokens = {"rest-items": ("12345", 1_390_000), "rest-valid": ("1234567", 1_000_000)}.get(flood)
        if tokens:
            with open(body, "w") as f:
                f.write('{"tokens": [' + ",".join([tokens[0]] * tokens[1]) + "]}")
        frame = hello_frame(layout) if flood == "hello" else b""
        p = Pinger(ping)
        p.start()
        time.sleep(0.3)
        base = len(p.lat)
        t0 = time.perf_counter()
        out = rest_flood(url, body) if tokens else hello_flood(settings["service.socket_path"], frame)
        wall = time.perf_counter() - t0
        p.stop.set()
        p.join()
        during = p.lat[base:] or [float("nan")]
        idle = p.lat[:base] or [float("nan")]
        client.close()
        return {"idle_ms": statistics.median(idle) * 1e3, "flood": flood, "mbr": mbr, "worst_ms": max(during) * 1e3, "median_ms": statistics.median(during) * 1e3,
                "pings": len(during), "wall_s": wall, "out": out, "rss_peak_mb": rss_peak_mb(proc.pid)}
    finally:
        proc.terminate()
        proc.wait()
        shutil.rmtree(d, ignore_errors=True)


def start_with(settings: dict[str, str]) -> tuple[subprocess.Popen, str]:
    argv = [sys.executable, "-m", "hicache.cli", "serve"] + [a for k, v in settings.items() for a in ("--set", f"{k}={v}")]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{settings['service.port']}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/healthz").status_code == 200 and os.path.exists(settings["service.socket_path"]):
                return proc, url
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    proc.kill()
    raise SystemExit("hicache serve did not start")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-body-requests", type=int, nargs="+", default=[1024, 2])
    ap.add_argument("--floods", nargs="+", default=["rest-items", "rest-valid", "hello"])
    args = ap.parse_args()
    print(f"{'flood':<11} {'max_body_req':>12} {'idle ms':>8} {'worst ms':>9} {'median ms':>9} {'pings':>5} {'flood s':>8} "
          f"{'rss peak MB':>11}  outcome")
    for flood in args.floods:
        for mbr in (args.max_body_requests if flood != "hello" else args.max_body_requests[-1:]):
            r = measure(mbr, flood)
            out = r["out"]
            shown = ", ".join(f"{c}x{out.count(c)}" for c in sorted(set(out), key=str)) if isinstance(out, list) \
                else f"{out[0]} after {out[1] * 1e3:.0f} ms"
            print(f"{r['flood']:<11} {r['mbr']:>12} {r['idle_ms']:>8.1f} {r['worst_ms']:>9.1f} {r['median_ms']:>9.1f} {r['pings']:>5} "
                  f"{r['wall_s']:>8.2f} {r['rss_peak_mb']:>11.0f}  {shown}")


if __name__ == "__main__":
    main()
