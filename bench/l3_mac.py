"""file:// put and ``get_into`` GB/s without and with a MAC (``storage.auth_key``), the
two alternating round by round, and the MAC'd / default ratio paired per round (load
that drifts between rounds on a shared machine cancels). Pages of 16 per call, ~32 MiB
per round, byte-exact checked.

    PYTHONPATH=. .venv/bin/python bench/l3_mac.py [--sizes 524288,2097152,8388608] [--rounds 5] [--dir /dev/shm]
"""
from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time

import numpy as np

from hicache.storage import open_storage

FP = "0f1e2d3c4b5a69788796a5b4c3d2e1f0"
SECRET = "a-shared-secret-of-32-characters"


def one_round(sz: int, key: str, r: int, d: str, total: int = 32 << 20) -> tuple[float, float]:
    n = max(16, min(256, total // sz))
    root = tempfile.mkdtemp(dir=d, prefix="hicache-bench-mac-")
    b = open_storage(f"file://{root}/l3", fingerprint=FP, auth_key=key, timeout_ms=2000)
    try:
        src = np.random.default_rng(r).integers(0, 256, (n, sz), dtype=np.uint8)
        dst = np.zeros_like(src)
        ks = [(r * 100_000 + i).to_bytes(16, "big") for i in range(n)]
        t0 = time.perf_counter()
        for j in range(0, n, 16):
            assert b.put([(ks[i], src[i], [sz]) for i in range(j, min(j + 16, n))]) == min(16, n - j)
        t1 = time.perf_counter()
        for j in range(0, n, 16):
            assert all(b.get_into(ks[j:j + 16], [sz], [dst[i] for i in range(j, min(j + 16, n))]))
        t2 = time.perf_counter()
        assert np.array_equal(src, dst)
        return n * sz / (t1 - t0) / 1e9, n * sz / (t2 - t1) / 1e9
    finally:
        b.close()
        shutil.rmtree(root, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="524288,2097152,8388608")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--dir", default="/dev/shm")
    a = ap.parse_args()
    print(f"file:// in {a.dir}, median of {a.rounds} alternating rounds, GB/s of payload")
    print("| page | default store / load | MAC'd store / load | MAC'd / default, paired |\n|---:|---:|---:|---:|")
    for sz in (int(x) for x in a.sizes.split(",")):
        pairs = [(one_round(sz, "", r, a.dir), one_round(sz, SECRET, r, a.dir)) for r in range(a.rounds)]

        def med(f):
            return statistics.median(f(p, m) for p, m in pairs)
        print(f"| {sz // 1024} KiB | {med(lambda p, m: p[0]):.2f} / {med(lambda p, m: p[1]):.2f} | "
              f"{med(lambda p, m: m[0]):.2f} / {med(lambda p, m: m[1]):.2f} | "
              f"{med(lambda p, m: m[0] / p[0]):.2f}x / {med(lambda p, m: m[1] / p[1]):.2f}x |", flush=True)


if __name__ == "__main__":
    main()
