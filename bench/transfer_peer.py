"""Page copies side by side, one process, one GPU: hicache's Triton kernel against a
peer kernel in SGLang's style, TMA bulk copies, copy-engine batches and the
contiguous copy of the same bytes (the limit), on the same random page ids.

    PYTHONPATH=. python3 bench/transfer_peer.py [--group main|tma|d2d] [--out DIR]

Shapes: Qwen3-8B KV (36 layers, K+V, 8 heads x 128, bf16) at pages 1, 16 and
64; DeepSeek-V3 MLA (61 layers of 576-dim bf16 latents, an fp8 index-K byte
plane of 132 bytes per token, one draft layer) at page 64. Every variant is run
once into a destination poisoned with fresh random bytes and then compared with
the expected pool byte for byte: copied pages equal their sources, every other
page is untouched. Only then is it timed (median of ``triton.testing.do_bench``).
``--group tma`` runs the TMA variants alone (a separate process, so that a
fault there cannot take the other figures with it). ``--group d2d`` sweeps hicache's
device-to-device tiles, row chunks and grids alone (no extension). Needs a CUDA GPU
(and nvcc, except for ``--group d2d``).
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import peer_cuda  # noqa: E402  (bench-local extension)

from hicache.kernels.page_copy import PageCopier  # noqa: E402
from hicache.kernels.plan import TileConfig  # noqa: E402
from hicache.kernels.page_copy import plane_pages  # noqa: E402
from hicache.core.layout import BytePlane, KVLayout  # noqa: E402
from hicache.memory.pools import DevicePool, HostPool  # noqa: E402

DEV = torch.device("cuda")


@dataclass
class Row:
    shape: str
    direction: str
    variant: str
    gbps: float
    limit: float
    cpu_us: float = float("nan")  # host time of one call (submission), where it matters


def bench_ms(fn) -> float:
    import triton.testing

    return triton.testing.do_bench(fn, warmup=25, rep=150, return_mode="median")


def cpu_us(fn, reps: int = 5) -> float:
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
        torch.cuda.synchronize()
    return 1e6 * sorted(ts)[len(ts) // 2]


# ------------------------------------------------------------------ shapes
def shapes(which: str) -> list[tuple[str, KVLayout, int]]:
    def qwen(ps):
        return KVLayout("qwen3-8b", 36, num_kv_heads=8, head_dim=128, page_size=ps)
    mla = KVLayout("dsv3", 61, kind="mla", kv_lora_rank=512, rope_dim=64, page_size=64,
                   extra_planes=(BytePlane("index_k", 132),), draft_layers=1)
    out = [("qwen8b-p16", qwen(16), 1024), ("qwen8b-p1", qwen(1), 16384), ("qwen8b-p64", qwen(64), 256),
           ("dsv3-mla-p64", mla, 256)]
    return [s for s in out if which in ("all", s[0])]


# ------------------------------------------------------------------ checking
def gpu_planes(pool) -> list[torch.Tensor]:
    """``uint8 [num_pages, page_bytes]`` per plane, on the GPU (a copy for host pools)."""
    if isinstance(pool, DevicePool):
        return [plane_pages(pool, j) for j in range(len(pool.layout.planes))]
    g = pool.buffer.to(DEV)
    return [g.as_strided((pool.num_pages, s.page_bytes), (pool.page_stride[s.index], 1), pool.plane_offset[s.index])
            for s in pool.layout.planes]


def poison(pool) -> list[torch.Tensor]:
    """Fill ``pool`` with fresh random bytes; return a GPU snapshot of its planes."""
    if isinstance(pool, DevicePool):
        for b in pool.buffers:
            b.view(-1).view(torch.uint8).random_(0, 256)
    else:
        g = torch.empty(pool.buffer.numel(), dtype=torch.uint8, device=DEV).random_(0, 256)
        pool.buffer.copy_(g)
    torch.cuda.synchronize()
    return [p.clone() for p in gpu_planes(pool)]


def verify(src, dst, sp, dp, snap: list[torch.Tensor], what: str) -> None:
    torch.cuda.synchronize()
    got, srcp = gpu_planes(dst), gpu_planes(src)
    spg, dpg = sp.to(DEV), dp.to(DEV)
    for j, (g, s, want) in enumerate(zip(got, srcp, snap)):
        exp = want.clone()
        exp.index_copy_(0, dpg, s.index_select(0, spg))
        if not torch.equal(g, exp):
            bad = (g != exp).any(1).nonzero().flatten()[:8].tolist()
            raise SystemExit(f"VALUE CHECK FAILED: {what}, plane {j}: pages {bad} differ "
                             f"(copied pages: {dp[:8].tolist()}...)")


# ------------------------------------------------------------------ variants
def chunk_table(src, dst, chunk: int) -> torch.Tensor:
    """int64 [t, 5] absolute (src_base, src_stride, dst_base, dst_stride, bytes) per chunk."""
    rows = []
    for s in src.layout.planes:
        (sb, ss), (db, ds) = addr(src, s.index), addr(dst, s.index)
        for off in range(0, s.page_bytes, chunk):
            rows.append([sb + off, ss, db + off, ds, min(chunk, s.page_bytes - off)])
    return torch.tensor(rows, dtype=torch.int64, device=DEV)


def addr(pool, j: int) -> tuple[int, int]:
    if isinstance(pool, DevicePool):
        return pool.buffers[j].data_ptr(), pool.layout.planes[j].page_bytes
    return pool.buffer.data_ptr() + pool.plane_offset[j], pool.page_stride[j]


def peer_tables(src, dst):
    """K then V base-pointer tables (MHA only), and the per-side page strides."""
    lay = src.layout
    ks = [p.index for p in lay.planes if p.name == "k"]
    vs = [p.index for p in lay.planes if p.name == "v"]
    st = {addr(src, j)[1] for j in ks + vs}
    dt = {addr(dst, j)[1] for j in ks + vs}
    assert len(st) == 1 and len(dt) == 1, (st, dt)
    s_tbl = torch.tensor([addr(src, j)[0] for j in ks + vs], dtype=torch.int64, device=DEV)
    d_tbl = torch.tensor([addr(dst, j)[0] for j in ks + vs], dtype=torch.int64, device=DEV)
    return s_tbl, d_tbl, len(ks), lay.planes[ks[0]].page_bytes, st.pop(), dt.pop()


def ce_arrays(src, dst, sp, dp):
    """Host int64 arrays (dsts, srcs, sizes): one copy per (page, plane)."""
    spn, dpn = sp.cpu().numpy(), dp.cpu().numpy()
    d, s, z = [], [], []
    for p in src.layout.planes:
        (sb, ss), (db, ds) = addr(src, p.index), addr(dst, p.index)
        s.append(sb + spn * ss)
        d.append(db + dpn * ds)
        z.append(np.full(len(spn), p.page_bytes, dtype=np.int64))
    return tuple(torch.from_numpy(np.ascontiguousarray(np.stack(x, 1).reshape(-1))) for x in (d, s, z))


def run_case(rows, shape, direction, src, dst, sp, dp, limit, group, ext):
    nbytes = len(sp) * src.layout.page_bytes
    mha = src.layout.kind == "mha"
    d2d = direction == "D2D"

    def add(name, fn, measure_cpu=False):
        snap = poison(dst)
        fn()
        verify(src, dst, sp, dp, snap, f"{shape} {direction} {name}")
        ms = bench_ms(fn)
        rows.append(Row(shape, direction, name, nbytes / ms / 1e6, limit, cpu_us(fn) if measure_cpu else float("nan")))
        print(f"  {shape:14s} {direction:14s} {name:34s} {rows[-1].gbps:8.1f} GB/s {100 * rows[-1].gbps / limit:6.1f}%",
              flush=True)

    if group == "main":
        cp = PageCopier()
        blocks = (132, 264, 528) if d2d else (4, 8, 16)
        for nb in blocks:
            add(f"hicache triton blocks={nb}", lambda nb=nb: cp.copy_pages(src, dst, sp, dp, num_blocks=nb))
        # tile variants: (tile, chunk, warps, streaming hints), at the default grid
        tiles = ((65536, 65536, 16), (16384, 16384, 4)) if d2d else ((131072, 65536, 8),)
        for tb, ch, w in tiles:
            t = TileConfig(tb, 4096, ch, w)
            c = PageCopier(pcie=t, d2d=t, d2d_whole_32k=t, d2d_large=t)  # this tile whatever the planes
            add(f"hicache triton tile={tb // 1024}K chunk={ch // 1024}K w={w}",
                lambda c=c: c.copy_pages(src, dst, sp, dp))
        if mha and ext is not None:
            st, dt, L, item, ss, ds = peer_tables(src, dst)
            grids = ((132, 32), (264, 16)) if d2d else ((2, 16), (2, 32), (8, 16), (8, 32), (16, 32))
            for b, w in grids:
                add(f"peer {b}x{w} warps", lambda b=b, w=w: ext.peer_copy(st, dt, sp, dp, L, 1, item, ss, ds, b, w))
        if ext is not None:
            arrs = ce_arrays(src, dst, sp, dp)
            with torch.cuda.stream(torch.cuda.Stream()):  # the batch API refuses the legacy default stream
                add(f"copy engine batch ({arrs[0].numel()} copies)", lambda: ext.ce_batch(*arrs), measure_cpu=True)
    elif group == "d2d":  # D2D tile / row-chunk / grid sweep of hicache's kernel alone
        sms = torch.cuda.get_device_properties(DEV).multi_processor_count
        for tb, ch, w in D2D_SWEEP:
            t = TileConfig(tb, 4096, ch, w)
            c = PageCopier(d2d=t, d2d_whole_32k=t, d2d_large=t)
            for per_sm in (2, 3, 4):
                add(f"hicache triton tile={tb // 1024}K chunk={ch // 1024}K w={w} blocks={per_sm}/SM",
                    lambda c=c, nb=per_sm * sms: c.copy_pages(src, dst, sp, dp, num_blocks=nb))
    else:
        for chunk, grid in ((32768, (132, 264) if d2d else (4, 8, 16, 32)), (16384, (264,) if d2d else (8,))):
            tbl = chunk_table(src, dst, chunk)
            for b in grid:
                add(f"tma blocks={b} chunk={chunk // 1024}K",
                    lambda b=b, tbl=tbl, c=chunk: ext.tma_copy(tbl, sp, dp, b, c))



# (tile bytes, row chunk bytes, warps) tried by ``--group d2d``
D2D_SWEEP = ((32768, 32768, 8), (65536, 65536, 16), (32768, 8192, 8), (65536, 8192, 16), (32768, 16384, 8),
             (65536, 16384, 16), (16384, 8192, 4), (65536, 32768, 16))


def contiguous_limits(hbuf: torch.Tensor, nbytes: int) -> dict[str, float]:
    """GB/s of one contiguous copy of ``nbytes`` per direction: the reference each
    scattered copy is measured against, in the same process."""
    big_d = torch.empty(nbytes, dtype=torch.uint8, device=DEV).random_(0, 256)
    big_d2 = torch.empty_like(big_d)
    big_h = hbuf[:nbytes]
    return {"D2H": nbytes / bench_ms(lambda: big_h.copy_(big_d, non_blocking=True)) / 1e6,
            "H2D": nbytes / bench_ms(lambda: big_d.copy_(big_h, non_blocking=True)) / 1e6,
            "D2D": nbytes / bench_ms(lambda: big_d2.copy_(big_d)) / 1e6}

def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--group", choices=("main", "tma", "d2d"), default="main")
    ap.add_argument("--shape", default="all")
    ap.add_argument("--out", default="")
    ap.add_argument("--directions", default="D2H,H2D,D2D", help="subset of D2H,H2D,D2D")
    ap.add_argument("--no-ext", action="store_true", help="hicache's own variants only (no nvcc build)")
    a = ap.parse_args()
    t0 = time.time()
    try:
        ext = None if a.no_ext or a.group == "d2d" else peer_cuda.load()
    except Exception as e:  # report and go on with hicache's own variants
        print(f"EXTENSION BUILD FAILED: {type(e).__name__}: {str(e)[-3000:]}", flush=True)
        if a.group == "tma":
            raise SystemExit(1)
        ext = None
    print(f"extension built/loaded in {time.time() - t0:.1f}s; {torch.cuda.get_device_name()}, "
          f"torch {torch.__version__}, cuda {torch.version.cuda}", flush=True)
    rows: list[Row] = []
    for shape, lay, n in shapes(a.shape):
        cap = 2 * n
        gen = torch.Generator().manual_seed(n)
        sp = torch.randperm(cap, generator=gen)[:n].to(DEV)
        dp = torch.randperm(cap, generator=gen)[:n].to(DEV)
        dev = DevicePool(lay, cap, device=DEV)
        dev2 = DevicePool(lay, cap, device=DEV)
        poison(dev)
        nbytes = n * lay.page_bytes
        hbytes = max(HostPool.nbytes_for(lay.replace(host_layout=h), cap) for h in ("layer_first", "page_first"))
        hbuf = torch.empty(hbytes, dtype=torch.uint8, pin_memory=True)
        lim = contiguous_limits(hbuf, nbytes)
        for k, v in lim.items():
            rows.append(Row(shape, k, "contiguous copy (limit)", v, v))
            print(f"  {shape:14s} {k:14s} {'contiguous copy (limit)':34s} {v:8.1f} GB/s", flush=True)
        dirs = a.directions.split(",")
        for hl in ("layer_first", "page_first"):
            host = HostPool(lay.replace(host_layout=hl), cap, buffer=hbuf)
            poison(host)
            if "D2H" in dirs:
                run_case(rows, shape, f"D2H {hl}", dev, host, sp, dp, lim["D2H"], a.group, ext)
            if "H2D" in dirs:
                run_case(rows, shape, f"H2D {hl}", host, dev, dp, sp, lim["H2D"], a.group, ext)
        if "D2D" in dirs:
            run_case(rows, shape, "D2D", dev, dev2, sp, dp, lim["D2D"], a.group, ext)
        del dev, dev2, hbuf
        torch.cuda.empty_cache()
    table = ["| shape | direction | variant | GB/s | % of contiguous | host us/call |", "|---|---|---|---:|---:|---:|"]
    for r in rows:
        table.append(f"| {r.shape} | {r.direction} | {r.variant} | {r.gbps:.1f} | {100 * r.gbps / r.limit:.1f} | "
                     + ("" if r.cpu_us != r.cpu_us else f"{r.cpu_us:.0f}") + " |")
    print("\n".join(table))
    if a.out:
        with open(os.path.join(a.out, f"peer_{a.group}.md"), "w") as f:
            f.write("\n".join(table) + "\n")


if __name__ == "__main__":
    main()
