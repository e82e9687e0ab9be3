"""Hardware counters of the page copies that miss their targets, under Nsight Compute.

    bash bench/profile_copies.sh $OUT        # runs ncu on this script, writes $OUT/ncu_*.csv

Issue 16 asks, where a copy target is missed, what the profile shows. This
script launches each copy once (after a warm-up) inside an NVTX range named
after it (``bench/profile_copies.sh`` selects the copy kernels by name; every case
launches twice, the warm-up and the measured launch, in this order):

- ``h2d_random`` / ``d2h_random``: hicache's kernel, 512 random pages of the
  Qwen3-8B shape (page 16, ``layer_first`` host pool, 1.1 GiB);
- ``h2d_seq`` / ``d2h_seq``: the same kernel on pages 0..511 in order (the
  same bytes, every chunk adjacent to the next: scatter taken out);
- ``d2d_random`` / ``d2d_seq``: device to device, same pages;
- ``d2d_contig_kernel``: a plain Triton copy of one contiguous buffer of the
  same size (a kernel, so the counters compare with torch's contiguous copy,
  a ``cudaMemcpy`` that kernel replay does not see);
- ``h2d_ce_contig`` / ``d2h_ce_contig``: the contiguous pinned copies (the copy
  engines: the limit), profiled by range replay over their NVTX ranges.

Values are checked for every variant (copied pages equal their sources).
"""
from __future__ import annotations

import sys

import torch
import triton
import triton.language as tl

from hicache.kernels.page_copy import PageCopier
from hicache.kernels.page_copy import plane_pages
from hicache.core.layout import KVLayout
from hicache.memory.pools import DevicePool, HostPool


@triton.jit
def _contig_copy(src, dst, n, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    step = tl.num_programs(0) * BLOCK
    for start in range(pid * BLOCK, n, step):
        offs = start + tl.arange(0, BLOCK)
        m = offs < n
        tl.store(dst + offs, tl.load(src + offs, mask=m), mask=m)


def _dev(pool):
    return pool.device if isinstance(pool, DevicePool) else torch.device("cpu")


def main() -> None:
    dev = torch.device("cuda")
    lay = KVLayout("qwen3-8b", 36, num_kv_heads=8, head_dim=128, page_size=16, host_layout="layer_first")
    n, cap = 512, 1024
    gen = torch.Generator().manual_seed(0)
    rand_s = torch.randperm(cap, generator=gen)[:n].to(dev)
    rand_d = torch.randperm(cap, generator=gen)[:n].to(dev)
    seq = torch.arange(n, device=dev)
    d1, d2 = DevicePool(lay, cap, device=dev), DevicePool(lay, cap, device=dev)
    host = HostPool(lay, cap, pin=True)
    for b in d1.buffers:
        b.view(torch.uint8).random_(0, 256)
    host.buffer.copy_(torch.randint(0, 256, host.buffer.shape, dtype=torch.uint8))
    cp = PageCopier()
    nbytes = n * lay.page_bytes
    a = torch.empty(nbytes // 8, dtype=torch.int64, device=dev).random_()
    b = torch.empty_like(a)
    hbig = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    cases = {
        "h2d_random": lambda: cp.copy_pages(host, d2, rand_s, rand_d),
        "h2d_seq": lambda: cp.copy_pages(host, d2, seq, seq),
        "d2h_random": lambda: cp.copy_pages(d1, host, rand_s, rand_d),
        "d2h_seq": lambda: cp.copy_pages(d1, host, seq, seq),
        "d2d_random": lambda: cp.copy_pages(d1, d2, rand_s, rand_d),
        "d2d_seq": lambda: cp.copy_pages(d1, d2, seq, seq),
        "d2d_contig_kernel": lambda: _contig_copy[(264,)](a, b, a.numel(), BLOCK=4096, num_warps=8),
        # copy engines, contiguous (the limit): profiled by range replay, not by kernel
        "h2d_ce_contig": lambda: a.view(torch.uint8).copy_(hbig, non_blocking=True),
        "d2h_ce_contig": lambda: hbig.copy_(a.view(torch.uint8), non_blocking=True),
    }
    only = sys.argv[1:] or [c for c in cases if "_ce_" not in c]
    for name in only:
        fn = cases[name]
        fn()  # warm-up: compile, build the plan
        torch.cuda.synchronize()
        if name.startswith("d2d_contig"):
            assert torch.equal(a, b), name
        elif "_ce_" in name:
            assert torch.equal(a.view(torch.uint8).cpu(), hbig), name
        else:
            s, d = (rand_s, rand_d) if "random" in name else (seq, seq)
            src, dst = {"h2d": (host, d2), "d2h": (d1, host), "d2d": (d1, d2)}[name[:3]]
            for j in range(len(lay.planes)):
                got = plane_pages(dst, j).index_select(0, d.to(_dev(dst)))
                want = plane_pages(src, j).index_select(0, s.to(_dev(src)))
                assert torch.equal(got.cpu(), want.cpu()), (name, j)
        torch.cuda.nvtx.range_push(name)
        fn()
        torch.cuda.nvtx.range_pop()
        torch.cuda.synchronize()
        print(f"ran {name}", flush=True)


if __name__ == "__main__":
    main()
