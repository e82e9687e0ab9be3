"""Copy engines for runs of adjacent pages, beside the page-copy kernel (issue 16, item 1).

    PYTHONPATH=. python bench/transfer_runs.py [--pages 512] [--runs 1 8 64 512] [--reps 5]

A load back or backup of pages that sit next to each other on both sides
(a prefix backed up together and loaded into fresh L1 pages) can go through
the GPU's copy engines in few calls: per plane and run of ``R`` adjacent
pages, one ``cudaMemcpyAsync`` (``layer_first`` host pages: the run is
contiguous on both sides) or one ``cudaMemcpy2DAsync`` (``page_first``: the
run's plane pages are ``page_stride`` apart on the host, contiguous on the
GPU). This measures, on an 8B-shaped layout (32 layers x K/V x 8 heads x 128
dims, bf16, page 16: 512 pages = 1 GiB), for runs of 1..512 pages placed at
random, in one process and on the same page ids: the contiguous copy of the
same bytes (the limit), hicache's Triton kernel (8 blocks), and the
copy-engine calls (GB/s from CUDA events, and the host time to issue them).
Every variant's destination is compared byte for byte with the source.
Needs a CUDA GPU; cudart comes from the CUDA build of torch.
"""
from __future__ import annotations

import argparse
import ctypes
import glob
import os
import statistics
import sys
import time

import torch

from hicache.kernels.page_copy import copy_pages
from hicache.core.layout import KVLayout
from hicache.memory.pools import DevicePool, HostPool

H2D, D2H = 1, 2  # cudaMemcpyKind


def cudart() -> ctypes.CDLL:
    base = os.path.dirname(torch.__file__)
    pats = [os.path.join(base, "lib", "libcudart.so*"),
            os.path.join(os.path.dirname(base), "nvidia", "*", "lib", "libcudart.so*"),
            os.path.join(os.path.dirname(base), "nvidia", "cuda_runtime", "lib", "libcudart.so*")]
    for pat in pats:
        for path in sorted(glob.glob(pat)):
            lib = ctypes.CDLL(path)
            lib.cudaMemcpyAsync.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
                                            ctypes.c_void_p]
            lib.cudaMemcpy2DAsync.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t,
                                              ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
            return lib
    return ctypes.CDLL("libcudart.so")


def runs_of(n: int, run: int, capacity: int, g: torch.Generator) -> list[tuple[int, int]]:
    """``n // run`` runs of ``run`` adjacent page ids at random run-aligned places: (first, length)."""
    slots = torch.randperm(capacity // run, generator=g)[:n // run].tolist()
    return [(s * run, run) for s in slots]


def ce_copy(lib, host: HostPool, dev: DevicePool, h_runs, d_runs, direction: int) -> int:
    """Copy engine: one call per plane and run; returns the number of calls."""
    stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
    hbase = host.buffer.data_ptr()
    calls = 0
    for s in host.layout.planes:
        pb = s.page_bytes
        hoff, hstride = host.plane_offset[s.index], host.page_stride[s.index]
        dbase = dev.buffers[s.index].data_ptr()
        for (h0, r), (d0, _) in zip(h_runs, d_runs):
            hp, dp = hbase + hoff + h0 * hstride, dbase + d0 * pb
            if hstride == pb:  # contiguous on both sides
                src, dst = (hp, dp) if direction == H2D else (dp, hp)
                rc = lib.cudaMemcpyAsync(ctypes.c_void_p(dst), ctypes.c_void_p(src), r * pb, direction, stream)
            elif direction == H2D:
                rc = lib.cudaMemcpy2DAsync(ctypes.c_void_p(dp), pb, ctypes.c_void_p(hp), hstride, pb, r, H2D, stream)
            else:
                rc = lib.cudaMemcpy2DAsync(ctypes.c_void_p(hp), hstride, ctypes.c_void_p(dp), pb, pb, r, D2H, stream)
            if rc:
                raise RuntimeError(f"cudaMemcpy*Async returned {rc}")
            calls += 1
    return calls


def timed(fn, reps: int) -> tuple[float, float]:
    """(median GPU ms, median host ms to issue) over ``reps``."""
    gpu, host = [], []
    for _ in range(reps):
        torch.cuda.synchronize()
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t = time.perf_counter()
        e0.record()
        fn()
        e1.record()
        host.append((time.perf_counter() - t) * 1e3)
        e1.synchronize()
        gpu.append(e0.elapsed_time(e1))
    return statistics.median(gpu), statistics.median(host)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pages", type=int, default=512)
    ap.add_argument("--runs", type=int, nargs="+", default=[1, 8, 64, 512])
    ap.add_argument("--reps", type=int, default=5)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench/transfer_runs.py needs a CUDA GPU", file=sys.stderr)
        return 2
    lib = cudart()
    g = torch.Generator().manual_seed(0)
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}: {a.pages} pages of 2 MiB (8B shape, "
          f"page 16), runs placed at random in pools of {2 * a.pages} pages, median of {a.reps}\n")
    print("| host layout | direction | run | contiguous GB/s | kernel GB/s (%) | copy engine GB/s (%) | "
          "CE calls | CE host ms |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for host_layout in ("page_first", "layer_first"):
        lay = KVLayout("runs", num_layers=32, num_kv_heads=8, head_dim=128, dtype="bfloat16", page_size=16,
                       host_layout=host_layout)
        cap = 2 * a.pages
        host, dev = HostPool(lay, cap), DevicePool(lay, cap, "cuda")
        nbytes = a.pages * lay.page_bytes
        flat_h = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
        flat_d = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        host.buffer.copy_(torch.randint(0, 256, host.buffer.shape, dtype=torch.uint8, generator=g))
        for direction, name in ((H2D, "H2D"), (D2H, "D2H")):
            lim_ms, _ = timed((lambda: flat_d.copy_(flat_h, non_blocking=True)) if direction == H2D
                              else (lambda: flat_h.copy_(flat_d, non_blocking=True)), a.reps)
            lim = nbytes / lim_ms / 1e6
            for run in a.runs:
                h_runs, d_runs = runs_of(a.pages, run, cap, g), runs_of(a.pages, run, cap, g)
                hp = [h0 + i for h0, r in h_runs for i in range(r)]
                dp = [d0 + i for d0, r in d_runs for i in range(r)]
                src, dst = (host, dev) if direction == H2D else (dev, host)
                s_ids, d_ids = (hp, dp) if direction == H2D else (dp, hp)
                s_idx = torch.tensor(s_ids, device="cuda")
                d_idx = torch.tensor(d_ids, device="cuda")
                ker_ms, _ = timed(lambda: copy_pages(src, dst, s_idx, d_idx), a.reps)
                ce_calls = [0]

                def ce():
                    ce_calls[0] = ce_copy(lib, host, dev, h_runs, d_runs, direction)
                ce_ms, ce_host = timed(ce, a.reps)
                # value check: the copy engine's result equals the kernel's (both from the same source)
                if direction == H2D:
                    dev.buffers[0].zero_()
                    ce()
                    torch.cuda.synchronize()
                    got = dev.buffers[0].view(cap, -1)[d_ids].cpu()
                    want = torch.stack([host.plane_page(0, p).reshape(-1) for p in s_ids])
                    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), "copy engine H2D bytes"
                else:
                    for b in dev.buffers:
                        b.view(torch.uint8).copy_(torch.randint(0, 256, b.view(torch.uint8).shape,
                                                                dtype=torch.uint8, device="cuda"))
                    ce()
                    torch.cuda.synchronize()
                    got = torch.stack([host.plane_page(0, p).reshape(-1) for p in d_ids])
                    want = dev.buffers[0].view(cap, -1)[s_ids].cpu()
                    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), "copy engine D2H bytes"
                kg, cg = nbytes / ker_ms / 1e6, nbytes / ce_ms / 1e6
                print(f"| {host_layout} | {name} | {run} | {lim:.1f} | {kg:.1f} ({kg / lim:.1%}) | "
                      f"{cg:.1f} ({cg / lim:.1%}) | {ce_calls[0]} | {ce_host:.2f} |", flush=True)
        host = dev = flat_h = flat_d = None  # free both pools before the next layout
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
