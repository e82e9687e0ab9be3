"""Launchers: gather/scatter pages between pools, and store new K/V rows by slot id.

``copy_pages`` moves page ``src_pages[k]`` of one pool to page ``dst_pages[k]``
of another, for every plane or a chosen subset (one layer per launch), in one
Triton launch: device→host and host→device through pinned host memory that
the GPU addresses directly, device→device, either host layout, MHA / MLA /
byte / draft planes alike. Without a GPU it runs plain torch (``torch_copy``,
``torch_store``: byte-exact ``index_select`` / ``index_copy_`` over ``uint8`` views,
also the kernels' reference), which writes the same bytes.

``PageCopier`` owns the cached address tables; the module functions use one
per-process instance (``default_copier()``), a pure memoisation keyed weakly
by pool, so it never keeps a pool alive and never changes a result.
"""
from __future__ import annotations

import functools
import math
import threading
import weakref
from dataclasses import dataclass
from typing import Literal, Sequence

import torch

from hicache.core.errors import IntegrityError
from hicache.core.layout import KVLayout
from hicache.core.types import check_provenance, Row
from hicache.kernels.plan import build_plan, CopyPlan, PlaneAddr, TileConfig
from hicache.memory.pools import DevicePool, HostPool


Pool = DevicePool | HostPool


def plane_pages(pool: Pool, plane: int) -> torch.Tensor:
    """``uint8 [num_pages, *dims]`` view (no copy) of one plane of a pool, row-major in canonical
    page order: ``[num_pages, page_bytes]`` except for an adopted engine's strided page views."""
    nbytes = pool.layout.planes[plane].page_bytes
    if isinstance(pool, DevicePool):
        return pool.byte_pages(plane)
    return pool.buffer.as_strided((pool.num_pages, nbytes), (pool.page_stride[plane], 1),
                                  pool.buffer.storage_offset() + pool.plane_offset[plane])


def torch_copy(src: Pool, dst: Pool, src_pages: torch.Tensor, dst_pages: torch.Tensor,
               planes: Sequence[int]) -> None:
    """Copy page ``src_pages[k]`` of ``src`` to page ``dst_pages[k]`` of ``dst`` on ``planes``.

    Mutates ``dst`` only. Synchronous whenever the two pools live on different devices.
    """
    s_idx = src_pages.to(_device(src))
    d_idx = dst_pages.to(_device(dst))
    for j in planes:
        a, b = plane_pages(src, j), plane_pages(dst, j)
        width = min(_width(a), _width(b))  # move 8-byte words where both sides allow: not byte by byte
        a, b = _as_words(a, width), _as_words(b, width)
        rows = a.index_select(0, s_idx)
        b.index_copy_(0, d_idx, rows.to(_device(dst)).view(-1, *b.shape[1:]))


_WORDS = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


def _width(t: torch.Tensor) -> int:
    """Widest word (bytes) that divides ``t``'s last dim, its other strides and its offset."""
    for w in (8, 4, 2):
        if t.shape[-1] % w == 0 and t.storage_offset() % w == 0 and all(x % w == 0 for x in t.stride()[:-1]):
            return w
    return 1


def _as_words(t: torch.Tensor, width: int) -> torch.Tensor:
    return t if width == 1 else t.view(_WORDS[width])


def torch_store(pool: DevicePool, plane_indices: Sequence[int], rows: Sequence[torch.Tensor],
                slot_ids: torch.Tensor, provenance: torch.Tensor) -> None:
    """Write ``rows[j][k]`` into slot ``slot_ids[k]`` of plane ``plane_indices[j]`` for every
    VALID row ``k``; other rows write nothing. Mutates ``pool``."""
    keep = (provenance.to(pool.device) == Row.VALID).nonzero().squeeze(1)
    slots = slot_ids.to(pool.device).index_select(0, keep)
    for j, r in zip(plane_indices, rows):
        row_bytes = pool.layout.planes[j].row_bytes
        dst = pool.buffers[j].view(-1).view(torch.uint8).view(-1, row_bytes)
        src = r.index_select(0, keep.to(r.device)).contiguous().view(torch.uint8).reshape(-1, row_bytes)
        dst.index_copy_(0, slots, src.to(pool.device))


Backend = Literal["auto", "triton", "torch"]
Indices = torch.Tensor | Sequence[int]
Signal = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # (counter, flag, epoch): see copy_pages

# ---------------------------------------------------------------- tuned constants
# Measured on an H200 (bench/transfer.py; bench/RESULTS.md "Page-copy kernels").
# PCIe copies: 64 KiB per program per iteration (16 x 16-byte loads per thread
# at 8 warps) keeps enough host reads in flight that 4 programs reach the H2D
# plateau (51.3 GB/s); a 32 KiB tile needed 8, 128 KiB / 16 warps gained nothing.
PCIE_TILES = TileConfig(tile_bytes=65536, narrow_tile_bytes=4096, max_chunk_bytes=65536, num_warps=8)
# 8 programs reach the plateau in both directions at every page size and leave
# the other SMs to the engine's compute (issue #4 caps this at 8).
PCIE_BLOCKS = 8
# Device-to-device copies saturate HBM only with the whole chip: 2 programs per
# SM reached 89-92% of a contiguous copy; tiles of 16-64 KiB and row chunks of
# 2-64 KiB made no difference beyond noise.
D2D_TILES = TileConfig(tile_bytes=32768, narrow_tile_bytes=4096, max_chunk_bytes=32768, num_warps=8)
# ... except for large planes, where 64 KiB tiles of 16 warps win, with the row chunk chosen
# by the plane sizes. Two runs on two H200 machines (`bench/transfer_peer.py --group d2d`,
# 2026-11-30, 24 tile / chunk / grid variants per shape, bench/RESULTS.md), % of a contiguous
# copy of the same bytes, against D2D_TILES in the same runs:
# - every plane a whole number of 32 KiB (MHA at page >= 16): 8 KiB chunks, 91.3-91.5% at
#   page 16 (32 KiB planes) and 91.8-91.9% at page 64 (128 KiB), against 88.3-88.4% / 88.4%
#   (64 KiB chunks: 90.3-90.4 / 91.1-91.2%, the choice before);
# - every plane >= 8 KiB but not whole 32 KiB (DeepSeek-V3 MLA at page 64: 72 KiB latents +
#   an 8448-byte index-K plane): 32 KiB chunks, 90.2-90.3% against 86.2-86.3% (8 KiB chunks
#   87.0-87.1%, 64 KiB 82.5-82.7%);
# - small planes (2 KiB at page 1): D2D_TILES stays best (89.6%; 64 KiB tiles 86.1-86.7%).
# Grids of 3 or 4 programs per SM gained at most 0.2 points and lost up to 6 on MLA.
D2D_TILES_WHOLE_32K = TileConfig(tile_bytes=65536, narrow_tile_bytes=4096, max_chunk_bytes=8192, num_warps=16)
D2D_TILES_LARGE = TileConfig(tile_bytes=65536, narrow_tile_bytes=4096, max_chunk_bytes=32768, num_warps=16)
D2D_BLOCKS_PER_SM = 2
_CPU = torch.device("cpu")


@functools.cache
def _kernel():
    """The Triton kernel, imported on the first launch that uses it: a CPU-only
    install runs the torch path and need not have Triton (tests run the kernel
    on CPU through Triton's interpreter; the dev extra installs it there)."""
    try:
        from hicache.kernels import _triton_copy
    except ImportError as e:
        raise RuntimeError(f"backend='triton' needs the triton package ({e}); install it (pip install triton: "
                           "CUDA builds of torch bring it) or use backend='torch'") from None
    return _triton_copy._page_copy_kernel


@functools.cache
def _interpreted_kernel():
    """The kernel run by Triton's interpreter, for CPU tensors (tests)."""
    k = _kernel()
    from triton.runtime.interpreter import InterpretedFunction

    return k if isinstance(k, InterpretedFunction) else InterpretedFunction(k.fn)


def _device(pool: Pool) -> torch.device:
    return pool.device if isinstance(pool, DevicePool) else pool.buffer.device


def _plane_addr(pool: Pool, plane: int) -> tuple[int, int, list[tuple[int, int]]]:
    """``(page 0 address, page stride, runs)``; ``runs`` are ``(offset, nbytes)`` in canonical
    page order (one run for a contiguous plane; one per row cell of a strided page view)."""
    if isinstance(pool, DevicePool):
        b = pool.byte_pages(plane)
        cells = [[]]
        for n, st in zip(b.shape[1:-1], b.stride()[1:-1]):
            cells = [c + [i * st] for c in cells for i in range(n)]
        return b.data_ptr(), b.stride(0), [(sum(c), b.shape[-1]) for c in cells]
    return (pool.buffer.data_ptr() + pool.plane_offset[plane], pool.page_stride[plane],
            [(0, pool.layout.planes[plane].page_bytes)])


def _pair_runs(a: list[tuple[int, int]], b: list[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """``(src offset, dst offset, nbytes)`` pieces that move canonical bytes run ``a`` -> run ``b``,
    split where either side's runs end and merged where both continue contiguously."""
    out: list[list[int]] = []
    i = j = ai = bj = 0
    while i < len(a):
        n = min(a[i][1] - ai, b[j][1] - bj)
        s, d = a[i][0] + ai, b[j][0] + bj
        if out and out[-1][0] + out[-1][2] == s and out[-1][1] + out[-1][2] == d:
            out[-1][2] += n
        else:
            out.append([s, d, n])
        ai, bj = ai + n, bj + n
        if ai == a[i][1]:
            i, ai = i + 1, 0
        if bj == b[j][1]:
            j, bj = j + 1, 0
    return [tuple(x) for x in out]  # type: ignore[misc]


@dataclass(slots=True)
class _Pair:
    """What a (src, dst) pool pair needs at every launch, resolved once."""

    gpu: torch.device | None  # the GPU the kernel runs on, None without one
    tiles: TileConfig
    blocks: int  # default grid size
    plans: dict[tuple[int, ...] | None, CopyPlan]  # keyed by the caller's plane tuple


class PageCopier:
    """Launches page copies and row stores; caches one ``CopyPlan`` per pool pair and plane set.

    Plans are weakly keyed by the pool objects: a pool's buffers must not be
    replaced after its first copy (pools never do that). The plan cache is
    guarded by a lock: the transfer worker thread and the scheduler thread
    (draft-plane upgrades, row stores) share one copier.
    """

    def __init__(self, pcie: TileConfig = PCIE_TILES, d2d: TileConfig = D2D_TILES,
                 d2d_whole_32k: TileConfig = D2D_TILES_WHOLE_32K, d2d_large: TileConfig = D2D_TILES_LARGE):
        self.pcie = pcie  # any copy with a host side (and CPU tests)
        self.d2d = d2d
        self.d2d_whole_32k = d2d_whole_32k  # device-to-device when every plane page is k x 32 KiB
        self.d2d_large = d2d_large  # ... else when every plane page is >= 8 KiB
        self._pairs: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._lock = threading.Lock()  # guards _pairs and every pair's plans

    # ------------------------------------------------------------------ copies
    def copy_pages(self, src: Pool, dst: Pool, src_pages: Indices, dst_pages: Indices, *,
                   planes: Sequence[int] | None = None, num_blocks: int | None = None,
                   backend: Backend = "auto", debug: bool = False, count: torch.Tensor | None = None,
                   signal: Signal | None = None) -> None:
        """Copy page ``src_pages[k]`` of ``src`` to page ``dst_pages[k]`` of ``dst``.

        ``planes``: plane indices to move (``None`` = every plane, target and
        draft). Mutates ``dst`` only. On a GPU the copy is asynchronous on the
        current CUDA stream: keep both index tensors and both pools alive and
        unchanged until the caller's event completes. ``debug`` checks index
        bounds and destination uniqueness (synchronises). ``count`` (kernel path
        only): a one-element int64 tensor on the launch device; only the first
        ``count`` pairs move, read at run time (for CUDA-graph capture: the
        index tensors are then fixed-size buffers). ``signal`` (kernel path
        only): ``(counter, flag, epoch)``, one-element int64 tensors the kernel
        reaches (``counter`` and ``epoch`` on the launch device, zero ``counter``
        between launches; ``flag`` there or in pinned host memory): once the whole
        copy is done, ``flag`` holds ``epoch`` (see ``_triton_copy``). Raises
        ``ValueError`` / ``TypeError`` naming the offending argument.
        """
        pair = self._pair(src, dst)
        key = None if planes is None else tuple(planes)
        use_triton = pair.gpu is not None if backend == "auto" else _pick_backend(backend, src, dst)
        launch_dev = pair.gpu if pair.gpu is not None else _CPU
        # The torch path moves indices itself (it synchronises anyway); the kernel needs them on its device.
        s_idx = _as_index(src_pages, launch_dev if use_triton else None, "src_pages", _device(src))
        d_idx = _as_index(dst_pages, launch_dev if use_triton else None, "dst_pages", _device(dst))
        if s_idx.numel() != d_idx.numel():
            raise ValueError(f"src_pages has {s_idx.numel()} entries, dst_pages {d_idx.numel()}; "
                             "pass one destination per source page")
        if debug:
            _check_bounds(s_idx, src.num_pages, "src_pages")
            _check_bounds(d_idx, dst.num_pages, "dst_pages", unique=True)
        if count is not None and (not use_triton or count.numel() != 1 or count.dtype != torch.int64
                                  or _norm(count.device) != _norm(launch_dev)):
            raise ValueError(f"count: a one-element int64 tensor on {launch_dev} with the kernel backend; "
                             f"got {tuple(count.shape)} {count.dtype} on {count.device} "
                             f"({'kernel' if use_triton else 'torch'} backend)")
        if signal is not None:
            _check_signal(signal, use_triton, launch_dev)
        if not use_triton:
            if s_idx.numel():
                torch_copy(src, dst, s_idx, d_idx, _check_planes(src, planes))
            return
        with self._lock:
            plan = pair.plans.get(key)
            if plan is None:
                plan = pair.plans[key] = self._build(src, dst, pair, _check_planes(src, planes), launch_dev)
        if s_idx.numel():
            _launch(plan, pair.tiles, s_idx, d_idx, None, launch_dev, num_blocks or pair.blocks, count, signal)

    def plan(self, src: Pool, dst: Pool, planes: Sequence[int] | None = None) -> CopyPlan:
        """The (cached) plan ``copy_pages`` launches with; for benchmarks and tests, and for
        callers that build it ahead (building uploads the tables on the current stream and
        waits for them: ``hybrid_load`` builds before it switches to a busy stream)."""
        pair = self._pair(src, dst)
        key = None if planes is None else tuple(planes)
        with self._lock:
            if key not in pair.plans:
                dev = pair.gpu if pair.gpu is not None else _CPU
                pair.plans[key] = self._build(src, dst, pair, _check_planes(src, planes), dev)
            return pair.plans[key]

    def check_integrity(self) -> None:
        """Every cached plan still matches its pools' addresses (buffers never replaced)."""
        with self._lock:
            snapshot = [(src, dst, pair.tiles, key, plan) for src, by_dst in list(self._pairs.items())
                        for dst, pair in list(by_dst.items()) for key, plan in pair.plans.items()]
        for src, dst, tiles, key, plan in snapshot:
            fresh = build_plan(_addrs(src, dst, _check_planes(src, key)), _CPU, tiles)
            if _relative(plan) != _relative(fresh) or (plan.rows, plan.words, plan.nrows, plan.nbytes) != (
                    fresh.rows, fresh.words, fresh.nrows, fresh.nbytes):
                raise IntegrityError(f"cached copy plan for planes {key} no longer matches "
                                     "its pools' buffers; were they replaced?")

    def _pair(self, src: Pool, dst: Pool) -> _Pair:
        with self._lock:
            return self._pair_locked(src, dst)

    def _pair_locked(self, src: Pool, dst: Pool) -> _Pair:
        by_dst = self._pairs.get(src)
        if by_dst is None:
            by_dst = self._pairs[src] = weakref.WeakKeyDictionary()
        pair = by_dst.get(dst)
        if pair is None:
            if src.layout is not dst.layout and src.layout.fingerprint() != dst.layout.fingerprint():
                src.layout.check_compatible(dst.layout)  # raises ContractMismatch naming the fields
            gpu = _gpu_of(src, dst)
            d2d = gpu is not None and isinstance(src, DevicePool) and isinstance(dst, DevicePool)
            blocks = (D2D_BLOCKS_PER_SM * torch.cuda.get_device_properties(gpu).multi_processor_count
                      if d2d else PCIE_BLOCKS)
            tiles = self.d2d_tiles(src.layout) if d2d else self.pcie
            pair = by_dst[dst] = _Pair(gpu, tiles, blocks, {})
        return pair

    def d2d_tiles(self, layout: KVLayout) -> TileConfig:
        """Tiles for device-to-device copies of ``layout`` (chosen by measurement, see the constants)."""
        sizes = [p.page_bytes for p in layout.planes]
        if all(b % 32768 == 0 for b in sizes):
            return self.d2d_whole_32k
        if min(sizes) >= 8192:
            return self.d2d_large
        return self.d2d

    @staticmethod
    def _build(src: Pool, dst: Pool, pair: _Pair, plane_t: tuple[int, ...], dev: torch.device) -> CopyPlan:
        _check_pinned(src, dst, dev)
        return build_plan(_addrs(src, dst, plane_t), dev, pair.tiles)

    # -------------------------------------------------------------- row stores
    def store_rows(self, pool: DevicePool, plane_indices: Sequence[int], rows: Sequence[torch.Tensor],
                   slot_ids: torch.Tensor, provenance: torch.Tensor, *, backend: Backend = "auto",
                   debug: bool = False) -> int:
        """Write ``rows[j][k]`` into slot ``slot_ids[k]`` of plane ``plane_indices[j]`` for
        every row whose provenance is VALID; skip every other row. Returns #VALID rows.

        Validates shapes and codes with ``check_provenance`` (synchronises on a
        GPU). Mutates ``pool``; the write itself is asynchronous on the current
        stream. ``debug`` also checks slot bounds and that VALID slots are unique.
        """
        n = _check_rows(pool, plane_indices, rows, slot_ids)
        valid = check_provenance(n, provenance)
        if _norm(provenance.device) != _norm(pool.device):
            raise ValueError(f"provenance is on {provenance.device}, the pool on {pool.device}")
        if debug and n:
            keep = slot_ids[provenance == 0]
            _check_bounds(keep, pool.num_pages * pool.page_size, "slot_ids", unique=True)
        use_triton = (pool.device.type == "cuda" if backend == "auto" else _pick_backend(backend, pool, pool))
        if valid == 0:
            return 0
        if not use_triton:
            torch_store(pool, plane_indices, rows, slot_ids, provenance)
            return valid
        addrs = [PlaneAddr(r.data_ptr(), r.stride(0) * r.element_size(), pool.buffers[j].data_ptr(),
                           pool.layout.planes[j].row_bytes, pool.layout.planes[j].row_bytes)
                 for j, r in zip(plane_indices, rows)]
        plan = build_plan(addrs, pool.device, self.pcie)  # row addresses change every call
        src_idx = torch.arange(n, device=pool.device)
        _launch(plan, self.pcie, src_idx, slot_ids, provenance, pool.device, PCIE_BLOCKS)
        return valid


def _launch(plan: CopyPlan, tiles: TileConfig, s_idx: torch.Tensor, d_idx: torch.Tensor,
            keep: torch.Tensor | None, dev: torch.device, num_blocks: int,
            count: torch.Tensor | None = None, signal: Signal | None = None) -> None:
    """``count``: a one-element int64 tensor on ``dev`` holding how many leading
    pairs of ``s_idx``/``d_idx`` to copy, read by the kernel (a CUDA graph
    captures the launch once and replays it for any count); the grid is sized
    for every pair."""
    n = s_idx.numel()
    if num_blocks < 1:
        raise ValueError(f"num_blocks={num_blocks}; pass None (tuned default) or >= 1")
    units = max(-(-n * plan.t_wide // plan.rows), -(-n * plan.t_narrow // plan.nrows), 1)
    grid = (min(num_blocks, units),)
    args = (plan.wide_i32, plan.narrow, s_idx, d_idx, keep if keep is not None else s_idx,
            count if count is not None else s_idx, *(signal or (s_idx,) * 3), n, plan.t_wide, plan.t_narrow)
    meta = dict(ROWS=plan.rows, WORDS=plan.words, NROWS=plan.nrows, NBYTES=plan.nbytes,
                HAS_NARROW=plan.t_narrow > 0, HAS_KEEP=keep is not None, N_FROM_PTR=count is not None,
                SIGNAL=signal is not None)
    if dev.type != "cuda":
        _interpreted_kernel()[grid](*args, **meta)
    elif dev.index is None or dev.index == torch.cuda.current_device():
        _kernel()[grid](*args, **meta, num_warps=tiles.num_warps)
    else:  # Triton launches on the current device
        with torch.cuda.device(dev):
            _kernel()[grid](*args, **meta, num_warps=tiles.num_warps)


def _addrs(src: Pool, dst: Pool, plane_t: tuple[int, ...]) -> list[PlaneAddr]:
    out = []
    for j in plane_t:
        (sb, ss, sr), (db, ds, dr) = _plane_addr(src, j), _plane_addr(dst, j)
        out += [PlaneAddr(sb + so, ss, db + do, ds, n) for so, do, n in _pair_runs(sr, dr)]
    return out


# ------------------------------------------------------------------ helpers
def _relative(plan: CopyPlan) -> list[list[int]]:
    """Absolute addresses of a plan's entries (tables are stored anchor-relative)."""
    anchor = plan.wide.data_ptr()
    w = plan.wide[:plan.t_wide].cpu().tolist()
    nr = plan.narrow[:plan.t_narrow].cpu().tolist()
    return ([[r[0] * 16 + anchor, r[1] * 16, r[2] * 16 + anchor, r[3] * 16, r[4] * 16] for r in w]
            + [[r[0] + anchor, r[1], r[2] + anchor, r[3], r[4]] for r in nr])


def _norm(d: torch.device) -> torch.device:
    """``cuda`` -> ``cuda:<current>`` so that device comparisons are exact."""
    return torch.device("cuda", torch.cuda.current_device()) if d.type == "cuda" and d.index is None else d


def _gpu_of(src: Pool, dst: Pool) -> torch.device | None:
    devs = {_norm(d) for d in (_device(src), _device(dst)) if d.type == "cuda"}
    if len(devs) > 1:
        raise ValueError(f"pools live on different GPUs {sorted(map(str, devs))}; "
                         "copy through a host pool or use backend='torch'")
    return devs.pop() if devs else None


def _pick_backend(backend: str, src: Pool, dst: Pool) -> bool:
    """True for the Triton kernel (``backend='auto'`` is resolved by the caller)."""
    if backend == "torch":
        return False
    if backend != "triton":
        raise ValueError(f"backend={backend!r}; use 'auto', 'triton' or 'torch'")
    if isinstance(src, HostPool) and isinstance(dst, HostPool):
        raise ValueError("backend='triton' does not copy host->host; use backend='torch'")
    return True


def _check_planes(pool: Pool, planes: Sequence[int] | None) -> tuple[int, ...]:
    n = len(pool.layout.planes)
    if planes is None:
        return tuple(range(n))
    plane_t = tuple(int(p) for p in planes)
    bad = [p for p in plane_t if not 0 <= p < n]
    if bad or len(set(plane_t)) != len(plane_t):
        raise ValueError(f"planes={list(plane_t)}: need distinct plane indices in [0, {n}); "
                         "see KVLayout.planes / planes_of_layer()")
    return plane_t


def _check_signal(signal: Signal, use_triton: bool, dev: torch.device) -> None:
    bad = [] if use_triton else ["needs the kernel backend"]
    if len(signal) != 3:
        raise ValueError(f"signal: (counter, flag, epoch), got {len(signal)} items")
    for name, t in zip(("counter", "flag", "epoch"), signal):
        if t.numel() != 1 or t.dtype != torch.int64:
            bad.append(f"{name} is {tuple(t.shape)} {t.dtype}, not one int64")
        elif _norm(t.device) != _norm(dev) and not (name == "flag" and t.device.type == "cpu" and
                                                     (dev.type == "cpu" or t.is_pinned())):
            bad.append(f"{name} is on {t.device}, the copy runs on {dev}")
    if bad:
        raise ValueError("signal: " + "; ".join(bad))


def _check_pinned(src: Pool, dst: Pool, dev: torch.device) -> None:
    if dev.type != "cuda":
        return
    for side, pool in (("src", src), ("dst", dst)):
        if isinstance(pool, HostPool) and not pool.pinned:
            raise ValueError(f"{side} host pool is not pinned, so the GPU cannot address it; "
                             "create it with pin=True or use backend='torch'")


def _as_index(x: Indices, dev: torch.device | None, name: str,
              list_dev: torch.device | None = None) -> torch.Tensor:
    """Validated int64 index tensor on ``dev`` (``None``: any device; lists go to ``list_dev``)."""
    if not isinstance(x, torch.Tensor):
        return torch.tensor(list(x), dtype=torch.int64, device=dev or list_dev)
    if x.dtype != torch.int64 or x.dim() != 1 or (x.numel() > 1 and x.stride(0) != 1):
        raise TypeError(f"{name}: need a contiguous 1-D int64 tensor, got {x.dtype} "
                        f"shape {tuple(x.shape)} stride {x.stride()}")
    if dev is not None and _norm(x.device) != _norm(dev):
        raise ValueError(f"{name} is on {x.device}; this copy runs on {dev}, put the indices there")
    return x


def _check_bounds(idx: torch.Tensor, limit: int, name: str, unique: bool = False) -> None:
    if idx.numel() == 0:
        return
    lo, hi = int(idx.min()), int(idx.max())
    if lo < 0 or hi >= limit:
        raise IndexError(f"{name} spans [{lo}, {hi}], outside [0, {limit})")
    if unique and torch.unique(idx).numel() != idx.numel():
        raise ValueError(f"{name} repeats an id; a destination may be written once per call")


def _check_rows(pool: DevicePool, plane_indices: Sequence[int], rows: Sequence[torch.Tensor],
                slot_ids: torch.Tensor) -> int:
    if not isinstance(pool, DevicePool):
        raise TypeError(f"store_rows writes into a DevicePool, got {type(pool).__name__}")
    if pool.strided:
        raise ValueError("store_rows needs slot-addressable planes; this pool adopts an engine's paged KV "
                         "(page views), which the engine writes itself")
    if len(plane_indices) != len(rows):
        raise ValueError(f"{len(plane_indices)} plane indices but {len(rows)} row tensors")
    _as_index(slot_ids, pool.device, "slot_ids")
    n = slot_ids.numel()
    for j, r in zip(plane_indices, rows):
        s = pool.layout.planes[j]
        same = r.dtype == s.dtype or (s.dtype == torch.uint8 and r.element_size() == 1)
        dense = all(r.stride(d) == math.prod(r.shape[d + 1:]) for d in range(1, r.dim()))
        if tuple(r.shape) != (n, *s.row_shape) or not same or not dense or _norm(r.device) != _norm(pool.device):
            raise ValueError(f"rows for plane {j} ({s.name}, layer {s.layer}): got {r.dtype} shape "
                             f"{tuple(r.shape)} stride {r.stride()} on {r.device}; need {s.dtype} "
                             f"({n}, {', '.join(map(str, s.row_shape))}) dense rows on {pool.device}")
    return n


@functools.cache
def default_copier() -> PageCopier:
    """The per-process copier behind ``copy_pages`` / ``store_rows`` (plan cache only)."""
    return PageCopier()


def copy_pages(src: Pool, dst: Pool, src_pages: Indices, dst_pages: Indices, *,
               planes: Sequence[int] | None = None, num_blocks: int | None = None,
               backend: Backend = "auto", debug: bool = False, count: torch.Tensor | None = None,
               signal: Signal | None = None) -> None:
    """``default_copier().copy_pages(...)``; see ``PageCopier.copy_pages``."""
    default_copier().copy_pages(src, dst, src_pages, dst_pages, planes=planes, num_blocks=num_blocks,
                                backend=backend, debug=debug, count=count, signal=signal)


def store_rows(pool: DevicePool, plane_indices: Sequence[int], rows: Sequence[torch.Tensor],
               slot_ids: torch.Tensor, provenance: torch.Tensor, *, backend: Backend = "auto",
               debug: bool = False) -> int:
    """``default_copier().store_rows(...)``; see ``PageCopier.store_rows``."""
    return default_copier().store_rows(pool, plane_indices, rows, slot_ids, provenance,
                                       backend=backend, debug=debug)
