"""L3 -> L2 reads at the store's speed: hicache's batched, verified read into L2 pages
against a raw read of the same object bytes, in one run, keyed and unkeyed.

hicache: ``StorageBackend.get_into_settled`` into a ``HostPool``'s pages (``page_buffers``, the
path ``TransferController.storage_get`` runs for the connector and for ``HiCache``'s
prefetch): every page verified (fingerprint, page hash, length, xxh3 and, keyed, the
BLAKE3 MAC), each by the thread that read it, payloads read straight into L2.
"hand-off": ``get_into`` (the engines' tiers: HiCacheTier, SGLang), whose file:// reads run
on the backend's workers so the caller gets its answer within the budget even from a hung
file system.
Raw: ``file://``, one thread opening each object file and ``os.readv``-ing it whole into a
buffer allocated once; ``redis://``, one redis-py ``MGET`` of the same keys (its default
client). Nothing verified, nothing placed. Byte-exact check of L2 after every hicache read.

"get() + copy": the same pages through ``get()`` (verified on the caller's thread) and
``HostPool.write_page``, what ``storage_get`` ran before it read into L2 (unkeyed).

Rounds are interleaved (raw, default, MAC'd, get() + copy, order reversed every round); a ratio is the
median over rounds of that round's pair. ``--redis-url`` (default the local server, db 15,
private key prefix, deleted at the end).

    PYTHONPATH=. .venv/bin/python bench/l3_read.py [--sizes 128K,512K,2M] [--mib 16] [--rounds 7]
        [--backends file,redis] [--dir /var/tmp] [--redis-url redis://127.0.0.1:6379/15]
        [--host-layout page_first|layer_first]
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time

import numpy as np
import redis

from hicache.core.hashing import page_hashes
from hicache.core.layout import KVLayout
from hicache.memory.pools import HostPool
from hicache.storage import open_storage

SECRET = "a-shared-secret-of-32-characters"
LAYERS = 32  # 64 planes (K and V of each layer): one region per page in page_first, 64 in layer_first


def layout_for(page_bytes: int, host_layout: str = "page_first") -> KVLayout:
    heads = page_bytes // (2 * LAYERS * 16 * 64 * 2)
    assert heads >= 1 and heads * 2 * LAYERS * 16 * 64 * 2 == page_bytes, page_bytes
    return KVLayout(model_id="bench-l3-read", num_layers=LAYERS, kind="mha", num_kv_heads=heads, head_dim=64,
                    dtype="bfloat16", page_size=16, host_layout=host_layout)


class Case:
    """One store and one page size: the objects written, an L2 pool to read them into."""

    def __init__(self, url: str, lay: KVLayout, n: int, key: str, prefix: bytes):
        self.lay, self.n = lay, n
        self.store = open_storage(url, fingerprint=lay.fingerprint(), timeout_ms=5000, key_prefix=prefix,
                                  auth_key=key)
        self.pool = HostPool(lay, n, pin=False)
        self.sizes = [p.page_bytes for p in lay.planes]
        self.keys = page_hashes(list(range(n * 16)), 16, namespace=f"l3read/{lay.page_bytes}/{key}")
        rng = np.random.default_rng(lay.page_bytes)
        self.src = rng.integers(0, 256, (n, lay.page_bytes), dtype=np.uint8)
        for j in range(0, n, 32):
            items = [(self.keys[i], self.src[i], self.sizes) for i in range(j, min(n, j + 32))]
            assert self.store.put(items) == len(items), self.store.stats()

    def read(self) -> None:
        got = self.store.get_into_settled(self.keys, self.sizes, [self.pool.page_buffers(p) for p in range(self.n)])
        assert all(got), self.store.stats()

    def read_handoff(self) -> None:
        got = self.store.get_into(self.keys, self.sizes, [self.pool.page_buffers(p) for p in range(self.n)])
        assert all(got), self.store.stats()

    def read_copy(self) -> None:
        """What storage_get did before get_into: verified ``get()`` on the caller, then a copy."""
        for p, payload in enumerate(self.store.get(self.keys, self.sizes)):
            self.pool.write_page(p, payload)

    def check(self) -> None:
        for p in range(0, self.n, max(1, self.n // 4)):
            assert b"".join(self.pool.page_buffers(p)) == self.src[p].tobytes(), p


def raw_file(case: Case):
    paths = [os.fspath(case.store.path_of(k)) for k in case.keys]
    size = os.path.getsize(paths[0])
    whole = memoryview(bytearray(size * len(paths)))  # as many bytes as the L2 pages, allocated once
    bufs = [whole[i * size:(i + 1) * size] for i in range(len(paths))]

    def read():
        for p, buf in zip(paths, bufs):
            fd = os.open(p, os.O_RDONLY)
            try:
                assert os.readv(fd, [buf]) == size
            finally:
                os.close(fd)
    return read


def raw_redis(case: Case, url: str):
    client = redis.Redis.from_url(url)
    full = [case.store.key_prefix + k for k in case.keys]

    def read():
        out = client.mget(full)
        assert out[-1] is not None
    return read


def timed(fn) -> tuple[float, float]:
    """Wall seconds, and CPU seconds of this process (every thread: the workers' too)."""
    t, c = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - t, time.process_time() - c


def measure(raw, plain: Case, keyed: Case, rounds: int) -> dict[str, float]:
    ops = [("raw", raw), ("hicache", plain.read), ("mac", keyed.read), ("handoff", plain.read_handoff),
           ("copy", plain.read_copy)]
    for _, fn in ops:
        fn()  # warm: page cache, connections
    plain.check()
    keyed.check()
    secs: dict[str, list[float]] = {k: [] for k, _ in ops}
    cpu: dict[str, list[float]] = {k: [] for k, _ in ops}
    for r in range(rounds):
        for name, fn in (ops if r % 2 == 0 else ops[::-1]):
            w, c = timed(fn)
            secs[name].append(w)
            cpu[name].append(c)
    nbytes = plain.n * plain.lay.page_bytes
    med = {k: nbytes / statistics.median(v) / 1e9 for k, v in secs.items()}
    med["x_raw"] = statistics.median(r / h for r, h in zip(secs["raw"], secs["hicache"]))
    # CPU time per byte against raw's: what a verified read costs where no core is idle
    med["cpu_x_raw"] = statistics.median(cpu["raw"]) / max(1e-9, statistics.median(cpu["hicache"]))
    med["handoff_x_raw"] = statistics.median(r / h for r, h in zip(secs["raw"], secs["handoff"]))
    med["mac_x_raw"] = statistics.median(r / m for r, m in zip(secs["raw"], secs["mac"]))
    med["mac_x_plain"] = statistics.median(h / m for h, m in zip(secs["hicache"], secs["mac"]))
    med["copy_x_raw"] = statistics.median(r / c for r, c in zip(secs["raw"], secs["copy"]))
    return med


def run_backend(kind: str, sizes: list[int], mib: int, rounds: int, root: str, redis_url: str,
                host_layout: str) -> list[dict]:
    rows = []
    for size in sizes:
        lay = layout_for(size, host_layout)
        n = max(8, (mib << 20) // size)
        url = f"file://{root}/l3" if kind == "file" else redis_url
        tag = f"hicache-bench-l3read-{os.getpid()}".encode()
        plain = Case(url, lay, n, "", tag + b":plain:")
        keyed = Case(url, lay, n, SECRET, tag + b":mac:")
        try:
            raw = raw_file(plain) if kind == "file" else raw_redis(plain, redis_url)
            rows.append(dict(kind=kind, size=size, n=n, **measure(raw, plain, keyed, rounds)))
        finally:
            for c in (plain, keyed):
                c.store.clear()
                c.store.close()
    return rows


def human(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="128K,512K,2M")
    ap.add_argument("--mib", type=int, default=16, help="payload MiB per read (one batch)")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--backends", default="file,redis")
    ap.add_argument("--dir", default="/var/tmp", help="file:// root (page cache; /dev/shm for tmpfs)")
    ap.add_argument("--redis-url", default="redis://127.0.0.1:6379/15")
    ap.add_argument("--host-layout", default="page_first", choices=["page_first", "layer_first"],
                    help="the L2 pool's layout (page_first, the default: one region per page)")
    a = ap.parse_args()
    sizes = [int(s[:-1]) << {"K": 10, "M": 20}[s[-1].upper()] for s in a.sizes.split(",")]
    rows = []
    for kind in a.backends.split(","):
        root = tempfile.mkdtemp(dir=a.dir, prefix="hicache-bench-l3read-")
        try:
            rows += run_backend(kind, sizes, a.mib, a.rounds, root, a.redis_url, a.host_layout)
        finally:
            shutil.rmtree(root, ignore_errors=True)
    print(f"\n{a.host_layout} L2, one batch of --mib {a.mib} MiB per read, median of {a.rounds} interleaved rounds, GB/s of payload; "
          f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}")
    print("| store | page | pages | raw | hicache | x raw | CPU x raw | hand-off x raw | MAC'd | MAC'd x raw "
          "| MAC'd x unkeyed | get() + copy | x raw |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['kind']} | {human(r['size'])} | {r['n']} | {r['raw']:.2f} | {r['hicache']:.2f} "
              f"| {r['x_raw']:.2f} | {r['cpu_x_raw']:.2f} | {r['handoff_x_raw']:.2f} | {r['mac']:.2f} "
              f"| {r['mac_x_raw']:.2f} | {r['mac_x_plain']:.2f} | {r['copy']:.2f} | {r['copy_x_raw']:.2f} |")


if __name__ == "__main__":
    main()
