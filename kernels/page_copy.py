"""Launchers: gather/scatter pages between pools, and store new K/V rows by slot id.

``copy_pages`` moves page ``src_pages[k]`` of one pool to page ``dst_pages[k]``
of another, for every plane or a chosen subset (one layer per launch), in one
Triton launch: device→host and host→device through pinned host memory that
the GPU addresses directly, device→device, either host layout, MHA / MLA /
byte / draft planes alike. Without a GPU it runs plain torch (``reference``),
which writes the same bytes.

``PageCopier`` owns the cached address tables; the module functions use one
per-process instance (``default_copier()``), a pure memoisation keyed weakly
by pool, so it never keeps a pool alive and never changes a result.
"""
from __future__ import annotations

import functools
import math
import weakref
from dataclasses import dataclass
from typing import Literal, Sequence

import torch

from hicache.kernels import _triton_copy
from hicache.kernels.plan import CopyPlan, PlaneAddr, TileConfig, build_plan
from hicache.kernels.reference import torch_copy, torch_store
from hicache.errors import IntegrityError
from hicache.pools import DevicePool, HostPool
from hicache.provenance import check_provenance

Pool = DevicePool | HostPool
Backend = Literal["auto", "triton", "torch"]
Indices = torch.Tensor | Sequence[int]

# ---------------------------------------------------------------- tuned constants
# Measured on an H200 (bench/transfer.py, bench/RESULTS.md "Page-copy kernels").
# 32 KiB per program per iteration = 8 x 16-byte loads per thread at 8 warps:
# enough bytes in flight that 8 programs cover PCIe latency in both directions.
TILE_BYTES = 32768
NUM_WARPS = 8
# Odd-sized byte planes move byte by byte; keep their tile small (registers).
NARROW_TILE_BYTES = 4096
# PCIe copies: 8 programs reach the pinned-copy limit and leave the other SMs
# to the engine's compute (issue #4 caps this at 8).
PCIE_BLOCKS = 8
# Device-to-device copies saturate HBM only with the whole chip: programs per SM.
D2D_BLOCKS_PER_SM = 4


@functools.cache
def _interpreted_kernel():
    """The kernel run by Triton's interpreter, for CPU tensors (tests)."""
    from triton.runtime.interpreter import InterpretedFunction

    k = _triton_copy._page_copy_kernel
    return k if isinstance(k, InterpretedFunction) else InterpretedFunction(k.fn)


def _device(pool: Pool) -> torch.device:
    return pool.device if isinstance(pool, DevicePool) else pool.buffer.device


def _plane_addr(pool: Pool, plane: int) -> tuple[int, int]:
    if isinstance(pool, DevicePool):
        return pool.buffers[plane].data_ptr(), pool.layout.planes[plane].page_bytes
    return pool.buffer.data_ptr() + pool.plane_offset[plane], pool.page_stride[plane]


@dataclass(slots=True)
class _PairPlans:
    """Plans of one (src, dst) pool pair, keyed by (plane tuple, launch device, tiles)."""

    plans: dict[tuple, CopyPlan]


class PageCopier:
    """Launches page copies and row stores; caches one ``CopyPlan`` per pool pair and plane set.

    Plans are weakly keyed by the pool objects: a pool's buffers must not be
    replaced after its first copy (pools never do that). Not thread-safe: one
    owner (the transfer engine) serialises calls, as for the pools themselves.
    """

    def __init__(self, tiles: TileConfig = TileConfig(TILE_BYTES, NARROW_TILE_BYTES),
                 num_warps: int = NUM_WARPS):
        self.tiles = tiles
        self.num_warps = num_warps
        self._plans: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    # ------------------------------------------------------------------ copies
    def copy_pages(self, src: Pool, dst: Pool, src_pages: Indices, dst_pages: Indices, *,
                   planes: Sequence[int] | None = None, num_blocks: int | None = None,
                   backend: Backend = "auto", debug: bool = False) -> None:
        """Copy page ``src_pages[k]`` of ``src`` to page ``dst_pages[k]`` of ``dst``.

        ``planes``: plane indices to move (``None`` = every plane, target and
        draft). Mutates ``dst`` only. On a GPU the copy is asynchronous on the
        current CUDA stream: keep both index tensors and both pools alive and
        unchanged until the caller's event completes. ``debug`` checks index
        bounds and destination uniqueness (synchronises). Raises ``ValueError``
        / ``TypeError`` naming the offending argument.
        """
        plane_t = _check_planes(src, dst, planes)
        gpu = _gpu_of(src, dst)
        use_triton = _pick_backend(backend, gpu, src, dst)
        launch_dev = gpu if gpu is not None else torch.device("cpu")
        # The torch path moves indices itself (it synchronises anyway); the kernel needs them on its device.
        s_idx = _as_index(src_pages, launch_dev if use_triton else None, "src_pages", _device(src))
        d_idx = _as_index(dst_pages, launch_dev if use_triton else None, "dst_pages", _device(dst))
        if s_idx.numel() != d_idx.numel():
            raise ValueError(f"src_pages has {s_idx.numel()} entries, dst_pages {d_idx.numel()}; "
                             "pass one destination per source page")
        if debug:
            _check_bounds(s_idx, src.num_pages, "src_pages")
            _check_bounds(d_idx, dst.num_pages, "dst_pages", unique=True)
        if s_idx.numel() == 0:
            return
        if not use_triton:
            torch_copy(src, dst, s_idx, d_idx, plane_t)
            return
        plan = self._plan(src, dst, plane_t, launch_dev)
        self._launch(plan, s_idx, d_idx, None, launch_dev, num_blocks, src, dst)

    def plan(self, src: Pool, dst: Pool, planes: Sequence[int] | None = None) -> CopyPlan:
        """The (cached) plan ``copy_pages`` launches with; for benchmarks and tests."""
        plane_t = _check_planes(src, dst, planes)
        gpu = _gpu_of(src, dst)
        return self._plan(src, dst, plane_t, gpu if gpu is not None else torch.device("cpu"))

    def check_integrity(self) -> None:
        """Every cached plan still matches its pools' addresses (buffers never replaced)."""
        for src, by_dst in list(self._plans.items()):
            for dst, pair in list(by_dst.items()):
                for (plane_t, dev, tiles), plan in pair.plans.items():
                    fresh = build_plan(self._addrs(src, dst, plane_t), torch.device("cpu"), tiles)
                    got = _relative(plan)
                    want = _relative(fresh)
                    if got != want or (plan.rows, plan.words, plan.nrows, plan.nbytes) != (
                            fresh.rows, fresh.words, fresh.nrows, fresh.nbytes):
                        raise IntegrityError(f"cached copy plan for planes {plane_t} on {dev} no "
                                             "longer matches its pools' buffers; were they replaced?")

    @staticmethod
    def _addrs(src: Pool, dst: Pool, plane_t: tuple[int, ...]) -> list[PlaneAddr]:
        out = []
        for j in plane_t:
            (sb, ss), (db, ds) = _plane_addr(src, j), _plane_addr(dst, j)
            out.append(PlaneAddr(sb, ss, db, ds, src.layout.planes[j].page_bytes))
        return out

    def _plan(self, src: Pool, dst: Pool, plane_t: tuple[int, ...], dev: torch.device) -> CopyPlan:
        by_dst = self._plans.get(src)
        if by_dst is None:
            by_dst = self._plans[src] = weakref.WeakKeyDictionary()
        pair = by_dst.get(dst)
        if pair is None:
            pair = by_dst[dst] = _PairPlans({})
        key = (plane_t, dev, self.tiles)
        plan = pair.plans.get(key)
        if plan is None:
            _check_pinned(src, dst, dev)
            plan = pair.plans[key] = build_plan(self._addrs(src, dst, plane_t), dev, self.tiles)
        return plan

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
        use_triton = _pick_backend(backend, pool.device if pool.device.type == "cuda" else None, pool, pool)
        if valid == 0:
            return 0
        if not use_triton:
            torch_store(pool, plane_indices, rows, slot_ids, provenance)
            return valid
        addrs = [PlaneAddr(r.data_ptr(), r.stride(0) * r.element_size(), pool.buffers[j].data_ptr(),
                           pool.layout.planes[j].row_bytes, pool.layout.planes[j].row_bytes)
                 for j, r in zip(plane_indices, rows)]
        plan = build_plan(addrs, pool.device, self.tiles)  # row addresses change every call
        src_idx = torch.arange(n, device=pool.device)
        self._launch(plan, src_idx, slot_ids, provenance, pool.device, None, pool, pool)
        return valid

    # ------------------------------------------------------------------ launch
    def _launch(self, plan: CopyPlan, s_idx: torch.Tensor, d_idx: torch.Tensor,
                keep: torch.Tensor | None, dev: torch.device, num_blocks: int | None,
                src: Pool, dst: Pool) -> None:
        n = s_idx.numel()
        if num_blocks is None:
            num_blocks = _default_blocks(src, dst, dev)
        if num_blocks < 1:
            raise ValueError(f"num_blocks={num_blocks}; pass None (tuned default) or >= 1")
        units = max(-(-n * plan.t_wide // plan.rows), -(-n * plan.t_narrow // plan.nrows), 1)
        grid = (min(num_blocks, units),)
        kernel = _triton_copy._page_copy_kernel if dev.type == "cuda" else _interpreted_kernel()
        args = (plan.wide_i32, plan.narrow, s_idx, d_idx,
                keep if keep is not None else s_idx, n, plan.t_wide, plan.t_narrow)
        meta = dict(ROWS=plan.rows, WORDS=plan.words, NROWS=plan.nrows, NBYTES=plan.nbytes,
                    HAS_NARROW=plan.t_narrow > 0, HAS_KEEP=keep is not None)
        if dev.type != "cuda":
            kernel[grid](*args, **meta)
        elif dev.index is None or dev.index == torch.cuda.current_device():
            kernel[grid](*args, **meta, num_warps=self.num_warps)
        else:  # Triton launches on the current device
            with torch.cuda.device(dev):
                kernel[grid](*args, **meta, num_warps=self.num_warps)


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


def _pick_backend(backend: str, gpu: torch.device | None, src: Pool, dst: Pool) -> bool:
    if backend not in ("auto", "triton", "torch"):
        raise ValueError(f"backend={backend!r}; use 'auto', 'triton' or 'torch'")
    if backend == "torch":
        return False
    both_host = isinstance(src, HostPool) and isinstance(dst, HostPool)
    if backend == "triton":
        if both_host:
            raise ValueError("backend='triton' does not copy host->host; use backend='torch'")
        return True
    return gpu is not None and not both_host


def _check_planes(src: Pool, dst: Pool, planes: Sequence[int] | None) -> tuple[int, ...]:
    if src.layout is not dst.layout and src.layout.fingerprint() != dst.layout.fingerprint():
        src.layout.check_compatible(dst.layout)  # raises ContractMismatch naming the fields
    n = len(src.layout.planes)
    if planes is None:
        return tuple(range(n))
    plane_t = tuple(int(p) for p in planes)
    bad = [p for p in plane_t if not 0 <= p < n]
    if bad or len(set(plane_t)) != len(plane_t):
        raise ValueError(f"planes={list(plane_t)}: need distinct plane indices in [0, {n}); "
                         "see KVLayout.planes / planes_of_layer()")
    return plane_t


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


def _default_blocks(src: Pool, dst: Pool, dev: torch.device) -> int:
    if isinstance(src, DevicePool) and isinstance(dst, DevicePool) and dev.type == "cuda":
        return D2D_BLOCKS_PER_SM * torch.cuda.get_device_properties(dev).multi_processor_count
    return PCIE_BLOCKS


@functools.cache
def default_copier() -> PageCopier:
    """The per-process copier behind ``copy_pages`` / ``store_rows`` (plan cache only)."""
    return PageCopier()


def copy_pages(src: Pool, dst: Pool, src_pages: Indices, dst_pages: Indices, *,
               planes: Sequence[int] | None = None, num_blocks: int | None = None,
               backend: Backend = "auto", debug: bool = False) -> None:
    """``default_copier().copy_pages(...)``; see ``PageCopier.copy_pages``."""
    default_copier().copy_pages(src, dst, src_pages, dst_pages, planes=planes,
                                num_blocks=num_blocks, backend=backend, debug=debug)


def store_rows(pool: DevicePool, plane_indices: Sequence[int], rows: Sequence[torch.Tensor],
               slot_ids: torch.Tensor, provenance: torch.Tensor, *, backend: Backend = "auto",
               debug: bool = False) -> int:
    """``default_copier().store_rows(...)``; see ``PageCopier.store_rows``."""
    return default_copier().store_rows(pool, plane_indices, rows, slot_ids, provenance,
                                       backend=backend, debug=debug)
