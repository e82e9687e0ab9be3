"""Context parallelism across GPUs through the host tier, checked against cp_size 1.

One process drives ``cp`` ranks, rank ``r`` on ``cuda:r`` with its own
``PrefixCache`` and L1 pool. Each rank stores the rows of the pages it owns
(round robin) with ``store_rows`` from a row batch that also carries CP
page-tail and static padding rows poisoned with a sentinel, backs its pages
up to its pinned L2 pool (D2H, all ranks at once), and a decode side (cp 1,
``cuda:0``) assembles the full logical pages from the ranks' L2 pools in
global order (H2D, ``hicache.transfer.cp_assemble.assemble``). The assembled pages are
compared byte for byte with a cp_size 1 run that stored the same rows.

    PYTHONPATH=. python bench/cp_h200.py [--tokens 8199] [--layers 32] [--out file.json]

Model shape: Llama-3-8B KV (8 KV heads x 128, bf16) plus one draft layer,
page 16. Without CUDA it runs a tiny CPU smoke version.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from hicache.index.prefix_cache import PrefixCache
from hicache.core.cp import CPRowOrder, RoundRobin
from hicache.transfer.cp_assemble import RankPages, RequestRows, assemble, rank_batch, store_batch
from hicache.kernels.page_copy import copy_pages
from hicache.core.layout import KVLayout
from hicache.memory.pools import DevicePool, HostPool

SENTINEL = 12352.0  # exactly representable in bf16; random rows never reach it


class Timer:
    """CUDA events on each device (wall clock on CPU)."""

    def __init__(self, devs):
        self.devs = [torch.device(d) for d in devs]

    def __enter__(self):
        self.sync()
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.sync()
        self.s = time.perf_counter() - self.t0

    def sync(self):
        for d in self.devs:
            if d.type == "cuda":
                torch.cuda.synchronize(d)


def layout_for(args, rank=0, cp=1) -> KVLayout:
    return KVLayout(model_id="cp-bench", num_layers=args.layers, num_kv_heads=args.heads, head_dim=args.head_dim,
                    dtype=args.dtype, page_size=args.page, draft_layers=1, cp_rank=rank, cp_size=cp,
                    host_layout="page_first")


def global_rows(layout: KVLayout, plane: int, n: int, dev) -> torch.Tensor:
    s = layout.planes[plane]
    g = torch.Generator(device=dev).manual_seed(1000 + plane)
    return torch.randn((n, *s.row_shape), generator=g, device=dev, dtype=torch.float32).to(s.dtype)


def run_rank_cache(layout, n_tokens, dev, tokens, extra_pages=8):
    pages = -(-n_tokens // layout.page_size)
    own = RoundRobin(layout.cp_size).count(0, pages, layout.cp_rank) + extra_pages
    pool = DevicePool(layout, own, device=dev)
    cache = PrefixCache(layout, pool)
    # scatter: take pages in a shuffled order so the copies are not contiguous
    perm = torch.randperm(own, generator=torch.Generator().manual_seed(layout.cp_rank)).tolist()
    cache.device_allocator.alloc(own)
    cache.device_allocator.free(perm)
    req = cache.new_request("r", tokens)
    req.lock(req.match())
    req.alloc(n_tokens)
    return pool, cache, req


def store_all(layout, pool, req, order, rank, n, src_dev, static_rows):
    q = [RequestRows(0, n, req.pages)]
    batch = rank_batch(order, rank, q, static_rows)
    pos = batch.positions.to(src_dev)
    keep = (batch.provenance == 0).to(src_dev)
    written = 0
    for i in range(len(layout.planes)):  # plane by plane keeps memory small
        g = global_rows(layout, i, -(-n // layout.page_size) * layout.page_size, src_dev)
        rows = g[pos.clamp(min=0)]
        rows[~keep] = SENTINEL
        written = store_batch(pool, [i], [rows.to(pool.device)], batch, order, rank, q)
    return written, batch


def main() -> None:
    ap = argparse.ArgumentParser()
    cuda = torch.cuda.is_available()
    ap.add_argument("--tokens", type=int, default=8199 if cuda else 45)
    ap.add_argument("--layers", type=int, default=32 if cuda else 2)
    ap.add_argument("--heads", type=int, default=8 if cuda else 2)
    ap.add_argument("--head-dim", type=int, default=128 if cuda else 4)
    ap.add_argument("--page", type=int, default=16 if cuda else 4)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--cp", type=int, default=2)
    ap.add_argument("--reps", type=int, default=5 if cuda else 1)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    ngpu = torch.cuda.device_count() if cuda else 0
    devs = [f"cuda:{r % max(ngpu, 1)}" if cuda else "cpu" for r in range(args.cp)]
    n, ps = args.tokens, args.page
    pages = -(-n // ps)
    tokens = list(range(1, n + 1))
    print(f"# cp={args.cp} devices={devs} (visible GPUs: {ngpu}) tokens={n} pages={pages} "
          f"layers={args.layers}+1 draft, page_bytes={layout_for(args).page_bytes}")

    # ---- cp_size 1 reference on device 0
    lay1 = layout_for(args)
    pool1, _, req1 = run_rank_cache(lay1, n, devs[0], tokens)
    order1 = CPRowOrder(RoundRobin(1), ps)
    store_all(lay1, pool1, req1, order1, 0, n, devs[0], None)

    # ---- CP ranks: each stores only its owned rows, then backs them up to its pinned L2
    own = RoundRobin(args.cp)
    order = CPRowOrder(own, ps)
    ranks = []
    for r in range(args.cp):
        lay = layout_for(args, r, args.cp)
        pool, cache, req = run_rank_cache(lay, n, devs[r], tokens)
        static = -(-(len(order.local_positions(0, n, r)) + ps) // 256) * 256
        written, batch = store_all(lay, pool, req, order, r, n, devs[0], static)
        host = HostPool(lay, len(req.pages) + 4, pin=cuda)
        hp = host.allocator.alloc(len(req.pages))
        ranks.append(dict(rank=r, pool=pool, req=req, host=host, hp=hp, written=written,
                          rows=int(batch.slot_ids.numel()), tail=int((batch.provenance == 1).sum()),
                          pad=int((batch.provenance == 2).sum())))
        # placement: rank r's pool holds exactly its owned pages
        nz = torch.zeros(pool.num_pages, dtype=torch.bool, device=pool.device)
        for b in pool.buffers:
            nz |= b.view(pool.num_pages, -1).ne(0).any(1)
        held = torch.zeros_like(nz)
        held[torch.as_tensor(req.pages, device=pool.device)] = True
        assert torch.equal(nz, held), f"rank {r}: pages written outside its owned pages"
    t_d2h = []
    for rep in range(args.reps + 1):
        with Timer(devs) as t:
            for rk in ranks:  # launches are asynchronous: the ranks' copies overlap
                with torch.cuda.device(rk["pool"].device) if cuda else _null():
                    copy_pages(rk["pool"], rk["host"], rk["req"].pages, rk["hp"])
        if rep:
            t_d2h.append(t.s)

    # ---- decode side (cp 1) assembles from the ranks' L2 in global order
    dec = DevicePool(lay1, pages + 4, device=devs[0])
    dst = torch.randperm(pages + 4, generator=torch.Generator().manual_seed(9))[:pages].tolist()
    rp = [RankPages(rk["host"], rk["hp"]) for rk in ranks]
    t_h2d = []
    for rep in range(args.reps + 1):
        with Timer(devs) as t:
            assemble(own, rp, dec, dst)
        if rep:
            t_h2d.append(t.s)

    # ---- check: every plane of every logical page equals the cp_size 1 run's bytes
    s_dec, s_ref = dec.slot_ids(dst).to(dec.device), pool1.slot_ids(req1.pages).to(pool1.device)
    bad = [i for i, (a, b) in enumerate(zip(dec.buffers, pool1.buffers))
           if not torch.equal(a[s_dec].view(torch.uint8), b[s_ref].view(torch.uint8))]
    sentinel_hits = sum(int((b[s_dec].float() == SENTINEL).sum()) for b in dec.buffers)
    # cp_size 1 baseline for the same bytes: D2H then H2D on one GPU
    host1 = HostPool(lay1, pages + 4, pin=cuda)
    hp1 = host1.allocator.alloc(pages)
    t1_d2h, t1_h2d = [], []
    for rep in range(args.reps + 1):
        with Timer(devs[:1]) as t:
            copy_pages(pool1, host1, req1.pages, hp1)
        with Timer(devs[:1]) as t2:
            copy_pages(host1, dec, hp1, dst)
        if rep:
            t1_d2h.append(t.s)
            t1_h2d.append(t2.s)
    total = pages * lay1.page_bytes
    med = statistics.median
    rows = [
        ("cp%d D2H, all ranks concurrently" % args.cp, total, med(t_d2h)),
        ("cp%d assemble H2D into cp1 decode" % args.cp, total, med(t_h2d)),
        ("cp1 D2H (one GPU)", total, med(t1_d2h)),
        ("cp1 H2D (one GPU)", total, med(t1_h2d)),
    ]
    print(f"{'step':40} {'MiB':>9} {'ms':>9} {'GB/s':>7}")
    for name, b, s in rows:
        print(f"{name:40} {b / 2**20:9.1f} {s * 1e3:9.3f} {b / s / 1e9:7.2f}")
    for rk in ranks:
        print(f"rank {rk['rank']} on {rk['pool'].device}: {len(rk['req'].pages)} pages, batch rows {rk['rows']} "
              f"(VALID {rk['written']}, CP_PAGE_TAIL {rk['tail']}, STATIC_PAD {rk['pad']})")
    ok = not bad and sentinel_hits == 0
    print(f"assembled == cp_size 1: {ok} (planes differing: {bad}, sentinel rows: {sentinel_hits})")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(ok=ok, devices=devs, rows=[dict(step=a, bytes=b, s=s) for a, b, s in rows],
                           ranks=[{k: v for k, v in rk.items() if k in ("rank", "rows", "written", "tail", "pad")}
                                  for rk in ranks]), f, indent=1)
    if not ok:
        raise SystemExit(1)


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


if __name__ == "__main__":
    main()
