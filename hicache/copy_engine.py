"""Load backs through the GPU's copy engines when pages come in long runs.

The page-copy kernel moves scattered pages at 92-95% of a contiguous PCIe
copy: SM-issued reads cross PCIe less efficiently than the copy engines'.
When a load back's pages form long runs of adjacent ids on both sides (a
prefix backed up together, loaded into fresh L1 pages: the common case),
one ``cudaMemcpy2DAsync`` per plane and run moves a whole run at the copy
engines' rate (bench/RESULTS.md, "Copy engines for runs of adjacent pages":
99.2% H2D with ``page_first`` host pages and 94.4% with ``layer_first`` at
512-page runs, against 92-94% for the kernel; runs of 64 pages are no
better than the kernel, shorter ones far worse). ``runs`` finds the runs
(ascending or descending on both sides); ``CopyEngine`` issues the calls.

Each call costs ~12 us of host time, so the transfer engine issues them on
a worker thread (ctypes releases the GIL during the call), layer by layer,
recording the per-layer events the forward waits on.
"""
from __future__ import annotations

import ctypes
import glob
import logging
import os
from typing import Sequence

import numpy as np

log = logging.getLogger(__name__)

# A load goes through the copy engines only if every run is at least this long
# (measured: 64-page runs tie with the kernel, 512-page runs beat it by 5-7 points).
MIN_RUN_PAGES = 256
_H2D = 1  # cudaMemcpyHostToDevice


def runs(host_pages: Sequence[int], device_pages: Sequence[int],
         min_run: int = MIN_RUN_PAGES) -> list[tuple[int, int, int]] | None:
    """``(first host page, first device page, length)`` of the runs of pairs whose
    host and device ids both step by +1 (or both by -1, returned ascending), or
    None when a run is shorter than ``min_run`` (or there are no pairs)."""
    n = len(host_pages)
    if n < min_run or n != len(device_pages):
        return None
    h = np.fromiter(host_pages, dtype=np.int64, count=n)
    d = np.fromiter(device_pages, dtype=np.int64, count=n)
    s, t = np.diff(h), np.diff(d)
    step = (s == t) & ((s == 1) | (s == -1))  # pairs i and i+1 are adjacent on both sides
    cont = step.copy()
    cont[1:] &= ~(step[:-1] & (s[1:] != s[:-1]))  # a change of direction starts a new run
    starts = np.concatenate(([0], np.flatnonzero(~cont) + 1))
    ends = np.concatenate((starts[1:], [n]))
    if int((ends - starts).min()) < min_run:
        return None
    out = []
    for a, b in zip(starts.tolist(), ends.tolist()):
        out.append((int(min(h[a], h[b - 1])), int(min(d[a], d[b - 1])), b - a))
    return out


def _find_cudart() -> ctypes.CDLL | None:
    import torch
    base = os.path.dirname(torch.__file__)
    pats = [os.path.join(base, "lib", "libcudart.so*"),
            os.path.join(os.path.dirname(base), "nvidia", "*", "lib", "libcudart.so*"),
            os.path.join(os.path.dirname(base), "nvidia", "cuda_runtime", "lib", "libcudart.so*")]
    names = [p for pat in pats for p in sorted(glob.glob(pat))] + ["libcudart.so"]
    for name in names:
        try:
            lib = ctypes.CDLL(name)
        except OSError:
            continue
        lib.cudaMemcpy2DAsync.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t,
                                          ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
        lib.cudaMemcpy2DAsync.restype = ctypes.c_int
        return lib
    return None


class CopyEngine:
    """Issues host -> device copies of page runs (plane by plane) on a CUDA stream."""

    def __init__(self, host, device):
        lib = _find_cudart()
        if lib is None:
            raise RuntimeError("libcudart not found beside torch")
        self._lib = lib
        self.host, self.device = host, device
        lay = host.layout
        hbase = host.buffer.data_ptr()
        # per plane: (host address of page 0, host page stride, device address of page 0, page bytes)
        self._planes = [(hbase + host.plane_offset[s.index], host.page_stride[s.index],
                         device.buffers[s.index].data_ptr(), s.page_bytes) for s in lay.planes]

    def load(self, planes: Sequence[int], page_runs: Sequence[tuple[int, int, int]], stream_handle: int) -> None:
        """Copy ``planes`` of every run (host -> device) on the stream ``stream_handle``."""
        st = ctypes.c_void_p(stream_handle)
        memcpy2d = self._lib.cudaMemcpy2DAsync
        for j in planes:
            h0, hstride, d0, pb = self._planes[j]
            for h, d, n in page_runs:
                rc = memcpy2d(d0 + d * pb, pb, h0 + h * hstride, hstride, pb, n, _H2D, st)
                if rc:
                    raise RuntimeError(f"cudaMemcpy2DAsync returned CUDA error {rc} (plane {j}, run of {n} "
                                       f"pages from host page {h} to device page {d})")
