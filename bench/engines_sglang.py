"""SGLang section of bench/engines.py: HiCacheBackend against SGLang's own HiCacheFile,
and redis:// page_first against layer_first. Runs in .venv-sglang:

    PYTHONPATH=. .venv-sglang/bin/python bench/engines.py sglang [--redis URL] [--rounds 7]

1. For every model of hicache/data/real_models.json at SGLang's page sizes (1 and
   16; MLA 1 and 64, see tests/integrations/sglang/test_real_shapes.py), all its
   layers, page_first host pools (SGLang's default): a batch of pages stored and
   loaded through SGLang's own HiCacheController page functions, as its storage
   threads call them: hicache ``file://`` through the zero-copy v1 path
   (``_page_set_zero_copy`` / ``_page_get_zero_copy``) and SGLang's ``HiCacheFile``
   through the generic path it uses (``_generic_page_set`` / ``_generic_page_get``),
   both on the same tmpfs (/dev/shm), fresh keys each round, rounds interleaved,
   medians. GB/s of page payload.
2. redis://, Llama-3.1-8B at page 16 (2 MiB pages): the SGLang backend's v1 load in
   both host layouts, and hicache's own L3 -> L2 load (``StorageBackend.get`` then
   ``HostPool.write_page``) in both layouts, with the torch copy that write_page
   used before (``torch.frombuffer(bytearray(p))`` + ``copy_``) beside it.
"""
from __future__ import annotations

import argparse
import pathlib
import shutil
import statistics
import sys
import tempfile
import threading
import time
import uuid

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "integrations" / "sglang"))
import launch  # noqa: E402  (SGLang's pools for a shape; puts the torchvision stand-in on sys.path first)

BATCH_BYTES = 32 << 20  # payload per batch: pages of a few KiB come 64 at a time, MiB pages 8+
MAX_PAGES = 64


def controller(m, page: int, backend: str, extra: dict, layout: str = "page_first"):
    from sglang.srt.managers.cache_controller import HiCacheController
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
    from sglang.srt.runtime_context import get_parallel
    n = batch_pages(m, page)
    dev, host = launch.real_pools(m, page, layout, dev_pages=n)
    alloc = PagedTokenToKVPoolAllocator(dev.size, page, dev.dtype, "cpu", dev, False)
    with get_parallel().override(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_dcp_size=1, attn_dcp_rank=0):
        return HiCacheController(alloc, host, page, None, threading.Event(), storage_backend=backend,
                                 model_name=f"bench-{m.name}", storage_backend_extra_config=extra)


def batch_pages(m, page: int) -> int:
    return max(4, min(MAX_PAGES, BATCH_BYTES // m.page_bytes(page)))


def dynamic(url: str, **kw) -> dict:
    return {"backend_name": "hicache", "module_path": "hicache.integrations.sglang",
            "class_name": "HiCacheBackend", "interface_v1": 1, "url": url, **kw}


def time_pair(ctrl, page: int, n: int, zero_copy: bool, seed: int, idx) -> tuple[float, float]:
    """Seconds to store then load ``n`` fresh pages through the controller's page functions."""
    from sglang.srt.managers.cache_controller import PrefetchOperation
    from sglang.srt.mem_cache.utils import get_storage_hash_str
    keys = get_storage_hash_str([seed * 10_000_019 + i for i in range(n * page)], None, page_size=page)
    put = ctrl._page_set_zero_copy if zero_copy else ctrl._generic_page_set
    get = ctrl._page_get_zero_copy if zero_copy else ctrl._generic_page_get
    t0 = time.perf_counter()
    assert put(keys, idx), "store failed"
    t1 = time.perf_counter()
    got = get(PrefetchOperation("bench", []), keys, idx)
    t2 = time.perf_counter()
    assert got == n, f"loaded {got} of {n}"
    return t1 - t0, t2 - t1


def file_vs_hicachefile(rounds: int, only: set[str] | None, mac: bool = False, tmp: str = "/dev/shm") -> list[dict]:
    from engines_corrupt import SECRET

    from hicache.core.shapes import model_shapes
    rows = []
    for m in model_shapes():
        if only and m.name not in only:
            continue
        for page in ((1, 64) if m.is_mla else (1, 16)):
            d = tempfile.mkdtemp(prefix="hicache-bench-", dir=tmp)
            try:
                ctrls = {"ours": controller(m, page, "dynamic", dynamic(f"file://{d}/hicache")),
                         "ref": controller(m, page, "file", {"file_storage_path": f"{d}/sglang"})}
                if mac:
                    ctrls["mac"] = controller(m, page, "dynamic", dynamic(f"file://{d}/hicache-mac", auth_key=SECRET))
                n = batch_pages(m, page)
                t: dict[str, list] = {k: [] for k in ctrls}
                idx = {k: c.mem_pool_host.alloc(n * page) for k, c in ctrls.items()}
                order = list(ctrls.items())
                for r in range(rounds):  # interleaved, the order flipped every round
                    for name, c in order if r % 2 == 0 else order[::-1]:
                        t[name].append(time_pair(c, page, n, name != "ref", seed=r, idx=idx[name]))
                    for c in ctrls.values():  # keep tmpfs small (fresh keys each round), each backend's own clear()
                        c.storage_backend.clear()
                ctrls["ours"].storage_backend.check_integrity()
                gb = n * m.page_bytes(page) / 1e9
                med = {k: (gb / statistics.median(x[0] for x in v), gb / statistics.median(x[1] for x in v))
                       for k, v in t.items()}
                rows.append(dict(model=m.name, page=page, kib=m.page_bytes(page) // 1024, pages=n,
                                 store=med["ours"][0], store_ref=med["ref"][0], load=med["ours"][1],
                                 load_ref=med["ref"][1], **({"store_mac": med["mac"][0], "load_mac": med["mac"][1]}
                                                            if mac else {})))
                for c in ctrls.values():
                    c.detach_storage_backend()
            finally:
                shutil.rmtree(d, ignore_errors=True)
            print_row(rows[-1])
    return rows


def print_header() -> None:
    print(f"{'model':<20} {'page':>4} {'KiB/page':>8} {'pages':>5} | {'store GB/s hicache':>18} {'HiCacheFile':>11} "
          f"{'ratio':>6} | {'load GB/s hicache':>17} {'HiCacheFile':>11} {'ratio':>6} | MAC store, load (x default)",
          flush=True)


def print_row(r: dict) -> None:
    mac = (f" | {r['store_mac']:.2f} ({r['store_mac'] / r['store']:.2f}x), {r['load_mac']:.2f} "
           f"({r['load_mac'] / r['load']:.2f}x)" if "store_mac" in r else "")
    print(f"{r['model']:<20} {r['page']:>4} {r['kib']:>8} {r['pages']:>5} | {r['store']:>18.2f} {r['store_ref']:>11.2f} "
          f"{r['store'] / r['store_ref']:>5.2f}x | {r['load']:>17.2f} {r['load_ref']:>11.2f} "
          f"{r['load'] / r['load_ref']:>5.2f}x{mac}", flush=True)


def redis_layouts(url: str, rounds: int) -> None:
    """SGLang backend v1 and hicache's own L3 -> L2 load at 2 MiB pages, both layouts."""
    import torch
    from sglang.srt.managers.cache_controller import PrefetchOperation
    from sglang.srt.mem_cache.utils import get_storage_hash_str

    from hicache.memory.pools import HostPool
    from hicache.core.shapes import model_shape
    from hicache.storage import open_storage
    m, page = model_shape("llama-3.1-8b"), 16
    n = batch_pages(m, page)
    gb = n * m.page_bytes(page) / 1e9
    ctrls = {hl: controller(m, page, "dynamic", dynamic(url, timeout_ms=5000, key_prefix=f"bench-{uuid.uuid4().hex[:8]}-{hl}:"),
                            layout=hl) for hl in ("page_first", "layer_first")}
    times: dict[str, list[float]] = {}
    pools, stores = {}, {}
    for hl in ("page_first", "layer_first"):
        lay = m.kv_layout(page, host_layout=hl)
        pools[hl] = HostPool(lay, n)
        stores[hl] = open_storage(url, fingerprint=lay.fingerprint(), timeout_ms=5000,
                                  key_prefix=f"bench-{uuid.uuid4().hex[:8]}:")
    sizes = {hl: [p.page_bytes for p in pools[hl].layout.planes] for hl in pools}
    hkeys = [i.to_bytes(16, "big") for i in range(n)]
    for hl, st in stores.items():
        assert st.put([(k, bytes([i]) * m.page_bytes(page), sizes[hl]) for i, k in enumerate(hkeys)]) == n

    def old_write_page(pool, p, payload):  # HostPool.write_page before this change
        src = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        if pool.layout.host_layout == "page_first":
            pool.page_region(p).copy_(src)
            return
        at = 0
        for i, s in enumerate(pool.layout.planes):
            pool._raw(i, p).copy_(src[at:at + s.page_bytes])
            at += s.page_bytes

    for r in range(rounds):
        for hl, c in ctrls.items():
            keys = get_storage_hash_str([r * 1_000_003 + i for i in range(n * page)], None, page_size=page)
            idx = c.mem_pool_host.alloc(n * page)
            t0 = time.perf_counter()
            assert c._page_set_zero_copy(keys, idx)
            t1 = time.perf_counter()
            assert c._page_get_zero_copy(PrefetchOperation("b", []), keys, idx) == n
            t2 = time.perf_counter()
            c.mem_pool_host.free(idx)
            c.storage_backend.store.clear()
            times.setdefault(f"SGLang backend store, {hl}", []).append(t1 - t0)
            times.setdefault(f"SGLang backend load, {hl}", []).append(t2 - t1)
        for hl, st in stores.items():
            for label, write in (("write_page now", lambda pool, p, v: pool.write_page(p, v)),
                                 ("write_page before (torch copy_)", old_write_page)):
                t0 = time.perf_counter()
                views = st.get(hkeys, sizes[hl])
                for p, v in enumerate(views):
                    write(pools[hl], p, v)
                times.setdefault(f"hicache L3 -> L2 load, {hl}, {label}", []).append(time.perf_counter() - t0)
    for st in stores.values():
        st.clear()
        st.close()
    for c in ctrls.values():
        c.detach_storage_backend()
    print(f"\nredis:// {url.split('@')[-1]}, {m.name} page {page}: {n} pages of {m.page_bytes(page) // 1024} KiB "
          f"per batch, median of {rounds}; torch intra-op threads {torch.get_num_threads()}")
    for name, v in times.items():
        print(f"  {name:<62} {gb / statistics.median(v):6.2f} GB/s")


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(prog="bench/engines.py sglang", description=__doc__.split("\n")[0])
    ap.add_argument("--redis", default="redis://127.0.0.1:6379/9")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--models", default="", help="comma-separated shape names (default: all)")
    ap.add_argument("--skip-file", action="store_true")
    ap.add_argument("--skip-redis", action="store_true")
    ap.add_argument("--corrupt", action="store_true", help="count wrong bytes handed to SGLang per damage kind "
                    "(the first model of --models, default llama-3.1-8b, at page 16)")
    ap.add_argument("--mac", action="store_true", help="also time HiCacheBackend with storage.auth_key")
    ap.add_argument("--disk", default="", help="also run on this directory of a real disk (e.g. /var/tmp)")
    a = ap.parse_args(argv)
    import logging
    logging.getLogger("sglang").setLevel(logging.ERROR)
    if a.corrupt:
        from engines_corrupt import print_counts, sglang_corrupt
        from hicache.core.shapes import model_shape
        logging.getLogger("hicache").setLevel(logging.ERROR)
        m = model_shape((a.models.split(",")[0] if a.models else "") or "llama-3.1-8b")
        return print_counts(f"SGLang, {m.name} page 16 ({m.page_bytes(16) // 1024} KiB pages)",
                            sglang_corrupt(m, 16, controller, dynamic))
    if not a.skip_file:
        print(f"hicache file:// (zero-copy v1) vs SGLang HiCacheFile, page_first host pools, "
              f"median of {a.rounds} interleaved rounds")
        print_header()
        for medium, tmp in (("tmpfs", "/dev/shm"), *((("disk", a.disk),) if a.disk else ())):
            print(f"-- {medium} ({tmp})", flush=True)
            file_vs_hicachefile(a.rounds, set(filter(None, a.models.split(","))) or None, a.mac, tmp)
    if not a.skip_redis:
        redis_layouts(a.redis, a.rounds)


if __name__ == "__main__":
    main(sys.argv[1:])
