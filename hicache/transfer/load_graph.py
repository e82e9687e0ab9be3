"""A layer-wise load back as one CUDA-graph replay (GPU only).

A load back launches one page-copy kernel per layer (and one for the draft
planes), and the forward pass waits for layer ``i``'s copy before that
layer's attention. Launched one by one, the launcher's host time per layer
adds up to most of an admission's host time (bench/RESULTS.md). ``LoadGraph`` captures the whole sequence once per
(host pool, device pool) pair: every launch reads its page ids from fixed
device buffers and the number of pairs from device memory
(``copy_pages(..., count=)``). A load then costs one small upload (the count,
the load's epoch, the source and the destination ids; two copies when the
pool is much larger than the load) and one replay.
"""
from __future__ import annotations

import ctypes
import threading
from typing import Literal, Sequence

import torch

from hicache.kernels.page_copy import default_copier
from hicache.memory.pools import DevicePool, HostPool

_RING = 4  # pinned staging buffers in rotation (a busy one falls back to a pageable upload)
# Up to this many unused ids (256 KiB, ~5 us on PCIe, about one launch's host time) are
# uploaded between the source and destination lists to save the second copy's launch.
_GAP_MAX = 32768
_HEAD = 2  # [count, epoch] ahead of the id lists in the device buffer

Completion = Literal["flags", "events"]


class LoadGraph:
    """The captured load back from ``host`` into ``device`` for ``groups`` (plane sets per layer).

    How the forward learns that layer ``i`` is in L1 (``completion``):

    * ``"flags"`` (the default where the driver has 64-bit stream memory
      operations): each layer's kernel writes the load's epoch to that layer's flag
      in pinned host memory once all of its programs are done (``copy_pages(...,
      signal=)``). A stream waits for layer ``i`` with ``cuStreamWaitValue64(flag
      >= epoch)``; the host reads the flag directly (``LayerFlag.query``). The
      graph holds only the kernels: replaying 33 kernels measured 8-45 us of host
      time against 95-200 us with an event node after each
      (``bench/graph_launch.py``). Epochs only grow and loads run in order on one
      stream, so a flag never goes back.
    * ``"events"``: an *external* event node after each layer's kernel, waited on
      with ``cudaStreamWaitEvent``. The events are the graph's, shared by every
      replay: a stream that waits on layer ``i`` waits for the latest replay's
      layer ``i`` at the time of the wait, which is never too early (at worst it
      also waits for a later load's layer ``i``).
    """

    def __init__(self, host: HostPool, device: DevicePool, groups: Sequence[Sequence[int]], *,
                 completion: Completion | None = None):
        """``completion``: how waiters learn a layer is in L1 (class docstring); ``None``:
        ``"flags"`` where stream memory operations work, else ``"events"``."""
        self.host, self.device = host, device
        dev = device.device
        if completion is None:
            completion = "flags" if _stream_wait_value_works(dev) else "events"
        if completion not in ("flags", "events"):
            raise ValueError(f"completion={completion!r}: 'flags' or 'events'")
        self.completion = completion
        cap = self.capacity = device.num_pages
        self._buf = torch.zeros(_HEAD + 2 * cap, dtype=torch.int64, device=dev)  # [count, epoch, src, dst]
        count, epoch = self._buf[0:1], self._buf[1:2]
        src, dst = self._buf[_HEAD:_HEAD + cap], self._buf[_HEAD + cap:]
        self._stage = [torch.zeros(_HEAD + 2 * cap, dtype=torch.int64).pin_memory() for _ in range(_RING)]
        self._stage_np = [t.numpy() for t in self._stage]
        self._stage_done: list[torch.cuda.Event | None] = [None] * _RING
        self._next = 0
        self._epoch = 0
        n = len(groups)
        self.events = [torch.cuda.Event(external=True) for _ in groups] if completion == "events" else []
        self._flags = torch.zeros(n, dtype=torch.int64).pin_memory()  # written by the kernels
        self._flags_np = self._flags.numpy()
        self._flags_addr = self._flags.data_ptr()
        self._counters = torch.zeros(n, dtype=torch.int64, device=dev)
        if not groups or not groups[0]:
            raise ValueError("LoadGraph: the first group (layer 0) has no planes")
        # A group without planes (no draft layers) is complete with the last group before it that has some.
        self._owner = [0]
        for g in range(1, n):
            self._owner.append(g if groups[g] else self._owner[-1])
        copier = default_copier()  # process-wide: its plans (read by every replay) live as long as the pools

        def record():
            for g, planes in enumerate(groups):
                if planes:
                    sig = ((self._counters[g:g + 1], self._flags[g:g + 1], epoch)
                           if completion == "flags" else None)
                    copier.copy_pages(host, device, src, dst, planes=list(planes), count=count, signal=sig)
                if completion == "events":
                    self.events[g].record()

        side = torch.cuda.Stream(device=dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):  # compile and build every plan outside the capture (count is 0)
            record()  # (epoch 0: the flags stay 0)
        side.synchronize()
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, stream=side, capture_error_mode="thread_local"):
            record()

    def launch(self, host_pages: Sequence[int], device_pages: Sequence[int], stream) -> list:
        """Enqueue the load of ``host_pages[k]`` into ``device_pages[k]`` on ``stream`` (the
        caller made it wait for the engine's stream); returns, per group, what a stream
        waits on (``stream.wait_event(x)``) and the host polls (``x.query()``)."""
        n = len(host_pages)
        if n != len(device_pages) or not 0 < n <= self.capacity:
            raise ValueError(f"LoadGraph.launch: {n} host pages, {len(device_pages)} device pages "
                             f"(1..{self.capacity} pairs)")
        cap = self.capacity
        i = self._next
        self._next = (i + 1) % _RING
        done = self._stage_done[i]
        if done is None or done.query():
            stage, arr = self._stage[i], self._stage_np[i]
        else:  # still uploading (a long queue ahead on the copy stream): a pageable copy never blocks
            stage = torch.empty(_HEAD + 2 * cap, dtype=torch.int64)
            arr = stage.numpy()
        self._epoch += 1
        arr[0] = n
        arr[1] = self._epoch
        arr[_HEAD:_HEAD + n] = host_pages
        arr[_HEAD + cap:_HEAD + cap + n] = device_pages
        with torch.cuda.stream(stream):
            if cap - n <= _GAP_MAX:  # one upload, the unused ids between the two lists included
                self._buf[:_HEAD + cap + n].copy_(stage[:_HEAD + cap + n], non_blocking=True)
            else:
                self._buf[:_HEAD + n].copy_(stage[:_HEAD + n], non_blocking=True)
                self._buf[_HEAD + cap:_HEAD + cap + n].copy_(stage[_HEAD + cap:_HEAD + cap + n], non_blocking=True)
            if stage is self._stage[i]:
                ev = self._stage_done[i] = torch.cuda.Event()
                ev.record(stream)
            self.graph.replay()
        if self.completion == "events":
            return self.events
        return [LayerFlag(self, g, self._epoch) for g in self._owner]

    def check_integrity(self) -> None:
        """Flags never exceed the last epoch launched; counters are zero between launches
        (synchronises the device; nothing to check with event nodes)."""
        if self.completion != "flags":
            return
        torch.cuda.synchronize(self.device.device)
        top = int(self._flags_np.max())
        if top > self._epoch or int(self._counters.abs().sum()) != 0:
            from hicache.core.errors import IntegrityError
            raise IntegrityError(f"load graph: flags up to {top} after {self._epoch} launches, counters "
                                 f"{self._counters.tolist()} (want 0 between launches)")


class LayerFlag:
    """Layer group ``g`` of load ``epoch``: complete once the graph's flag ``g`` >= ``epoch``.

    Quacks like the ``torch.cuda.Event`` a stream waits on: ``stream.wait_event(flag)``
    makes ``stream`` wait on the device (``cuStreamWaitValue64``); ``query()`` reads
    the pinned flag on the host, no CUDA call."""

    __slots__ = ("_graph", "_g", "epoch")

    def __init__(self, graph: LoadGraph, g: int, epoch: int):
        self._graph, self._g, self.epoch = graph, g, epoch

    def query(self) -> bool:
        return int(self._graph._flags_np[self._g]) >= self.epoch

    def wait(self, stream=None) -> None:
        """Make ``stream`` (default: the current one) wait until the layer is in L1. A layer
        already in L1 (the host read its flag) needs no wait on the device at all."""
        if self.query():
            return
        stream = torch.cuda.current_stream() if stream is None else stream
        if torch._C._cuda_isCurrentStreamCapturing():
            raise RuntimeError("waiting for a layer of a load back inside CUDA-graph capture is not supported "
                               "(a replay would wait for this load's epoch, not its own load): wait outside "
                               "the capture, or build the TransferController with graphs=False")
        _wait_value64(stream, self._graph._flags_addr + 8 * self._g, self.epoch)


# ------------------------------------------------------------- stream memory ops
_CU_STREAM_WAIT_VALUE_GEQ = 0x0
_libcuda = None
_thread = threading.local()  # .ready: this thread has a current CUDA context


def _driver():
    global _libcuda
    if _libcuda is None:
        lib = ctypes.CDLL("libcuda.so.1")
        lib.cuStreamWaitValue64_v2.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_uint]
        lib.cuStreamWaitValue64_v2.restype = ctypes.c_int
        lib.cuGetErrorName.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
        _libcuda = lib
    return _libcuda


def _wait_value64(stream, addr: int, value: int) -> None:
    """``stream`` waits on the device until the int64 at ``addr`` is >= ``value``."""
    lib = _driver()
    if not getattr(_thread, "ready", False):  # the driver API needs a current context: a runtime call binds it
        stream.query()
        _thread.ready = True
    if stream.device_index == torch._C._cuda_getDevice():
        rc = lib.cuStreamWaitValue64_v2(stream.cuda_stream, addr, value, _CU_STREAM_WAIT_VALUE_GEQ)
    else:
        with torch.cuda.device(stream.device_index):
            rc = lib.cuStreamWaitValue64_v2(stream.cuda_stream, addr, value, _CU_STREAM_WAIT_VALUE_GEQ)
    if rc != 0:
        name = ctypes.c_char_p()
        lib.cuGetErrorName(rc, ctypes.byref(name))
        raise RuntimeError(f"cuStreamWaitValue64 failed: {name.value.decode() if name.value else rc}")


def _stream_wait_value_works(dev: torch.device) -> bool:
    """Try one satisfied wait on a pinned flag (drivers or devices without 64-bit stream
    memory operations fail it): the capability check, by doing it."""
    try:
        flag = torch.ones(1, dtype=torch.int64).pin_memory()
        s = torch.cuda.Stream(device=dev)
        _wait_value64(s, flag.data_ptr(), 1)
        s.synchronize()
        return True
    except (OSError, AttributeError, RuntimeError):
        return False
