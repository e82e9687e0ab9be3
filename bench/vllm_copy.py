"""vLLM-layout page copies on a GPU: every candidate against the contiguous copy, in one run.

    PYTHONPATH=. python bench/vllm_copy.py            # H200: about 2 minutes

Per shape (bench/connector_worker.py's six) and vLLM KV layout / L2 layout, median GB/s of
--reps timed copies of --mib MiB of scattered blocks, as a share of a contiguous pinned copy of
the same bytes measured in the same run (D2D: of a contiguous device copy):

- ``kernel gN``: hicache's page-copy kernel (``copy_pages``), N programs (8 is the default);
- ``staged``: the copy engine moves whole contiguous L2 runs (a page_first page, or one
  plane page) into a device staging buffer laid out like L2, one batched call
  (``cuMemcpyBatchAsync``) per step, while the kernel scatters the previous step into vLLM's
  blocks on another stream (saves: gather, then the copy engine); a step is a chunk of pages
  (all layers) or one layer (layer-wise);
- D2D: vLLM blocks -> a device pool in hicache's layout, kernel tile variants.

Bytes: each cache group moves only its own layers' planes (gpt-oss's groups alias one
allocation; a block of one group is not a block of the other).
Without a GPU: a smoke run of the staging arithmetic at tiny sizes (no timing).
"""
from __future__ import annotations

import argparse
import ctypes
import statistics
from typing import NamedTuple
import sys

import numpy as np
import torch

from hicache.kernels.page_copy import (D2D_TILES, D2D_TILES_LARGE, D2D_TILES_WHOLE_32K, PageCopier, _addrs,
                                       copy_pages)
from hicache.kernels.plan import build_plan, TileConfig
from hicache.memory.paged_kv import adopt_paged_kv, vllm_kv_caches
from hicache.memory.pools import DevicePool, HostPool
from tests.memory.paged_cases import cases, fill, group_planes

CUDA = torch.cuda.is_available()
DEV = torch.device("cuda", torch.cuda.current_device()) if CUDA else torch.device("cpu")


# ------------------------------------------------------------------ the copy engine, batched
class _Attr(ctypes.Structure):  # CUmemcpyAttributes (cuda.h 12.8+)
    _fields_ = [("srcAccessOrder", ctypes.c_int), ("srcLocType", ctypes.c_int), ("srcLocId", ctypes.c_int),
                ("dstLocType", ctypes.c_int), ("dstLocId", ctypes.c_int), ("flags", ctypes.c_uint)]


class Batch:
    """``cuMemcpyBatchAsync`` (CUDA 13: ``_v2``, no failIdx) through libcuda, else a loop of
    ``cuMemcpyAsync``. Pointers are UVA addresses (device or pinned host)."""

    def __init__(self, force_loop: bool = False):
        lib = ctypes.CDLL("libcuda.so.1")
        self.loop = lib.cuMemcpyAsync
        self.loop.argtypes = [ctypes.c_uint64, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p]
        self.fn, self.v2 = None, False
        for name, v2 in (("cuMemcpyBatchAsync_v2", True), ("cuMemcpyBatchAsync", False)):
            if not force_loop and hasattr(lib, name):
                self.fn, self.v2 = getattr(lib, name), v2
                break
        self.attr = _Attr(1, 0, 0, 0, 0, 0)  # CU_MEMCPY_SRC_ACCESS_ORDER_STREAM, no location hints
        self.idx = (ctypes.c_size_t * 1)(0)
        self.fail = ctypes.c_size_t(0)
        self.name = "loop" if self.fn is None else ("batch_v2" if self.v2 else "batch")

    def __call__(self, dst: np.ndarray, src: np.ndarray, size: np.ndarray, stream: int) -> None:
        n = len(size)
        if n == 0:
            return
        if self.fn is None:
            for d, s, b in zip(dst.tolist(), src.tolist(), size.tolist()):
                _ok(self.loop(d, s, b, stream), "cuMemcpyAsync")
            return
        p = [a.ctypes.data_as(ctypes.c_void_p) for a in (dst, src, size)]
        tail = [ctypes.byref(self.fail)] if not self.v2 else []
        _ok(self.fn(*p, ctypes.c_size_t(n), ctypes.byref(self.attr), self.idx, ctypes.c_size_t(1), *tail,
                    ctypes.c_void_p(stream)), self.name)


def _ok(rc: int, what: str) -> None:
    if rc != 0:
        raise RuntimeError(f"{what} returned CUresult {rc}")


# ------------------------------------------------------------------ staging: L2's layout on the device
def staging(lay, n: int) -> tuple[DevicePool, torch.Tensor, HostPool]:
    """A device pool whose planes view one device buffer laid out as a page_first L2 pool of
    ``n`` pages, so one L2 page (or a run of its planes) is one contiguous copy."""
    pf = lay.replace(host_layout="page_first")
    buf = torch.empty(HostPool.nbytes_for(pf, n), dtype=torch.uint8, device=DEV)
    shadow = HostPool(pf, n, buffer=buf)  # addressing only: its buffer is on the device
    views = {(s.name, s.layer): shadow.layer_view(s.layer, draft=s.draft)[s.name] for s in lay.planes}
    return DevicePool(lay, n, DEV, buffers=views), buf, shadow


def runs(a: HostPool, a_pages: np.ndarray, b: HostPool, b_pages: np.ndarray,
         planes: list[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(a addresses, b addresses, sizes)`` moving plane pages ``a_pages[k]`` of ``a`` to
    ``b_pages[k]`` of ``b``, merged where both sides continue contiguously."""
    pl = np.asarray(planes, dtype=np.int64)
    pb = np.asarray([a.layout.planes[i].page_bytes for i in planes], dtype=np.uint64)

    def addr(pool, pages):
        off = np.asarray(pool.plane_offset, dtype=np.int64)[pl]
        st = np.asarray(pool.page_stride, dtype=np.int64)[pl]
        return (pool.buffer.data_ptr() + off[None, :] + pages[:, None] * st[None, :]).astype(np.uint64).ravel()
    sa, sb = addr(a, a_pages), addr(b, b_pages)
    size = np.tile(pb, len(a_pages))
    cont = (sa[1:] == sa[:-1] + size[:-1]) & (sb[1:] == sb[:-1] + size[:-1])
    starts = np.flatnonzero(np.concatenate(([True], ~cont)))
    return sa[starts], sb[starts], np.add.reduceat(size, starts).astype(np.uint64)


class Staged:
    """Loads and saves through the staging buffer: the copy engine on one stream, the kernel
    on another, one event per step."""

    def __init__(self, lay, pool: DevicePool, host: HostPool, n: int, batch: Batch):
        self.pool, self.host, self.batch = pool, host, batch
        self.stage, self.buf, self.shadow = staging(lay, n)
        self.ce = torch.cuda.Stream() if CUDA else None
        self.sm = torch.cuda.Stream() if CUDA else None

    @staticmethod
    def _steps(split, chunk: int | None, layers):
        """(planes, host pages, staging slots, the slots on the device, blocks) per step."""
        for g in split:
            if layers is None:
                for c in range(0, len(g.blocks), chunk):
                    cut = slice(c, c + chunk)
                    yield g.planes, g.pages[cut], g.slots[cut], g.slots_dev[cut], g.blocks[cut]
            else:
                for step in layers:
                    mine = [j for j in step if j in g.planes]
                    if mine:
                        yield mine, g.pages, g.slots, g.slots_dev, g.blocks

    def load(self, split, chunk: int | None = None, layers=None) -> None:
        cur = torch.cuda.current_stream()
        self.ce.wait_stream(cur)
        self.sm.wait_stream(cur)
        for planes, p, slots, slots_dev, b in self._steps(split, chunk, layers):
            src, dst, size = runs(self.host, p, self.shadow, slots, planes)
            with torch.cuda.stream(self.ce):
                self.batch(dst, src, size, self.ce.cuda_stream)
                ev = torch.cuda.Event()
                ev.record(self.ce)
            self.sm.wait_event(ev)
            with torch.cuda.stream(self.sm):
                copy_pages(self.stage, self.pool, slots_dev, b, planes=planes)
        cur.wait_stream(self.sm)
        cur.wait_stream(self.ce)

    def save(self, split, chunk: int) -> None:
        cur = torch.cuda.current_stream()
        self.ce.wait_stream(cur)
        self.sm.wait_stream(cur)
        for planes, p, slots, slots_dev, b in self._steps(split, chunk, None):
            with torch.cuda.stream(self.sm):
                copy_pages(self.pool, self.stage, b, slots_dev, planes=planes)
                ev = torch.cuda.Event()
                ev.record(self.sm)
            self.ce.wait_event(ev)
            src, dst, size = runs(self.host, p, self.shadow, slots, planes)
            with torch.cuda.stream(self.ce):
                self.batch(src, dst, size, self.ce.cuda_stream)
        cur.wait_stream(self.sm)
        cur.wait_stream(self.ce)


class CellOrder(PageCopier):
    """The kernel with its table in vLLM-side address order: a tile's consecutive units cover
    whole cells (K run then V run of one head and token) instead of one plane's runs."""

    def __init__(self, vllm: DevicePool):
        super().__init__()
        self.vllm = vllm

    def _build(self, src, dst, pair, plane_t, dev):
        side = 2 if dst is self.vllm else 0  # sort by the vLLM side's addresses
        addrs = sorted(_addrs(src, dst, plane_t), key=lambda a: a[side])
        return build_plan(addrs, dev, pair.tiles)


class Group(NamedTuple):
    planes: list[int]  # the group's planes (its layers)
    blocks: torch.Tensor  # vLLM block ids, on the device
    pages_dev: torch.Tensor  # L2 page ids, on the device
    pages: np.ndarray  # the same, for the host-side arithmetic
    slots: np.ndarray  # staging pages
    slots_dev: torch.Tensor


def timed(fn, reps: int) -> list[float]:
    """Seconds per run (CUDA events), after one warm-up run."""
    fn()
    out = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b) / 1e3)
    return out


def gbs(nbytes: int, secs: list[float]) -> float:
    return statistics.median(nbytes / s / 1e9 for s in secs)


class Setup(NamedTuple):
    lay: object
    kv: dict
    pool: DevicePool
    host: HostPool
    split: list[Group]
    layers: list[list[int]]  # plane indices per launch of a layer-wise load (draft planes last)
    nbytes: int  # payload bytes one copy moves (each group its own planes)


def setup(case, kv_layout: str, host_layout: str, mib: int, host_buf: torch.Tensor | None) -> Setup:
    lay = case.layout.replace(host_layout=host_layout)
    n = max(2, (mib << 20) // lay.page_bytes) // case.groups * case.groups
    kv = vllm_kv_caches(lay, 2 * n, kv_layout, groups=case.groups, device=DEV)
    fill(kv, seed=1)
    pool = adopt_paged_kv(lay, kv)
    host = HostPool(lay, 2 * n, buffer=host_buf) if host_buf is not None else HostPool(lay, 2 * n)
    g = torch.Generator().manual_seed(0)
    blocks, pages = torch.randperm(2 * n, generator=g)[:n], torch.randperm(2 * n, generator=g)[:n]
    per = n // case.groups
    split, nbytes = [], 0
    for k in range(case.groups):
        cut = slice(k * per, (k + 1) * per)
        planes = group_planes(lay, k, case.groups)
        slots = np.arange(k * per, (k + 1) * per, dtype=np.int64)
        split.append(Group(planes, blocks[cut].to(DEV), pages[cut].to(DEV), pages[cut].numpy().astype(np.int64),
                           slots, torch.from_numpy(slots).to(DEV)))
        nbytes += per * sum(lay.planes[j].page_bytes for j in planes)
    layers = [[s.index for s in lay.planes if s.layer == i and not s.draft] for i in range(lay.num_layers)]
    layers.append([s.index for s in lay.planes if s.draft])
    return Setup(lay, kv, pool, host, split, [x for x in layers if x], nbytes)


def kernel_load(s: Setup, grid: int, layerwise: bool = False, copier=None):
    cp = copier.copy_pages if copier else copy_pages

    def run():
        for g in s.split:
            for step in (s.layers if layerwise else [g.planes]):
                mine = [j for j in step if j in g.planes] if layerwise else step
                if mine:
                    cp(s.host, s.pool, g.pages_dev, g.blocks, planes=mine, num_blocks=grid)
    return run


def kernel_save(s: Setup, grid: int, copier=None):
    cp = copier.copy_pages if copier else copy_pages

    def run():
        for g in s.split:
            cp(s.pool, s.host, g.blocks, g.pages_dev, planes=g.planes, num_blocks=grid)
    return run


def _blocks_equal(s: Setup, before: dict[str, torch.Tensor]) -> bool:
    """Every layer's moved blocks (its group's) hold the bytes they held before the wipe."""
    for i, (name, t) in enumerate(s.kv.items()):
        b = s.split[i % len(s.split)].blocks
        if not torch.equal(t.view(torch.uint8)[b], before[name][b]):
            return False
    return True


def check(s: Setup, staged: Staged, chunk: int) -> str:
    """Staged saves write what the kernel writes; staged loads (all layers, layer-wise) restore
    the saved blocks. Raises on a difference."""
    raw = next(iter(s.kv.values())).untyped_storage()
    whole = torch.empty(0, dtype=torch.uint8, device=DEV).set_(raw)
    before = {k: t.view(torch.uint8).clone() for k, t in s.kv.items()}
    s.host.buffer.zero_()
    kernel_save(s, 8)()
    torch.cuda.synchronize()
    want = s.host.buffer.clone()
    s.host.buffer.zero_()
    staged.save(s.split, chunk)
    torch.cuda.synchronize()
    assert torch.equal(s.host.buffer, want), "staged save differs from the kernel's"
    for how in ("kernel", "staged", "staged layer-wise"):
        whole.zero_()
        if how == "kernel":
            kernel_load(s, 8)()
        else:
            staged.load(s.split, chunk, s.layers if "layer" in how else None)
        torch.cuda.synchronize()
        assert _blocks_equal(s, before), f"{how} load did not restore the blocks"
    return "saves equal, loads restore"


def row(case, kv_layout: str, host_layout: str, mib: int, reps: int, host_buf, batch: Batch,
        chunk_mib: int, grids: list[int]) -> tuple[str, str]:
    """(bandwidth row, D2D row)."""
    s = setup(case, kv_layout, host_layout, mib, host_buf)
    n = sum(len(g.blocks) for g in s.split)
    chunk = max(1, (chunk_mib << 20) // s.lay.page_bytes)
    st = Staged(s.lay, s.pool, s.host, n, batch)
    check(s, st, chunk)
    src = torch.empty(s.nbytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(s.nbytes, dtype=torch.uint8, device=DEV)
    h2d = gbs(s.nbytes, timed(lambda: dst.copy_(src, non_blocking=True), reps))
    d2h = gbs(s.nbytes, timed(lambda: src.copy_(dst, non_blocking=True), reps))
    r = {}
    for gr in grids:
        r[f"load g{gr}"] = gbs(s.nbytes, timed(kernel_load(s, gr), reps)) / h2d
        r[f"lw g{gr}"] = gbs(s.nbytes, timed(kernel_load(s, gr, True), reps)) / h2d
        r[f"save g{gr}"] = gbs(s.nbytes, timed(kernel_save(s, gr), reps)) / d2h
    cell = CellOrder(s.pool)
    r["load g8 cell"] = gbs(s.nbytes, timed(kernel_load(s, 8, copier=cell), reps)) / h2d
    r["lw g8 cell"] = gbs(s.nbytes, timed(kernel_load(s, 8, True, copier=cell), reps)) / h2d
    r["save g8 cell"] = gbs(s.nbytes, timed(kernel_save(s, 8, copier=cell), reps)) / d2h
    r["load staged"] = gbs(s.nbytes, timed(lambda: st.load(s.split, chunk), reps)) / h2d
    r["load staged 1 step"] = gbs(s.nbytes, timed(lambda: st.load(s.split, n), reps)) / h2d
    r["lw staged"] = gbs(s.nbytes, timed(lambda: st.load(s.split, chunk, s.layers), reps)) / h2d
    r["save staged"] = gbs(s.nbytes, timed(lambda: st.save(s.split, chunk), reps)) / d2h
    head = f"| {case.name} | {kv_layout} | {host_layout} | {n} x {s.lay.page_bytes >> 10} KiB | {h2d:.1f} | {d2h:.1f} |"
    line = head + "".join(f" {v:.1%} |" for v in r.values())
    return line, d2d_row(s, st, reps, head.split("|")[1:5])


D2D_VARIANTS = {
    "default": None,
    "cell order": "cell",
    "32K/8w": D2D_TILES,
    "64K/8K/16w": D2D_TILES_WHOLE_32K,
    "64K/32K/16w": D2D_TILES_LARGE,
    "16K/4w": TileConfig(tile_bytes=16384, narrow_tile_bytes=4096, max_chunk_bytes=16384, num_warps=4),
    "64K/8w": TileConfig(tile_bytes=65536, narrow_tile_bytes=4096, max_chunk_bytes=65536, num_warps=8),
}


def d2d_row(s: Setup, st: Staged, reps: int, head: list[str]) -> str:
    """vLLM blocks -> hicache's layout on the device (the staging pool), tile and grid variants,
    as a share of a contiguous device copy of the same bytes."""
    a = torch.empty(s.nbytes, dtype=torch.uint8, device=DEV)
    b = torch.empty_like(a)
    ref = gbs(s.nbytes, timed(lambda: b.copy_(a), reps))
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    out = []
    for name, cfg in D2D_VARIANTS.items():
        cp = (PageCopier() if cfg is None else CellOrder(s.pool) if cfg == "cell"
              else PageCopier(d2d=cfg, d2d_whole_32k=cfg, d2d_large=cfg))
        for per_sm in ((1, 2, 4) if cfg is None else (2,)):
            def run():
                for g in s.split:
                    cp.copy_pages(s.pool, st.stage, g.blocks, g.slots_dev, planes=g.planes,
                                  num_blocks=per_sm * sms)
            out.append(f"{name} x{per_sm}: {gbs(s.nbytes, timed(run, reps)) / ref:.1%}")
    return f"|{'|'.join(head)}| {ref:.0f} | " + " | ".join(out) + " |"


def smoke() -> None:
    """No GPU: the staging arithmetic (``runs`` + the staging pool's views) against a direct
    copy, at tiny sizes, with memmove standing in for the copy engine."""
    for case in cases():
        case = case._replace(layout=case.layout.replace(num_layers=2 * case.groups, draft_layers=0))
        for hl in ("page_first", "layer_first"):
            s = setup(case, "LBNHC", hl, 1, None)
            n = sum(len(g.blocks) for g in s.split)
            stage, _, shadow = staging(s.lay, n)
            for g in s.split:
                copy_pages(s.pool, s.host, g.blocks, g.pages_dev, planes=g.planes)
                for a, b, size in zip(*runs(s.host, g.pages, shadow, g.slots, g.planes)):
                    ctypes.memmove(int(b), int(a), int(size))
            before = {k: t.view(torch.uint8).clone() for k, t in s.kv.items()}
            for t in s.kv.values():
                t.view(torch.uint8).zero_()
            for g in s.split:
                copy_pages(stage, s.pool, g.slots_dev, g.blocks, planes=g.planes)
            assert _blocks_equal(s, before), (case.name, hl)
            for t in s.kv.values():
                t.view(torch.uint8).zero_()
            cell = CellOrder(s.pool)
            for g in s.split:
                cell.copy_pages(s.host, s.pool, g.pages_dev, g.blocks, planes=g.planes, backend="triton")
            assert _blocks_equal(s, before), (case.name, hl, "cell order")
    print("smoke: staged L2 -> staging -> vLLM blocks, and the cell-ordered kernel (interpreted), restore the "
          "saved blocks: every shape, both L2 layouts")


def selftest(force_loop: bool) -> int:
    """The copy-engine binding on two pieces each way (device <-> pinned host); 0 if they land."""
    batch = Batch(force_loop=force_loop)
    h = torch.arange(1 << 16, dtype=torch.int32).view(torch.uint8).pin_memory()
    d = torch.zeros_like(h, device=DEV)
    back = torch.zeros_like(h).pin_memory()
    size = np.array([4096, 8192], dtype=np.uint64)
    off = np.array([0, 65536], dtype=np.uint64)
    # The batched call refuses the legacy default stream (CUresult 1): it always runs on a stream
    # of its own, as ``Staged`` does; the legacy stream is tried first only to say so.
    side, ok = torch.cuda.Stream(), False
    for name, stream in (("legacy default stream", torch.cuda.current_stream().cuda_stream),
                         ("a created stream", side.cuda_stream)):
        back.zero_()
        d.zero_()
        torch.cuda.synchronize()
        try:
            batch(d.data_ptr() + off + 4096, h.data_ptr() + off, size, stream)
            batch(back.data_ptr() + off, d.data_ptr() + off + 4096, size, stream)
        except RuntimeError as e:
            print(f"copy engine {batch.name} on {name}: {e}")
            continue
        torch.cuda.synchronize()
        ok = all(torch.equal(back[o:o + n], h[o:o + n]) for o, n in ((0, 4096), (65536, 8192)))
        print(f"copy engine {batch.name} on {name}: {'ok' if ok else 'WRONG BYTES'}")
    return 0 if ok else 1


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=256, help="bytes moved per timed copy")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--chunk-mib", type=int, default=32, help="staged: bytes per copy-engine step (all layers)")
    ap.add_argument("--grids", default="8,16,32", help="kernel: programs per launch")
    ap.add_argument("--shapes", default="", help="comma-separated case names (default: all)")
    ap.add_argument("--loop", action="store_true", help="staged: cuMemcpyAsync per run, not one batch")
    ap.add_argument("--selftest", action="store_true", help="check the copy-engine binding and exit")
    a = ap.parse_args()
    if a.selftest:
        return selftest(a.loop)
    if not CUDA:
        smoke()
        return 0
    want = [x for x in a.shapes.split(",") if x]
    picked = [c for c in cases() if not want or c.name in want]
    grids = [int(x) for x in a.grids.split(",")]
    batch = Batch(force_loop=a.loop)
    combos = (("LBNHC", "page_first"), ("LBNHC", "layer_first"), ("LBHNC", "page_first"))
    most = max(HostPool.nbytes_for(c.layout.replace(host_layout=h), 2 * max(2, (a.mib << 20) // c.layout.page_bytes))
               for c in picked for _, h in combos)
    host_buf = torch.zeros(most, dtype=torch.uint8, pin_memory=True)
    print(f"# vLLM-layout copies, {torch.cuda.get_device_name()}, torch {torch.__version__}, {a.mib} MiB per copy, "
          f"{a.reps} reps, copy engine: {batch.name}, staged chunk {a.chunk_mib} MiB: median share of the contiguous "
          "pinned copy (H2D for loads, D2H for saves)\n")
    names = [f"{k} g{g}" for g in grids for k in ("load", "lw", "save")]
    names += ["load g8 cell", "lw g8 cell", "save g8 cell", "load staged", "load staged 1 step", "lw staged", "save staged"]
    print("| shape | vLLM | L2 | blocks | H2D GB/s | D2H GB/s | " + " | ".join(names) + " |")
    print("|---|---|---|---|---:|---:|" + "---:|" * len(names))
    d2d = []
    for c in picked:
        for kv_layout, hl in combos:
            line, d = row(c, kv_layout, hl, a.mib, a.reps, host_buf, batch, a.chunk_mib, grids)
            print(line, flush=True)
            d2d.append(d)
            torch.cuda.empty_cache()
    print("\n# D2D: vLLM blocks -> hicache's layout on the device; share of a contiguous device copy; "
          "tile/chunk/warps x programs per SM\n")
    print("| shape | vLLM | L2 | blocks | contiguous GB/s | variants |")
    print("|---|---|---|---|---:|---|")
    print("\n".join(d2d))
    return 0


if __name__ == "__main__":
    sys.exit(main())
