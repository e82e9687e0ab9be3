"""Page-copy bandwidth: hicache kernels against the contiguous pinned-copy limit.

Model: 32 layers, K and V, 8 KV heads x 128 dims, bf16 (4 KiB per token per
layer), page sizes 1, 16 and 64 tokens, pages scattered at random on both sides.

    PYTHONPATH=. python bench/transfer.py [--mib 512] [--out results.md]
    PYTHONPATH=. python bench/transfer.py --shape deepseek-v3 --page-sizes 64

``--shape NAME`` replaces that model with a published one from
``hicache/data/real_models.json`` (``hicache.core.shapes``): its planes (MLA
latents, a draft layer), row and page bytes, and by default all its layers
on a GPU (``--layers`` for fewer).

Prints, per page size: the contiguous pinned copy (the limit) in each
direction; hicache D2H and H2D, all layers per launch and one layer per
launch, both host layouts; D2D against a contiguous device copy; a per-page
cudaMemcpyAsync loop; the torch index_select + copy path; then bandwidth
against the number of programs (thread blocks) and tile size. Without a GPU it
runs a tiny smoke version (interpreted kernel, wall-clock timing).

The side-by-side run against an SGLang-style peer kernel, TMA bulk copies and
copy-engine batches (built with nvcc on the GPU machine) is
``bench/transfer_peer.py``; results in bench/RESULTS.md.
"""
from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass

import torch

from hicache.kernels.page_copy import D2D_TILES, PCIE_TILES, PageCopier, copy_pages
from hicache.kernels.plan import TileConfig
from hicache.kernels.page_copy import plane_pages
from hicache.core.layout import KVLayout
from hicache.memory.pools import DevicePool, HostPool
from hicache.core.shapes import model_shape, shape_names

CUDA = torch.cuda.is_available()
DEV = torch.device("cuda" if CUDA else "cpu")


@dataclass
class Row:
    section: str
    page_size: int
    case: str
    gbps: float
    ref: float  # the figure this row is compared with (GB/s)

    @property
    def pct(self) -> float:
        return 100.0 * self.gbps / self.ref if self.ref else float("nan")


def timed_ms(fn, reps: int = 20) -> float:
    """Median milliseconds of ``fn`` (device events on a GPU, wall clock otherwise)."""
    if CUDA:
        import triton.testing

        return triton.testing.do_bench(fn, warmup=20, rep=reps * 10, return_mode="median")
    fn()
    ts = []
    for _ in range(3):
        t = time.perf_counter()
        fn()
        ts.append((time.perf_counter() - t) * 1e3)
    return statistics.median(ts)


def wall_ms(fn) -> float:
    """One synchronised wall-clock run (for CPU-bound loops of many tiny copies)."""
    fn()
    if CUDA:
        torch.cuda.synchronize()
    t = time.perf_counter()
    fn()
    if CUDA:
        torch.cuda.synchronize()
    return (time.perf_counter() - t) * 1e3


def gbps(nbytes: int, ms: float) -> float:
    return nbytes / ms / 1e6


def layout_for(ps: int, host_layout: str, layers: int, shape: str = "") -> KVLayout:
    """The benched layout: ``shape`` (a published model, ``--shape``) or 8 KV heads x 128 bf16."""
    if shape:
        return model_shape(shape).kv_layout(ps, layers=layers, host_layout=host_layout)
    return KVLayout("bench-8x128-bf16", num_layers=layers, num_kv_heads=8, head_dim=128,
                    dtype="bfloat16", page_size=ps, host_layout=host_layout)


def check_copy(src, dst, sp, dp, planes) -> None:
    """Byte-compare a few copied pages on every plane (catches a wrong kernel before timing)."""
    k = min(len(sp), 4)
    for j in planes:
        a = plane_pages(src, j)[sp[:k].to(plane_pages(src, j).device)].cpu()
        b = plane_pages(dst, j)[dp[:k].to(plane_pages(dst, j).device)].cpu()
        assert torch.equal(a, b), f"copy check failed on plane {j}"


def run_page_size(ps: int, mib: int, layers: int, host_buf: torch.Tensor, rows: list[Row],
                  sweep: bool, shape: str = "") -> None:
    lay = layout_for(ps, "layer_first", layers, shape)
    n = max(1, (mib << 20) // lay.page_bytes)  # pages moved per copy
    cap = 2 * n  # pools twice the copy, so the scatter is real
    nbytes = n * lay.page_bytes
    gen = torch.Generator().manual_seed(ps)
    dev = DevicePool(lay, cap, device=DEV)
    torch.manual_seed(ps)
    for b in dev.buffers:
        b.view(torch.uint8).copy_(torch.randint(0, 256, b.view(torch.uint8).shape, dtype=torch.uint8, device=DEV))
    dev2 = DevicePool(lay, cap, device=DEV)
    hosts = {hl: HostPool(layout_for(ps, hl, layers, shape), cap, buffer=host_buf) for hl in ("layer_first", "page_first")}
    sp = torch.randperm(cap, generator=gen)[:n].to(DEV)
    dp = torch.randperm(cap, generator=gen)[:n].to(DEV)
    every = list(range(len(lay.planes)))

    # The limits: contiguous copies of the same bytes.
    big_d = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=DEV)
    big_h = host_buf[:nbytes]
    d2h_lim = gbps(nbytes, timed_ms(lambda: big_h.copy_(big_d, non_blocking=True)))
    h2d_lim = gbps(nbytes, timed_ms(lambda: big_d.copy_(big_h, non_blocking=True)))
    big_d2 = torch.empty_like(big_d)
    d2d_lim = gbps(nbytes, timed_ms(lambda: big_d2.copy_(big_d)))
    rows += [Row("limit", ps, "contiguous pinned D2H", d2h_lim, d2h_lim),
             Row("limit", ps, "contiguous pinned H2D", h2d_lim, h2d_lim),
             Row("limit", ps, "contiguous D2D (payload rate)", d2d_lim, d2d_lim)]

    cp = PageCopier()
    for hl, host in hosts.items():
        for name, s, d, a, b, lim in (("D2H", dev, host, sp, dp, d2h_lim), ("H2D", host, dev, dp, sp, h2d_lim)):
            cp.copy_pages(s, d, a, b)
            if CUDA:
                torch.cuda.synchronize()
            check_copy(s, d, a, b, every)
            t = timed_ms(lambda: cp.copy_pages(s, d, a, b))
            rows.append(Row("hicache", ps, f"{name} all-layer {hl}", gbps(nbytes, t), lim))
            per_layer = ([[p.index for p in lay.planes_of_layer(i)] for i in range(lay.num_layers)]
                         + [[p.index for p in lay.planes_of_layer(i, draft=True)] for i in range(lay.draft_layers)])

            def layerwise():
                for pl in per_layer:
                    cp.copy_pages(s, d, a, b, planes=pl)
            t = timed_ms(layerwise)
            rows.append(Row("hicache", ps, f"{name} per-layer {hl}", gbps(nbytes, t), lim))
    cp.copy_pages(dev, dev2, sp, dp)
    if CUDA:
        torch.cuda.synchronize()
    check_copy(dev, dev2, sp, dp, every)
    t = timed_ms(lambda: cp.copy_pages(dev, dev2, sp, dp))
    rows.append(Row("hicache", ps, "D2D all-layer", gbps(nbytes, t), d2d_lim))

    # Baselines.
    host = hosts["layer_first"]
    k = min(n, max(1, 64 * 16 // ps))  # pages for the per-page memcpy loop (CPU-bound)
    pairs = list(zip(sp[:k].tolist(), dp[:k].tolist()))
    views = [(plane_pages(dev, j), plane_pages(host, j)) for j in every]

    def memcpy_loop():
        for a, b in pairs:
            for dv, hv in views:
                hv[b].copy_(dv[a], non_blocking=True)
    t = wall_ms(memcpy_loop)
    rows.append(Row("baseline", ps, f"per-page cudaMemcpyAsync D2H ({k} pages x {len(every)} planes)",
                    gbps(k * lay.page_bytes, t), d2h_lim))
    for name, s, d, a, b, lim in (("D2H", dev, host, sp, dp, d2h_lim), ("H2D", host, dev, dp, sp, h2d_lim)):
        t = wall_ms(lambda: copy_pages(s, d, a, b, backend="torch"))
        rows.append(Row("baseline", ps, f"torch index_select + copy {name}", gbps(nbytes, t), lim))

    if not sweep:
        return
    # Bandwidth against programs (thread blocks) and tile size, all layers, layer_first.
    for tile, warps, blocks in ((65536, 8, (1, 2, 4, 8, 16, 32)), (32768, 8, (4, 8, 16)), (131072, 16, (4, 8))):
        c = PageCopier(pcie=TileConfig(tile, 4096, tile, warps))
        for nb in blocks:
            for name, s, d, a, b, lim in (("D2H", dev, host, sp, dp, d2h_lim), ("H2D", host, dev, dp, sp, h2d_lim)):
                t = timed_ms(lambda: c.copy_pages(s, d, a, b, num_blocks=nb))
                rows.append(Row("blocks", ps, f"{name} tile={tile // 1024}K warps={warps} blocks={nb}",
                                gbps(nbytes, t), lim))
    for tile, chunk, warps in ((32768, 32768, 8), (32768, 8192, 8), (32768, 2048, 8), (65536, 65536, 8),
                               (16384, 16384, 4)):
        tc = TileConfig(tile, 4096, chunk, warps)
        c = PageCopier(d2d=tc, d2d_whole_32k=tc, d2d_large=tc)  # this tile whatever the plane sizes
        for nb in (132, 264, 528):
            t = timed_ms(lambda: c.copy_pages(dev, dev2, sp, dp, num_blocks=nb))
            rows.append(Row("blocks", ps, f"D2D tile={tile // 1024}K chunk={chunk // 1024}K warps={warps} "
                            f"blocks={nb}", gbps(nbytes, t), d2d_lim))


def launch_overhead_us(layers: int, shape: str = "") -> float:
    """CPU time of one per-layer ``copy_pages`` call moving one page (plan cached)."""
    lay = layout_for(16, "layer_first", layers, shape)
    d, h = DevicePool(lay, 4, device=DEV), HostPool(lay, 4)
    a = torch.tensor([1], device=DEV)
    pl = [p.index for p in lay.planes_of_layer(0)]
    cp = PageCopier()
    cp.copy_pages(d, h, a, a, planes=pl)
    reps = 2000 if CUDA else 20
    if CUDA:
        torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(reps):
        cp.copy_pages(d, h, a, a, planes=pl)
    dt = (time.perf_counter() - t) / reps * 1e6
    if CUDA:
        torch.cuda.synchronize()
    return dt


def render(rows: list[Row]) -> str:
    out = ["| section | page | case | GB/s | % of ref |", "|---|---:|---|---:|---:|"]
    for r in rows:
        out.append(f"| {r.section} | {r.page_size} | {r.case} | {r.gbps:.1f} | {r.pct:.1f} |")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mib", type=int, default=512 if CUDA else 1, help="MiB moved per copy")
    ap.add_argument("--layers", type=int, default=0,
                    help="layers (default: 32, or the --shape model's; 2 without a GPU)")
    ap.add_argument("--shape", default="", choices=["", *shape_names()],
                    help="a published model's KV shape (hicache.core.shapes) instead of 8 KV heads x 128 bf16")
    ap.add_argument("--page-sizes", default="1,16,64")
    ap.add_argument("--no-sweep", action="store_true")
    ap.add_argument("--out", default="", help="also write the markdown table here")
    args = ap.parse_args()
    shape = args.shape
    if not args.layers:
        args.layers = 2 if not CUDA else model_shape(shape).attention_layers if shape else 32
    sizes = [int(x) for x in args.page_sizes.split(",")]
    hb = max(HostPool.nbytes_for(layout_for(ps, hl, args.layers, shape), 2 * max(1, (args.mib << 20) //
                                 layout_for(ps, hl, args.layers, shape).page_bytes))
             for ps in sizes for hl in ("layer_first", "page_first"))
    host_buf = torch.empty(hb, dtype=torch.uint8, pin_memory=CUDA)
    step = 64 << 20  # random bytes everywhere (never time on zeros)
    for at in range(0, hb, step):
        m = min(step, hb - at)
        host_buf[at:at + m].copy_(torch.randint(0, 256, (m,), dtype=torch.uint8, device=DEV))
    rows: list[Row] = []
    for ps in sizes:
        before = len(rows)
        run_page_size(ps, args.mib, args.layers, host_buf, rows, sweep=not args.no_sweep, shape=shape)
        print(render(rows[before:]), flush=True)  # partial results survive a timeout
    lay = layout_for(sizes[0], "layer_first", args.layers, shape)
    head = (f"shape {shape or 'bench-8x128-bf16'}: {lay.kind}, {lay.num_layers} layers + {lay.draft_layers} draft, "
            f"{len(lay.planes)} planes, {lay.planes[0].row_bytes} B rows, {lay.page_bytes} B per page of "
            f"{lay.page_size}\n"
            f"pcie tiles {PCIE_TILES}; d2d tiles {D2D_TILES}\n"
            f"device: {torch.cuda.get_device_name() if CUDA else 'cpu (smoke)'}; torch {torch.__version__}; "
            f"triton {__import__('triton').__version__}; {args.mib} MiB per copy; "
            f"launch overhead {launch_overhead_us(args.layers, shape):.1f} us per per-layer call")
    table = render(rows)
    print(head)
    print(table)
    if args.out:
        with open(args.out, "w") as f:
            f.write(head + "\n\n" + table + "\n")


if __name__ == "__main__":
    main()
