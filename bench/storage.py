"""L3 batch put/get throughput: hicache's Redis backend vs raw redis-py
pipelined SET/GET of the same payload bytes, side by side in one run.

Starts its own redis-server on a free loopback port (or uses --url), then for
each page size runs interleaved rounds (raw puts, hicache put, raw get,
hicache get), each round a fixed number of 32-page batches, and reports the
median GB/s of payload bytes.

Two raw SET baselines: redis-py as configured by default (with hiredis
installed it packs every command, payload included, into one new bytes
object) and redis-py with its pure-Python packer, which sends large values
without copying them: the faster of the two is the bar. hicache's put includes building and checksumming the
header; its get includes full verification (header, fingerprint, hash,
length, xxh3 checksum). "with MAC" columns: the same with ``storage.auth_key``
set (keyed BLAKE3 over payload and header), in parentheses relative to
hicache without it.

hicache put has two checksum schedules (``RedisBackend.overlap_checksums``,
on by default with >= 4 usable CPUs): a helper thread checksums the next 4 MiB
chunk while this one is sent, or ("groups") one pipeline whose headers are built
in ~1 MiB groups, each just before the group is sent. "other schedule" is the
same put with the other one (the line above the table names the default here).
``--redis-benchmark`` adds the C client (redis-benchmark, one connection, the
same pipeline depth) and hicache's ratio to it.

Ratios to raw redis-py are also given paired: each round's hicache figure over
the same round's reference (put: the better raw SET of that round), then the
median and the range of those ratios, which cancels load that drifts between
rounds on a shared machine.

    python bench/storage.py [--sizes 64K,512K,2M] [--batch 32] [--rounds 7] [--redis-benchmark]
    python bench/storage.py --shape llama-3.1-8b --page-sizes 1,16,64

``--shape NAME`` (a published model, ``hicache.core.shapes``) replaces ``--sizes``:
one row per page size with that model's page bytes of all layers and its real
plane sizes in every header (instead of two halves).
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
import time

import redis
from redis.connection import Encoder, PythonRespSerializer

from hicache.core.hashing import page_hashes
from hicache.core.shapes import model_shape, shape_names
from hicache.storage import open_storage
from hicache.storage.redis_backend import RedisBackend

OVERLAP_DEFAULT = RedisBackend.overlap_checksums

FP = "b3nchb3nchb3nchb3nchb3nchb3nch00"


def parse_size(s: str) -> int:
    s = s.strip().upper()
    mult = {"K": 1 << 10, "M": 1 << 20}.get(s[-1], 1)
    return int(s[:-1] if s[-1] in "KM" else s) * mult


def start_server(workdir: str) -> tuple[subprocess.Popen, int]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    exe = shutil.which("redis-server")
    if not exe:
        sys.exit("redis-server is not on PATH (apt-get install redis-server)")
    proc = subprocess.Popen([exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly",
                             "no", "--dir", workdir], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 10
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return proc, port
        except OSError:
            if time.monotonic() > deadline:
                sys.exit(f"redis-server did not listen on {port}")
            time.sleep(0.05)


def timed(fn, reps: int) -> float:
    fn()  # warm (and, for gets, make sure the keys exist)
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    return time.perf_counter() - t


def redis_benchmark(exe: str, url: str, size: int, batch: int, target_bytes: int) -> dict[str, float]:
    """GB/s of payload for the C client: one connection, ``batch`` commands per pipeline."""
    u = redis.connection.parse_url(url)
    n = max(batch * 4, target_bytes // size)
    out = subprocess.run([exe, "-h", u.get("host", "127.0.0.1"), "-p", str(u.get("port", 6379)), "-c", "1",
                          "-P", str(batch), "-n", str(n), "-d", str(size), "-t", "set,get", "--csv"],
                         capture_output=True, text=True, check=True).stdout
    res = {}
    for line in out.splitlines():
        cells = [c.strip('"') for c in line.split(",")]
        if cells[0] in ("SET", "GET"):
            res[f"cb_{cells[0].lower()}"] = float(cells[1]) * size / 1e9
    return res


def run(url: str, sizes: list[int], batch: int, rounds: int, target_bytes: int, timeout_ms: int,
        bench_exe: str | None = None, planes: dict[int, list[int]] | None = None) -> list[dict]:
    """``planes``: each size's plane sizes (a real layout's); two halves otherwise."""
    raw = redis.Redis.from_url(url)
    packer = PythonRespSerializer(6000, Encoder("utf-8", "strict", False).encode)
    raw_py = redis.Redis(connection_pool=redis.ConnectionPool.from_url(url, command_packer=packer))
    l3 = open_storage(url, fingerprint=FP, timeout_ms=timeout_ms)
    l3_serial = open_storage(url, fingerprint=FP, timeout_ms=timeout_ms)
    l3_serial.overlap_checksums = not l3.overlap_checksums  # the other checksum schedule
    # The same store with storage.auth_key set (a keyed BLAKE2b MAC per object),
    # under its own prefix: the difference is the MAC's cost.
    l3_mac = open_storage(url, fingerprint=FP, timeout_ms=timeout_ms, key_prefix=b"hicache-mac:",
                          auth_key=b"bench-auth-key-0123456789abcdef")
    rows = []
    for size in sizes:
        keys = page_hashes(list(range(4 * batch)), 4, namespace=f"bench{size}")
        payloads = [memoryview(os.urandom(size)) for _ in range(batch)]
        raw_keys = [b"raw:" + k for k in keys]
        sizes_list = (planes or {}).get(size) or [size // 2, size - size // 2]
        items = [(k, p, sizes_list) for k, p in zip(keys, payloads)]

        def raw_put(client=raw):
            p = client.pipeline(transaction=False)
            for k, v in zip(raw_keys, payloads):
                p.set(k, v)
            p.execute()

        def raw_py_put():
            raw_put(raw_py)

        def raw_get():
            p = raw.pipeline(transaction=False)
            for k in raw_keys:
                p.get(k)
            out = p.execute()
            assert out[0] is not None

        def l3_put():
            l3.put(items)  # drops are counted and reported below

        def l3_put_serial():
            l3_serial.put(items)

        def l3_get():
            l3.get(keys, sizes_list)

        def mac_put():
            l3_mac.put(items)

        def mac_get():
            assert l3_mac.get(keys[:1], sizes_list)[0] is not None
            l3_mac.get(keys, sizes_list)

        reps = max(2, target_bytes // (size * batch))
        ops = (("raw_put", raw_put), ("raw_py_put", raw_py_put), ("l3_put", l3_put),
               ("l3_put_serial", l3_put_serial), ("mac_put", mac_put),
               ("raw_get", raw_get), ("l3_get", l3_get), ("mac_get", mac_get))
        res: dict[str, list[float]] = {n: [] for n, _ in ops}
        for _ in range(rounds):
            for name, fn in ops:
                res[name].append(reps * batch * size / timed(fn, reps) / 1e9)
        med = {n: statistics.median(v) for n, v in res.items()}
        put_r = sorted(p / max(a, b) for p, a, b in zip(res["l3_put"], res["raw_put"], res["raw_py_put"]))
        get_r = sorted(g / r for g, r in zip(res["l3_get"], res["raw_get"]))
        med.update(put_pair=statistics.median(put_r), put_lo=put_r[0], put_hi=put_r[-1],
                   get_pair=statistics.median(get_r), get_lo=get_r[0], get_hi=get_r[-1])
        if bench_exe:
            med.update(redis_benchmark(bench_exe, url, size, batch, target_bytes))
        rows.append(dict(size=size, **med))
        raw.delete(*raw_keys)
        l3.delete(keys)
        l3_mac.delete(keys)
    s = l3.stats()
    sm = l3_mac.stats()
    l3_mac.check_integrity()
    l3_mac.close()
    if sm.put_dropped or sm.misses or sm.errors:
        print("WARNING: the keyed store dropped or missed pages: its numbers are not comparable")
    l3.check_integrity()
    l3.close()
    l3_serial.close()
    raw.close()
    raw_py.close()
    print(f"hicache counters: put_ok={s.put_ok} put_dropped={s.put_dropped} hits={s.hits} "
          f"misses={s.misses} corrupt={s.corrupt} errors={s.errors}")
    if s.put_dropped or s.misses or s.errors:
        print("WARNING: drops/misses/errors above: numbers are not comparable; raise --timeout-ms")
    return rows


def human(n: int) -> str:
    if n % 1024:
        return f"{n} B"
    return f"{n / (1 << 20):.3g} MiB" if n >= 1 << 20 else f"{n >> 10} KiB"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default="", help="use this Redis instead of starting one")
    ap.add_argument("--sizes", default="64K,512K,2M")
    ap.add_argument("--shape", default="", choices=["", *shape_names()],
                    help="pages of this published model (all layers, real plane sizes) instead of --sizes")
    ap.add_argument("--page-sizes", default="16", help="with --shape: tokens per page, e.g. 1,16,64")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--mib-per-round", type=int, default=256, help="payload MiB moved per measurement")
    # Throughput, not outage behaviour, is measured: a generous timeout keeps a
    # scheduling hiccup on a busy 2-core box from counting as an outage.
    ap.add_argument("--timeout-ms", type=int, default=1000)
    ap.add_argument("--redis-benchmark", action="store_true",
                    help="also run the C client (redis-benchmark, -c 1 -P batch) and report ratios to it")
    ap.add_argument("--overlap-chunk-kib", type=int, default=0,
                    help="override redis_backend.OVERLAP_CHUNK_BYTES (KiB) for this run")
    a = ap.parse_args()
    if a.overlap_chunk_kib:
        from hicache.storage import redis_backend
        redis_backend.OVERLAP_CHUNK_BYTES = a.overlap_chunk_kib << 10
    sizes = [parse_size(s) for s in a.sizes.split(",")]
    planes: dict[int, list[int]] = {}
    if a.shape:
        lays = [model_shape(a.shape).kv_layout(int(ps)) for ps in a.page_sizes.split(",")]
        sizes = [lay.page_bytes for lay in lays]
        planes = {lay.page_bytes: [p.page_bytes for p in lay.planes] for lay in lays}
        for lay in lays:
            print(f"shape {a.shape}, page {lay.page_size}: {human(lay.page_bytes)} per page, "
                  f"{len(lay.planes)} planes of {lay.planes[0].page_bytes} B")
    proc = None
    with tempfile.TemporaryDirectory() as tmp:
        url = a.url
        if not url:
            proc, port = start_server(tmp)
            url = f"redis://127.0.0.1:{port}/0"
        try:
            exe = shutil.which("redis-benchmark") if a.redis_benchmark else None
            if a.redis_benchmark and not exe:
                sys.exit("--redis-benchmark: redis-benchmark is not on PATH")
            rows = run(url, sizes, a.batch, a.rounds, a.mib_per_round << 20, a.timeout_ms, exe, planes)
        finally:
            if proc is not None:
                proc.terminate()
                proc.wait()
    schedule, other = ("helper thread", "groups") if OVERLAP_DEFAULT else ("groups", "helper thread")
    print(f"\nbatch {a.batch} pages, median of {a.rounds} interleaved rounds, GB/s of payload; put's default "
          f"checksum schedule here: {schedule} ({os.cpu_count()} CPUs)")
    print("| page size | raw SET (default) | raw SET (py packer) | hicache put | put / best raw "
          "| put / raw, paired per round [range] "
          f"| hicache put, other schedule ({other}) | put with MAC | raw GET | hicache get | get / raw "
          "| get / raw, paired per round [range] | get with MAC |"
          + (" C client SET | C client GET | put / C | get / C |" if rows and "cb_set" in rows[0] else ""))
    print("|---" * 13 + "|" + ("---|" * 4 if rows and "cb_set" in rows[0] else ""))
    for r in rows:
        best = max(r["raw_put"], r["raw_py_put"])
        line = (f"| {human(r['size'])} | {r['raw_put']:.2f} | {r['raw_py_put']:.2f} | {r['l3_put']:.2f} "
                f"| {r['l3_put'] / best:.0%} | {r['put_pair']:.0%} [{r['put_lo']:.0%}-{r['put_hi']:.0%}] "
                f"| {r['l3_put_serial']:.2f} ({r['l3_put_serial'] / best:.0%}) "
                f"| {r['mac_put']:.2f} ({r['mac_put'] / r['l3_put']:.0%}) "
                f"| {r['raw_get']:.2f} | {r['l3_get']:.2f} | {r['l3_get'] / r['raw_get']:.0%} "
                f"| {r['get_pair']:.0%} [{r['get_lo']:.0%}-{r['get_hi']:.0%}] "
                f"| {r['mac_get']:.2f} ({r['mac_get'] / r['l3_get']:.0%}) |")
        if "cb_set" in r:
            line += (f" {r['cb_set']:.2f} | {r['cb_get']:.2f} | {r['l3_put'] / r['cb_set']:.0%} "
                     f"| {r['l3_get'] / r['cb_get']:.0%} |")
        print(line)


if __name__ == "__main__":
    main()
