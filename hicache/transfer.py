"""Asynchronous page movement between tiers, index-agnostic.

The controller moves pages; it never touches the index. Each submission
returns a handle, and its completion callback runs **in the caller's thread**
during ``poll()`` (or ``wait``), so the index is only ever mutated by the
scheduler thread. Until the caller has observed completion, the pages a
transfer uses stay owned by that transfer (the caller holds lock refs).

Concurrency model: on a GPU, page copies run on a dedicated CUDA stream and
completion is observed through CUDA events; without a GPU, one worker thread
executes copies in submission order. L3 I/O always runs on its own worker
thread (a storage call may block up to its timeout).
"""
from __future__ import annotations

import logging
import queue
import threading
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from hicache.pools import DevicePool, HostPool

log = logging.getLogger(__name__)


def _copy_pages(src, dst, src_pages, dst_pages, planes=None) -> None:
    from hicache.kernels.page_copy import copy_pages
    copy_pages(src, dst, src_pages, dst_pages, planes=planes)


@dataclass(eq=False)
class Transfer:
    """One submitted operation. ``done`` flips when its completion is observed."""

    kind: str  # "d2h" | "h2d" | "l3_put" | "l3_get"
    on_done: Callable[["Transfer"], None] | None
    result: object = None
    error: BaseException | None = None
    done: bool = False
    _ready: threading.Event = field(default_factory=threading.Event, repr=False)
    _cuda_event: object = None

    def ready(self) -> bool:
        """True once the work itself has finished (completion not yet observed)."""
        if self._cuda_event is not None:
            return self._cuda_event.query()
        return self._ready.is_set()


class LoadHandle:
    """Handle of one L2 -> L1 load-back, layer by layer.

    ``wait_layer(i)`` returns once target layer ``i`` is in L1 (on a GPU it
    makes the current stream wait for it, without blocking the host);
    ``wait()`` once every plane, draft planes included, is there. Valid until
    the owning request finishes or aborts.
    """

    def __init__(self, transfer: Transfer, num_layers: int, on_gpu: bool):
        self.transfer = transfer
        self.num_layers = num_layers
        self._on_gpu = on_gpu
        self._layer_events: list = [None] * (num_layers + 1)  # last slot: draft planes
        self._layer_flags = [threading.Event() for _ in range(num_layers + 1)]

    def wait_layer(self, i: int) -> None:
        if not 0 <= i < self.num_layers:
            raise IndexError(f"layer {i} out of range [0, {self.num_layers})")
        self._wait(i)

    def wait(self) -> None:
        for i in range(self.num_layers + 1):
            self._wait(i)

    def layer_ready(self, i: int) -> bool:
        ev = self._layer_events[i]
        return ev.query() if self._on_gpu and ev is not None else self._layer_flags[i].is_set()

    def _wait(self, i: int) -> None:
        if self._on_gpu:
            self._layer_flags[i].wait()  # event recorded (set right after launch)
            torch.cuda.current_stream().wait_event(self._layer_events[i])
        else:
            self._layer_flags[i].wait()
            if self.transfer.error is not None:
                raise self.transfer.error


class TransferController:
    """Runs L1<->L2 copies and L2<->L3 I/O without blocking the scheduler."""

    def __init__(self, device_pool: DevicePool, host_pool: HostPool, storage=None):
        self.device_pool = device_pool
        self.host_pool = host_pool
        self.storage = storage
        self.on_gpu = device_pool.device.type == "cuda"
        self._pending: list[Transfer] = []
        self._plane_groups = self._layer_plane_groups()
        self.bytes_moved = {"d2h": 0, "h2d": 0, "l3_put": 0, "l3_get": 0}
        self._copy_q: queue.Queue | None = None
        self._io_q: queue.Queue = queue.Queue()
        self._threads: list[threading.Thread] = []
        if self.on_gpu:
            self._stream = torch.cuda.Stream(device=device_pool.device)
        else:
            self._copy_q = queue.Queue()
            self._threads.append(self._start(self._copy_q, "hicache-copy"))
        self._threads.append(self._start(self._io_q, "hicache-l3"))

    def _layer_plane_groups(self) -> list[list[int]]:
        lay = self.device_pool.layout
        groups = [[s.index for s in lay.planes_of_layer(i)] for i in range(lay.num_layers)]
        groups.append([s.index for s in lay.planes if s.draft])
        return groups

    @staticmethod
    def _start(q: queue.Queue, name: str) -> threading.Thread:
        def loop():
            while True:
                job = q.get()
                if job is None:
                    return
                job()
        t = threading.Thread(target=loop, name=name, daemon=True)
        t.start()
        return t

    # ----------------------------------------------------------------- L1 <-> L2
    def _idx(self, pages: Sequence[int]) -> torch.Tensor:
        return torch.as_tensor(list(pages), dtype=torch.int64, device=self.device_pool.device)

    def _keep_for_copy(self, *idx: torch.Tensor) -> None:
        """The index tensors are allocated on the caller's stream and read by copies on
        ours: without this, the caller's next allocations may reuse their memory while
        a copy still reads it (the engine's forward runs while a layer-wise load copies)."""
        for t in idx:
            t.record_stream(self._stream)

    def backup(self, device_pages: Sequence[int], host_pages: Sequence[int],
               on_done: Callable[[Transfer], None] | None = None) -> Transfer:
        """Copy L1 pages to L2 (all planes). The caller holds both sets of pages."""
        assert len(device_pages) == len(host_pages), (len(device_pages), len(host_pages))
        t = Transfer("d2h", on_done)
        nbytes = len(device_pages) * self.device_pool.layout.page_bytes
        src, dst = self._idx(device_pages), self._idx(host_pages)
        if self.on_gpu:
            self._stream.wait_stream(torch.cuda.current_stream())  # rows written by the engine
            self._keep_for_copy(src, dst)
            with torch.cuda.stream(self._stream):
                _copy_pages(self.device_pool, self.host_pool, src, dst)
                t._cuda_event = torch.cuda.Event()
                t._cuda_event.record(self._stream)
        else:
            def job():
                try:
                    _copy_pages(self.device_pool, self.host_pool, src, dst)
                except BaseException as e:  # surfaced to the caller at poll()
                    t.error = e
                t._ready.set()
            self._copy_q.put(job)
        self.bytes_moved["d2h"] += nbytes
        self._pending.append(t)
        return t

    def load_back(self, host_pages: Sequence[int], device_pages: Sequence[int],
                  on_done: Callable[[Transfer], None] | None = None) -> LoadHandle:
        """Copy L2 pages into L1 layer by layer; returns a ``LoadHandle``."""
        assert len(device_pages) == len(host_pages), (len(device_pages), len(host_pages))
        t = Transfer("h2d", on_done)
        h = LoadHandle(t, self.device_pool.layout.num_layers, self.on_gpu)
        src, dst = self._idx(host_pages), self._idx(device_pages)
        if self.on_gpu:
            self._stream.wait_stream(torch.cuda.current_stream())
            self._keep_for_copy(src, dst)
            with torch.cuda.stream(self._stream):
                for i, planes in enumerate(self._plane_groups):
                    if planes:
                        _copy_pages(self.host_pool, self.device_pool, src, dst, planes=planes)
                    ev = torch.cuda.Event()
                    ev.record(self._stream)
                    h._layer_events[i] = ev
                    h._layer_flags[i].set()
                t._cuda_event = h._layer_events[-1]
        else:
            def job():
                try:
                    for i, planes in enumerate(self._plane_groups):
                        if planes:
                            _copy_pages(self.host_pool, self.device_pool, src, dst, planes=planes)
                        h._layer_flags[i].set()
                except BaseException as e:
                    t.error = e
                    for f in h._layer_flags:
                        f.set()
                t._ready.set()
            self._copy_q.put(job)
        self.bytes_moved["h2d"] += len(host_pages) * self.device_pool.layout.page_bytes
        self._pending.append(t)
        return h

    # ----------------------------------------------------------------- L2 <-> L3
    def storage_put(self, host_pages: Sequence[int], hashes: Sequence[bytes],
                    on_done: Callable[[Transfer], None] | None = None) -> Transfer:
        """Write L2 pages to L3. ``result`` = number stored. Caller host-locks the pages."""
        assert self.storage is not None and len(host_pages) == len(hashes)
        t = Transfer("l3_put", on_done)
        sizes = [p.page_bytes for p in self.host_pool.layout.planes]

        def job():
            try:
                items = [(k, self.host_pool.read_page(p), sizes) for k, p in zip(hashes, host_pages)]
                t.result = self.storage.put(items)
            except BaseException as e:
                t.error = e
            t._ready.set()
        self._io_q.put(job)
        self.bytes_moved["l3_put"] += len(host_pages) * self.host_pool.layout.page_bytes
        self._pending.append(t)
        return t

    def storage_get(self, hashes: Sequence[bytes], host_pages: Sequence[int],
                    on_done: Callable[[Transfer], None] | None = None) -> Transfer:
        """Read pages from L3 into L2. ``result`` = number of leading pages loaded
        (a miss or corrupt object stops the prefix there)."""
        assert self.storage is not None and len(host_pages) == len(hashes)
        t = Transfer("l3_get", on_done)
        sizes = [p.page_bytes for p in self.host_pool.layout.planes]

        def job():
            n = 0
            try:
                for payload, p in zip(self.storage.get(list(hashes), sizes), host_pages):
                    if payload is None:
                        break
                    self.host_pool.write_page(p, payload)
                    n += 1
            except BaseException as e:
                t.error = e
            t.result = n
            self.bytes_moved["l3_get"] += n * self.host_pool.layout.page_bytes
            t._ready.set()
        self._io_q.put(job)
        self._pending.append(t)
        return t

    def storage_probe(self, hashes: Sequence[bytes], budget_s: float | None = None) -> int:
        """Leading pages L3 holds (synchronous; 0 when L3 does not answer within ``budget_s``)."""
        if self.storage is None or not hashes:
            return 0
        return self.storage.prefix_hits(list(hashes), budget_s)

    # ------------------------------------------------------------- completion
    def poll(self) -> list[Transfer]:
        """Observe finished transfers without blocking; run their callbacks here."""
        done, still = [], []
        for t in self._pending:
            (done if t.ready() else still).append(t)
        self._pending = still
        for t in done:
            self._finish(t)
        return done

    def wait(self, t: Transfer, timeout: float | None = None) -> bool:
        """Block until ``t`` is finished, then observe it (and whatever else is done)."""
        if t._cuda_event is not None:
            t._cuda_event.synchronize()
        elif not t._ready.wait(timeout):
            return False
        self.poll()
        return True

    def drain(self) -> None:
        """Block until every pending transfer is observed."""
        while self._pending:
            self.wait(self._pending[0])

    def _finish(self, t: Transfer) -> None:
        t.done = True
        if t.error is not None:
            log.warning("transfer %s failed: %s", t.kind, t.error)
        if t.on_done is not None:
            t.on_done(t)

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    def close(self) -> None:
        self.drain()
        for q in (self._copy_q, self._io_q):
            if q is not None:
                q.put(None)
        for th in self._threads:
            th.join(timeout=5)
