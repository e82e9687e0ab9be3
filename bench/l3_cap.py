"""What the file:// byte cap costs: puts into an unbounded directory (the
reference, same run) against a capped one that never fills (the ledger's
flock per batch) and one filled to 10x its cap (ledger + trims), and the time
of one trim (a scan of the directory and the deletes).

    PYTHONPATH=. python bench/l3_cap.py [--pages 4000] [--page-kib 64] [--batch 8] [--reps 3]

Prints a markdown table of medians over ``--reps``; bytes on disk are checked
against the cap after every run.
"""
from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from hicache.core.hashing import page_hashes
from hicache.storage import open_storage
from hicache.storage.file_cap import scan

FP = "0f1e2d3c4b5a6978"


def run(root: Path, pages: int, page: int, batch: int, cap: int) -> tuple[float, int, list[float]]:
    """Seconds to put ``pages`` pages, trims done, and each trim's seconds."""
    b = open_storage(f"file://{root}", fingerprint=FP, max_bytes=cap, timeout_ms=10_000)
    trims: list[float] = []
    if b._cap is not None:  # time each trim where it happens (the put that crosses the cap)
        real = b._cap.trim

        def timed(**kw):
            t = time.perf_counter()
            r = real(**kw)
            if r is not None:
                trims.append(time.perf_counter() - t)
            return r
        b._cap.trim = timed
    keys = page_hashes(list(range(4 * pages)), 4)
    payload = bytes(page)
    t0 = time.perf_counter()
    for i in range(0, pages, batch):
        b.put([(k, payload, [page]) for k in keys[i:i + batch]])
    dt = time.perf_counter() - t0
    on_disk = sum(f.size for f in scan(root)[0])
    assert not cap or on_disk <= cap, (on_disk, cap)
    b.close()
    return dt, b.stats().evicted, trims


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pages", type=int, default=4000)
    ap.add_argument("--page-kib", type=int, default=64)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--reps", type=int, default=3)
    a = ap.parse_args()
    page = a.page_kib << 10
    total = a.pages * page
    cases = {"unbounded (reference)": 0, "capped, never full (ledger only)": 4 * total,
             "capped at 1/10 of what is written (ledger + trims)": total // 10}
    res: dict[str, list[tuple[float, int, list[float]]]] = {c: [] for c in cases}
    for _ in range(a.reps):
        for case, cap in cases.items():
            d = Path(tempfile.mkdtemp(prefix="hc-cap-"))
            try:
                res[case].append(run(d, a.pages, page, a.batch, cap))
            finally:
                shutil.rmtree(d, ignore_errors=True)
    ref = statistics.median(r[0] for r in res["unbounded (reference)"])
    print(f"# file:// cap, {a.pages} pages of {a.page_kib} KiB in batches of {a.batch} "
          f"({total / 2**20:.0f} MiB written), {a.reps} reps (median)\n")
    print("| case | put MB/s | vs unbounded | pages evicted | trims | ms per trim |")
    print("|---|---:|---:|---:|---:|---:|")
    for case, rs in res.items():
        t = statistics.median(r[0] for r in rs)
        trims = [x for r in rs for x in r[2]]
        per = f"{statistics.median(trims) * 1e3:.1f}" if trims else "-"
        print(f"| {case} | {total / t / 1e6:.0f} | {ref / t:.0%} | {rs[-1][1]} | {len(rs[-1][2])} | {per} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
