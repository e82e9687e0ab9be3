"""The L3 object hashes side by side on this machine: xxh3_64 (the checksum), CRC32C
(hardware, the ``crc32c`` package), keyed BLAKE3 (the MAC, format version 2; one thread
and Rayon's) and keyed BLAKE2b (the version 1 MAC), GB/s best of 5, in cache; then
whether each releases the GIL (a Python thread spins beside a 64 MiB hash), and the
MAC'd header ``codec.encode_header`` builds against the unkeyed one.

    PYTHONPATH=. .venv/bin/python bench/l3_hashes.py [--sizes 16384,524288,2097152,8388608]
"""
from __future__ import annotations

import argparse
import hashlib
import threading
import time

import blake3
import numpy as np
import xxhash

from hicache.storage import codec

KEY = b"k" * 32


def gbs(f, b: memoryview, n: int = 20) -> float:
    f(b)
    best = 1e9
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(n):
            f(b)
        best = min(best, (time.perf_counter() - t0) / n)
    return b.nbytes / best / 1e9


def hashes() -> dict:
    out = {"xxh3": xxhash.xxh3_64_intdigest,
           "BLAKE3 keyed": lambda x: blake3.blake3(x, key=KEY).digest(),
           "BLAKE3 keyed, AUTO threads": lambda x: blake3.blake3(x, key=KEY, max_threads=blake3.blake3.AUTO).digest(),
           "BLAKE2b keyed": lambda x: hashlib.blake2b(x, key=KEY, digest_size=32).digest()}
    try:
        import crc32c
        out["CRC32C"] = crc32c.crc32c
    except ImportError:
        print("(crc32c not installed: pip install crc32c to compare it)")
    return out


def releases_gil(f) -> bool:
    b = memoryview(np.random.default_rng(0).integers(0, 256, 64 << 20, dtype=np.uint8))
    stop, count = threading.Event(), [0]

    def spin():
        while not stop.is_set():
            count[0] += 1
    t = threading.Thread(target=spin)
    t.start()
    time.sleep(0.05)
    c0 = count[0]
    f(b)
    c1 = count[0]
    stop.set()
    t.join()
    return c1 - c0 > 1000


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="16384,524288,2097152,8388608")
    sizes = [int(x) for x in ap.parse_args().sizes.split(",")]
    hs = hashes()
    print(f"{'hash':<28} " + " ".join(f"{s // 1024:>8} K" for s in sizes) + "  releases the GIL")
    bufs = [memoryview(np.random.default_rng(s).integers(0, 256, s, dtype=np.uint8)) for s in sizes]
    for name, f in hs.items():
        print(f"{name:<28} " + " ".join(f"{gbs(f, b):>10.1f}" for b in bufs) + f"  {releases_gil(f)}", flush=True)
    fp, mk = "a" * 32, codec.mac_key(KEY)
    for label, k in (("header, unkeyed", b""), ("header, MAC'd (v2)", mk)):
        cells = []
        for b in bufs:
            t = codec.header_template(fp, [b.nbytes])
            cells.append(gbs(lambda x: codec.encode_header(fp, b"h" * 16, [x.nbytes], x, k, t), b))
        print(f"{label:<28} " + " ".join(f"{c:>10.1f}" for c in cells), flush=True)


if __name__ == "__main__":
    main()
