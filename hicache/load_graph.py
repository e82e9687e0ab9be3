"""A layer-wise load back as one CUDA-graph replay (GPU only).

A load back launches one page-copy kernel per layer (and one for the draft
planes), each followed by an event the forward pass waits on before that
layer's attention. Launched one by one that costs ~30 us of host time per
layer (Triton's launcher), ~1 ms for a 32-layer model: most of an
admission's host time. ``LoadGraph`` captures the whole sequence once per
(host pool, device pool) pair: every launch reads its page ids from fixed
device buffers and the number of pairs from device memory
(``copy_pages(..., count=)``), and every per-layer event is recorded as an
*external* event node, so streams outside the graph can wait on it. A load
then costs one small upload (the count, the source and the destination ids;
two when the pool is much larger than the load) and one replay.

The events are the graph's, shared by every replay: a stream that waits on
layer ``i`` waits for the latest replay's layer ``i`` at the time of the
wait. Replays run in order on one copy stream, so that is never too early
(at worst it also waits for a later load's layer ``i``).
"""
from __future__ import annotations

from typing import Sequence

import torch

from hicache.pools import DevicePool, HostPool

_RING = 4  # pinned staging buffers in rotation (a busy one falls back to a pageable upload)
# Up to this many unused ids (256 KiB, ~5 us on PCIe, about one launch's host time) are
# uploaded between the source and destination lists to save the second copy's launch.
_GAP_MAX = 32768


class LoadGraph:
    """The captured load back from ``host`` into ``device`` for ``groups`` (plane sets per layer)."""

    def __init__(self, host: HostPool, device: DevicePool, groups: Sequence[Sequence[int]]):
        from hicache.kernels.page_copy import default_copier
        self.host, self.device = host, device
        dev = device.device
        cap = self.capacity = device.num_pages
        self._buf = torch.zeros(1 + 2 * cap, dtype=torch.int64, device=dev)  # [count, src ids, dst ids]
        count, src, dst = self._buf[0:1], self._buf[1:1 + cap], self._buf[1 + cap:]
        self._stage = [torch.zeros(1 + 2 * cap, dtype=torch.int64).pin_memory() for _ in range(_RING)]
        self._stage_np = [t.numpy() for t in self._stage]
        self._stage_done: list[torch.cuda.Event | None] = [None] * _RING
        self._next = 0
        self.events = [torch.cuda.Event(external=True) for _ in groups]
        copier = default_copier()  # process-wide: its plans (read by every replay) live as long as the pools
        side = torch.cuda.Stream(device=dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):  # compile and build every plan outside the capture (count is 0)
            for planes in groups:
                if planes:
                    copier.copy_pages(host, device, src, dst, planes=list(planes), count=count)
        side.synchronize()
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, stream=side, capture_error_mode="thread_local"):
            for planes, ev in zip(groups, self.events):
                if planes:
                    copier.copy_pages(host, device, src, dst, planes=list(planes), count=count)
                ev.record()

    def launch(self, host_pages: Sequence[int], device_pages: Sequence[int], stream) -> list[torch.cuda.Event]:
        """Enqueue the load of ``host_pages[k]`` into ``device_pages[k]`` on ``stream`` (the
        caller made it wait for the engine's stream); returns the per-group events."""
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
            stage = torch.empty(1 + 2 * cap, dtype=torch.int64)
            arr = stage.numpy()
        arr[0] = n
        arr[1:1 + n] = host_pages
        arr[1 + cap:1 + cap + n] = device_pages
        with torch.cuda.stream(stream):
            if cap - n <= _GAP_MAX:  # one upload, the unused ids between the two lists included
                self._buf[:1 + cap + n].copy_(stage[:1 + cap + n], non_blocking=True)
            else:
                self._buf[:1 + n].copy_(stage[:1 + n], non_blocking=True)
                self._buf[1 + cap:1 + cap + n].copy_(stage[1 + cap:1 + cap + n], non_blocking=True)
            if stage is self._stage[i]:
                ev = self._stage_done[i] = torch.cuda.Event()
                ev.record(stream)
            self.graph.replay()
        return self.events
