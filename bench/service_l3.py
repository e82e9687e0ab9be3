"""The node-local service as an engine's L3 (``hicache+unix://``), side by side
with an in-process ``memory://`` L3: batch put / prefix_hits / get of the same
pages, and the service's write-behind to its own L3.

    python bench/service_l3.py [--pages 256] [--page-kib 32 512] [--repeat 5] [--threads 1]

``--threads`` sets torch's intra-op threads (``hicache replay`` uses 1 on CPU):
page copies are torch ``copy_`` calls, and on a busy 2-core box OpenMP
spinning makes a 512 KiB copy ~30x slower with 2 threads than with 1.

Prints one table: MiB/s of payload (median of ``--repeat`` runs) per backend,
page size and operation.
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
import uuid

import torch

from hicache.node.server import NodeServer
from hicache.core.config import HiCacheConfig
from hicache.core.hashing import page_hashes
from hicache.core.layout import KVLayout
from hicache.storage import open_storage


def layout_for(page_kib: int) -> KVLayout:
    # MHA, float32, page 16: one (k or v) plane page is 16 * heads * dim * 4 bytes.
    per_plane = page_kib * 1024 // 2
    dim = per_plane // (16 * 4)
    return KVLayout("bench-shared", num_layers=1, num_kv_heads=1, head_dim=dim, dtype="float32", page_size=16,
                    host_layout="page_first")


def run_ops(b, layout: KVLayout, pages: int, repeat: int) -> dict[str, float]:
    sizes = [p.page_bytes for p in layout.planes]
    out: dict[str, list[float]] = {"put": [], "prefix_hits": [], "get": []}
    for r in range(repeat):
        keys = page_hashes(list(range(r * 10**6, r * 10**6 + pages * 16)), 16)
        items = [(k, bytes([i % 251]) * layout.page_bytes, sizes) for i, k in enumerate(keys)]
        t = time.perf_counter()
        assert b.put(items) == pages
        out["put"].append(time.perf_counter() - t)
        t = time.perf_counter()
        assert b.prefix_hits(keys) == pages
        out["prefix_hits"].append(time.perf_counter() - t)
        t = time.perf_counter()
        got = b.get(keys, sizes)
        out["get"].append(time.perf_counter() - t)
        assert all(g is not None for g in got)
    return {k: statistics.median(v) for k, v in out.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pages", type=int, default=256)
    ap.add_argument("--page-kib", type=int, nargs="+", default=[32, 512])
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    rows = []
    for kib in a.page_kib:
        layout = layout_for(kib)
        mib = a.pages * layout.page_bytes / 2**20
        d = tempfile.mkdtemp(prefix="hcb", dir="/tmp")
        cfg = HiCacheConfig.load(env={}, overrides={
            "storage.url": "memory://", "pool.host_pages": str(a.pages * (a.repeat + 1)),
            "service.socket_path": f"{d}/s.sock", "service.shm_name": f"hcb-{uuid.uuid4().hex[:8]}"})
        service_l3 = open_storage("memory://", fingerprint=layout.fingerprint(), layout=layout)
        srv = NodeServer(cfg, layout, storage=service_l3)
        srv.start()
        try:
            for name, url in (("memory:// (in-process)", "memory://"),
                              ("hicache+unix:// (service)", f"hicache+unix://{d}/s.sock")):
                with open_storage(url, fingerprint=layout.fingerprint(), layout=layout, timeout_ms=1000) as b:
                    t = run_ops(b, layout, a.pages, a.repeat)
                rows.append([name, f"{kib}", *(f"{mib / t[op]:,.0f}" for op in ("put", "get")),
                             f"{t['prefix_hits'] * 1e6 / a.pages:.2f}"])
            t0 = time.perf_counter()
            want = a.pages * a.repeat
            while srv.stats().l3["written"] < want:
                time.sleep(0.001)
            lag = time.perf_counter() - t0
            l3 = srv.stats().l3
            rows.append([f"  service write-behind (written {l3['written']}, dropped {l3['dropped']})", f"{kib}",
                         "-", "-", f"drained {lag * 1e3:.0f} ms after the last put"])
        finally:
            srv.stop()
            service_l3.close()
    head = ["backend", "page KiB", "put MiB/s", "get MiB/s", "prefix_hits us/page"]
    widths = [max(len(str(r[i])) for r in [head, *rows]) for i in range(len(head))]
    print(f"{a.pages} pages per batch, median of {a.repeat}, torch threads {a.threads}")
    for r in [head, ["-" * w for w in widths], *rows]:
        print("  ".join(str(c).ljust(w) if i == 0 else str(c).rjust(w) for i, (c, w) in enumerate(zip(r, widths))))


if __name__ == "__main__":
    main()
