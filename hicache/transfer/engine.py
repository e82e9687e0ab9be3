"""Worker side of tiering: the transfer engine, index-agnostic.

It moves pages and never touches the index or calls its caller:
``submit(plan) -> job id`` starts the copy or I/O a plan of
``hicache.tiers.plans`` describes (the mover registered for its route, ``MOVERS``), ``finished()`` returns the ``TransferResult`` of
every job done since the last call (in submission order), and the caller
(``HiCache.poll``) hands each to the matching ``TierManager.complete_*`` in
its own thread, so the index is only ever mutated by the scheduler thread.
Until then the pages a job uses stay pinned by its plan.
"""
from __future__ import annotations

import atexit
import functools
import enum
import logging
import queue
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple, Sequence

import torch

from hicache.core.errors import IntegrityError, TransferError
from hicache.core.layout import KVLayout
from hicache.memory.pools import DevicePool, HostPool
from hicache.kernels.page_copy import copy_pages
from hicache.transfer.media import FULL, L1_TO_L2, L2_TO_L1, L2_TO_L3, L3_TO_L2, Movable, PageCopy, PageIo, Route
from hicache.core.types import JobId

log = logging.getLogger(__name__)


def _copy_pages(src, dst, src_pages, dst_pages, planes=None) -> None:
    copy_pages(src, dst, src_pages, dst_pages, planes=planes)


def _stop_at_exit(ref: "weakref.ref[TransferController]") -> None:
    tc = ref()
    if tc is not None:
        tc._stop_workers(timeout=10)  # one running job: a page copy or an L3 call within its timeout


def _same_len(a: Sequence, b: Sequence) -> None:
    if len(a) != len(b):
        raise TransferError(f"a transfer pairs {len(a)} source pages with {len(b)} destinations")


class TransferKind(enum.StrEnum):
    """What a transfer moves (also the keys of ``TransferController.bytes_moved``)."""

    D2H = "d2h"  # L1 -> L2 (backup)
    H2D = "h2d"  # L2 -> L1 (load back)
    L3_PUT = "l3_put"  # L2 -> L3 (store)
    L3_GET = "l3_get"  # L3 -> L2 (prefetch)


# Members read once: an enum member lookup costs ~0.8 us on Python 3.11 (per job, twice).
_D2H, _H2D, _L3_PUT, _L3_GET = TransferKind.D2H, TransferKind.H2D, TransferKind.L3_PUT, TransferKind.L3_GET


class TransferResult(NamedTuple):
    """The outcome of one job, as ``finished()`` reports it."""

    job: JobId  # the id ``submit`` returned
    kind: TransferKind
    pages: int  # pages moved: all of them for a copy; leading pages stored / loaded for L3
    error: BaseException | None  # what the worker raised (None: it completed)
    seconds: float = 0.0  # how long the work took (h2d and l3_get; 0: not timed)

    @property
    def ok(self) -> bool:
        return self.error is None


@dataclass(eq=False)
class Transfer:
    """One submitted operation (reported once by ``finished()``)."""

    kind: TransferKind
    job: JobId = JobId(0)
    pages: int = 0  # pages a copy moves
    result: int | None = None  # L3 jobs: leading pages stored / loaded
    error: BaseException | None = None
    ready_flag: threading.Event = field(default_factory=threading.Event, repr=False)  # CPU jobs: set when done
    cuda_event: object = None  # GPU jobs: recorded after the last copy
    seconds: float = 0.0  # CPU jobs: measured by the worker
    timing: tuple | None = None  # GPU load backs: (start, end) timing events, read once done

    def ready(self) -> bool:
        """True once the work itself has finished (completion not yet observed)."""
        if self.cuda_event is not None:
            return self.cuda_event.query()
        return self.ready_flag.is_set()


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
        # On a GPU every layer is enqueued before load_back returns (its event is the
        # signal); on the CPU a worker thread copies and sets a flag per layer.
        self._layer_flags = None if on_gpu else [threading.Event() for _ in range(num_layers + 1)]

    def wait_layer(self, i: int) -> None:
        if not 0 <= i < self.num_layers:
            raise IndexError(f"layer {i} out of range [0, {self.num_layers})")
        self._wait(i)

    def wait(self) -> None:
        for i in range(self.num_layers + 1):
            self._wait(i)

    def layer_launched(self, i: int, event=None) -> None:
        """The engine's worker: layer ``i`` is copied (CPU) or its copy is enqueued
        with ``event`` completing after it (GPU: a ``torch.cuda.Event`` or a
        ``load_graph.LayerFlag``, both with ``query()`` and ``wait()``)."""
        self._layer_events[i] = event
        if self._layer_flags is not None:
            self._layer_flags[i].set()

    def release_all(self) -> None:
        """The engine's worker: the job failed; wake every waiter (they see ``transfer.error``)."""
        for f in self._layer_flags or ():
            f.set()

    def layer_ready(self, i: int) -> bool:
        if self._on_gpu:
            return self._layer_events[i].query()
        return self._layer_flags[i].is_set()

    def _wait(self, i: int) -> None:
        if self._on_gpu:  # (recorded when load_back returned): the current stream waits for it
            self._layer_events[i].wait()  # a torch.cuda.Event or a load_graph.LayerFlag
        else:
            self._layer_flags[i].wait()
            if self.transfer.error is not None:
                raise self.transfer.error


def layer_plane_groups(lay: KVLayout) -> list[list[int]]:
    """Plane indices a layer-wise load back copies per step: each layer's planes, then the draft planes."""
    groups = [[s.index for s in lay.planes_of_layer(i)] for i in range(lay.num_layers)]
    groups.append([s.index for s in lay.planes if s.draft])
    return groups


class _Inline:
    """A job queue that runs each job as it is put (``TransferController(inline=True)``)."""

    def put(self, job) -> None:
        if job is not None:
            job()


class TransferController:
    """Runs L1<->L2 copies and L2<->L3 I/O without blocking the scheduler.

    Concurrency model: on a GPU, page copies run on a dedicated CUDA stream and
    completion is observed through CUDA events (a graphed load back's layers:
    through flags its kernels write, ``hicache.transfer.load_graph``); without a GPU, one worker thread
    executes copies in submission order. L3 I/O always runs on its own worker
    thread (a storage call may block up to its timeout).
    """

    def __init__(self, device_pool: DevicePool, host_pool: HostPool, storage=None, *, graphs: bool = True,
                 inline: bool = False):
        """``graphs`` (GPU): run each layer-wise load back as one CUDA-graph replay
        (``hicache.transfer.load_graph``) instead of one launch per layer. ``inline`` (CPU
        pools only): run every job in the caller's thread at ``submit`` (the
        simulator: deterministic, and no thread hand-off per job, which cost
        ~1 ms a job on a loaded 2-core machine); results are still reported by
        ``finished``."""
        self.device_pool = device_pool
        self.host_pool = host_pool
        self.storage = storage
        self.on_gpu = device_pool.device.type == "cuda"
        self._pending: list[Transfer] = []  # submitted, not yet reported by finished()
        # GPU load backs' (start, end) timing events, reused once read (creating two CUDA
        # events per admission was a measurable part of its host time)
        self._timing_free: list[tuple] = []
        self._jobs: dict[JobId, Transfer] = {}  # the same, by job id
        self._handles: dict[JobId, LoadHandle] = {}  # load jobs' layer-wise handles
        self._next_job = 0
        self._plane_groups = layer_plane_groups(device_pool.layout)
        self.bytes_moved: dict[str, int] = {k.value: 0 for k in TransferKind}
        self._copy_q: queue.Queue | _Inline | None = None
        self._io_q: queue.Queue | _Inline = queue.Queue()
        self._threads: list[threading.Thread] = []
        self._stopping = threading.Event()  # set by close() and at exit: workers end
        self._closed = False
        self._graphs = graphs and self.on_gpu
        self._graph = None  # LoadGraph of (host_pool, device_pool), captured on the first load back
        # Layer groups' pools (``add_group``): plans with ``group >= 0`` move their ids there.
        self._groups: dict[int, tuple[DevicePool, HostPool, object]] = {}
        self._group_planes: dict[int, list[list[int]]] = {}  # their layer-wise plane sets
        self._group_page_bytes: dict[int, int] = {}  # bytes one page of their loads moves
        self._group_graphs: dict[int, object] = {}  # their captured load backs (LoadGraph)
        if inline:
            if self.on_gpu:
                raise TransferError("inline transfers run CPU pools only; the device pool is on "
                                    f"{device_pool.device}")
            self._copy_q, self._io_q = _Inline(), _Inline()
        elif self.on_gpu:
            # (A high-priority copy stream was measured: no TTFT change, bench/RESULTS.md.)
            self._stream = torch.cuda.Stream(device=device_pool.device)
        else:
            self._copy_q = queue.Queue()
            self._threads.append(self._start(self._copy_q, "hicache-copy"))
        if not inline:
            self._threads.append(self._start(self._io_q, "hicache-l3"))
        # A daemon worker still inside a torch op when the interpreter finalizes
        # cannot retake the GIL: CPython ends it with pthread_exit, whose unwind
        # through torch's C++ frames calls std::terminate ("terminate called
        # without an active exception", rc 134). A process that exits without
        # close() (an exception in the engine's code) stops the workers first.
        self._exit_hook = functools.partial(_stop_at_exit, weakref.ref(self))
        atexit.register(self._exit_hook)

    def _start(self, q: queue.Queue, name: str) -> threading.Thread:
        stopping = self._stopping

        def loop():
            while True:
                job = q.get()
                if job is None or stopping.is_set():
                    return
                job()
        t = threading.Thread(target=loop, name=name, daemon=True)
        t.start()
        return t

    def _stop_workers(self, timeout: float) -> None:
        """End the worker threads after the job each is running; queued jobs are dropped."""
        self._stopping.set()
        for q in (self._copy_q, self._io_q):
            if q is not None:
                q.put(None)
        for th in self._threads:
            th.join(timeout=timeout)

    def add_group(self, group: int, device_pool: DevicePool, host_pool: HostPool, storage=None, *,
                  layers: Sequence[int] | None = None) -> None:
        """Register layer group ``group``'s L1 and L2 pools and L3 backend: plans with that
        ``group`` move their ids between them, on the same stream, threads and queues.
        ``layers``: the pools' layers the group's loads copy, in load order (default: all,
        draft planes last); a load's handle numbers them from 0."""
        if group < 0 or group in self._groups:
            raise TransferError(f"layer group {group} is registered already or not >= 0")
        self._groups[group] = (device_pool, host_pool, storage)
        planes = layer_plane_groups(device_pool.layout)
        self._group_planes[group] = planes if layers is None else [planes[i] for i in layers] + [[]]
        self._group_page_bytes[group] = sum(device_pool.layout.planes[p].page_bytes
                                            for ps in self._group_planes[group] for p in ps)

    def _pools(self, group: int) -> tuple[DevicePool, HostPool, object]:
        if group == FULL:
            return self.device_pool, self.host_pool, self.storage
        return self._groups[group]

    # ----------------------------------------------------------------- L1 <-> L2
    def _idx(self, pages: Sequence[int]) -> torch.Tensor:
        return torch.as_tensor(list(pages), dtype=torch.int64, device=self.device_pool.device)

    def _keep_for_copy(self, *idx: torch.Tensor) -> None:
        """The index tensors are allocated on the caller's stream and read by copies on
        ours: without this, the caller's next allocations may reuse their memory while
        a copy still reads it (the engine's forward runs while a layer-wise load copies)."""
        for t in idx:
            t.record_stream(self._stream)

    def backup(self, device_pages: Sequence[int], host_pages: Sequence[int], group: int = FULL) -> Transfer:
        """Copy L1 pages to L2 (all planes) in ``group``'s pools. The caller holds both sets of pages."""
        _same_len(device_pages, host_pages)
        dev_pool, host_pool, _ = self._pools(group)
        t = self._new(_D2H)
        t.pages = len(device_pages)
        nbytes = len(device_pages) * dev_pool.layout.page_bytes
        src, dst = self._idx(device_pages), self._idx(host_pages)
        if self.on_gpu:
            self._stream.wait_stream(torch.cuda.current_stream())  # rows written by the engine
            self._keep_for_copy(src, dst)
            with torch.cuda.stream(self._stream):
                _copy_pages(dev_pool, host_pool, src, dst)
                t.cuda_event = torch.cuda.Event()
                t.cuda_event.record(self._stream)
        else:
            def job():
                try:
                    _copy_pages(dev_pool, host_pool, src, dst)
                except BaseException as e:  # surfaced to the caller at poll()
                    t.error = e
                t.ready_flag.set()
            self._copy_q.put(job)
        self.bytes_moved[_D2H] += nbytes
        self._pending.append(t)
        return t

    def load_back(self, host_pages: Sequence[int], device_pages: Sequence[int], group: int = FULL) -> LoadHandle:
        """Copy L2 pages into L1 layer by layer (``group``'s pools and layers); returns a ``LoadHandle``."""
        _same_len(device_pages, host_pages)
        dev_pool, host_pool, _ = self._pools(group)
        plane_groups = self._plane_groups if group == FULL else self._group_planes[group]
        t = self._new(_H2D)
        t.pages = len(device_pages)
        h = LoadHandle(t, len(plane_groups) - 1, self.on_gpu)
        graph = self._load_graph(group) if self.on_gpu and host_pages else None
        if self.on_gpu:
            self._stream.wait_stream(torch.cuda.current_stream())
            t.timing = self._timing_free.pop() if self._timing_free else (
                torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            t.timing[0].record(self._stream)
        if graph is not None:  # one replay: every layer's copy and its completion (flag or event)
            for i, ev in enumerate(graph.launch(host_pages, device_pages, self._stream)):
                h.layer_launched(i, ev)
            t.cuda_event = torch.cuda.Event()
            t.cuda_event.record(self._stream)
        elif self.on_gpu:
            src, dst = self._idx(host_pages), self._idx(device_pages)
            self._keep_for_copy(src, dst)
            with torch.cuda.stream(self._stream):
                for i, planes in enumerate(plane_groups):
                    if planes:
                        _copy_pages(host_pool, dev_pool, src, dst, planes=planes)
                    ev = torch.cuda.Event()
                    ev.record(self._stream)
                    h.layer_launched(i, ev)
                t.cuda_event = ev
        else:
            src, dst = self._idx(host_pages), self._idx(device_pages)

            def job():
                t0 = time.perf_counter()
                try:
                    for i, planes in enumerate(plane_groups):
                        if planes:
                            _copy_pages(host_pool, dev_pool, src, dst, planes=planes)
                        h.layer_launched(i)
                except BaseException as e:
                    t.error = e
                    h.release_all()
                t.seconds = time.perf_counter() - t0
                t.ready_flag.set()
            self._copy_q.put(job)
        if t.timing is not None:
            t.timing[1].record(self._stream)
        per_page = dev_pool.layout.page_bytes if group == FULL else self._group_page_bytes[group]
        self.bytes_moved[_H2D] += len(host_pages) * per_page
        self._pending.append(t)
        return h

    def check_integrity(self) -> None:
        """Worker threads alive until closed; the captured load back's completion
        flags and counters (synchronises its GPU)."""
        if not self._closed:
            dead = [th.name for th in self._threads if not th.is_alive()]
            if dead:
                raise IntegrityError(f"transfer workers {dead} ended before close(); their queued jobs never run")
        for g in (self._graph, *self._group_graphs.values()):
            if g is not None:
                g.check_integrity()

    def _load_graph(self, group: int = FULL):
        """The captured load back for ``group``'s pools (None: graphs off or capture failed)."""
        if not self._graphs:
            return None
        if group == FULL:
            g, host, dev, planes = self._graph, self.host_pool, self.device_pool, self._plane_groups
        else:
            (dev, host, _), planes = self._groups[group], self._group_planes[group]
            g = self._group_graphs.get(group)
        if g is None or g.host is not host:  # first use, or a new host pool (service reconnect)
            from hicache.transfer.load_graph import LoadGraph
            try:
                g = LoadGraph(host, dev, planes)
            except Exception as e:  # an older CUDA/torch without external graph events: launch per layer
                log.warning("layer-wise load back: CUDA-graph capture failed (%s: %s); launching per layer",
                            type(e).__name__, e)
                self._graphs, self._graph = False, None
                self._group_graphs.clear()
                return None
            if group == FULL:
                self._graph = g
            else:
                self._group_graphs[group] = g
        return g

    # ----------------------------------------------------------------- L2 <-> L3
    def _need_storage(self, storage=None) -> None:
        if storage is None:
            raise TransferError("an L3 job was submitted to a transfer engine without a storage backend")

    def storage_put(self, host_pages: Sequence[int], hashes: Sequence[bytes], group: int = FULL) -> Transfer:
        """Write L2 pages to L3 (``group``'s). ``result`` = number stored. Caller host-locks the pages."""
        _, host_pool, storage = self._pools(group)
        self._need_storage(storage)
        _same_len(host_pages, hashes)
        t = self._new(_L3_PUT)
        sizes = [p.page_bytes for p in host_pool.layout.planes]

        def job():
            try:
                items = [(k, host_pool.read_page(p), sizes) for k, p in zip(hashes, host_pages)]
                t.result = storage.put(items)
            except BaseException as e:
                t.error = e
            t.ready_flag.set()
        self._io_q.put(job)
        self.bytes_moved[_L3_PUT] += len(host_pages) * host_pool.layout.page_bytes
        self._pending.append(t)
        return t

    def storage_get(self, hashes: Sequence[bytes], host_pages: Sequence[int], group: int = FULL) -> Transfer:
        """Read pages from L3 into L2 (``group``'s). ``result`` = number of leading pages loaded
        (a miss or corrupt object stops the prefix there)."""
        _, host_pool, storage = self._pools(group)
        self._need_storage(storage)
        _same_len(host_pages, hashes)
        t = self._new(_L3_GET)
        t.pages = len(hashes)  # asked for (queued_bytes); the result says how many came
        sizes = [p.page_bytes for p in host_pool.layout.planes]

        def job():
            n = 0
            t0 = time.perf_counter()
            try:
                # Straight into the L2 pages, verified as they land (no copy on a DIRECT_IO
                # store), on this thread where the store can. Pages past a miss may hold
                # garbage: the plan frees them, and nothing reads into them after this returns.
                got = storage.get_into_settled(list(hashes), sizes, [host_pool.page_buffers(p) for p in host_pages])
                while n < len(got) and got[n]:
                    n += 1
            except BaseException as e:
                t.error = e
            t.result = n
            t.seconds = time.perf_counter() - t0
            self.bytes_moved[_L3_GET] += n * host_pool.layout.page_bytes
            t.ready_flag.set()
        self._io_q.put(job)
        self._pending.append(t)
        return t

    def storage_probe(self, hashes: Sequence[bytes], budget_s: float | None = None) -> int:
        """Leading pages L3 holds (synchronous; 0 when L3 does not answer within ``budget_s``)."""
        if self.storage is None or not hashes:
            return 0
        return self.storage.prefix_hits(list(hashes), budget_s)

    # ---------------------------------------------------------------- plans
    def submit(self, plan: Movable) -> JobId:
        """Start the job ``plan`` describes (the mover of its route); returns its id (see
        ``finished``). The caller keeps the plan's pages pinned until the result is reported."""
        mover = MOVERS.get(plan.route)
        if mover is None:
            raise TypeError(f"cannot submit {type(plan).__name__}: no mover from {plan.route[0].value} to "
                            f"{plan.route[1].value}; registered: "
                            f"{', '.join(f'{a.value}->{b.value}' for a, b in MOVERS)}")
        return mover(self, plan).job

    def _move_load(self, plan: PageCopy) -> Transfer:
        h = self.load_back(plan.host, plan.device, plan.group)
        self._handles[h.transfer.job] = h
        return h.transfer

    def load_handle(self, job: JobId) -> "LoadHandle":
        """The layer-wise handle of a submitted L2 -> L1 plan (valid until reported finished)."""
        return self._handles[job]

    # ------------------------------------------------------------- completion
    def _new(self, kind: TransferKind) -> Transfer:
        self._next_job += 1
        t = Transfer(kind, JobId(self._next_job))
        self._jobs[t.job] = t
        return t

    def finished(self, job: JobId | None = None) -> list[TransferResult]:
        """Results of jobs done since the last call, in submission order; never blocks.
        ``job``: only that job's result, if it is done (the others stay to be reported)."""
        done, still = [], []
        for t in self._pending:
            (done if (job is None or t.job == job) and t.ready() else still).append(t)
        self._pending = still
        out = []
        for t in done:
            del self._jobs[t.job]
            self._handles.pop(t.job, None)
            if t.error is not None:
                log.warning("transfer %s failed: %s", t.kind, t.error)
            pages = t.result if t.result is not None else t.pages
            if t.timing is not None and t.timing[1].query():  # (recorded just after the job's own event)
                t.seconds = t.timing[0].elapsed_time(t.timing[1]) / 1e3
                if len(self._timing_free) < 64:  # read: both events may be recorded again
                    self._timing_free.append(t.timing)
                t.timing = None
            out.append(TransferResult(t.job, t.kind, pages, t.error, t.seconds))
        return out

    def queued_bytes(self) -> dict[str, int]:
        """Bytes submitted and not yet done per link: ``"L2"`` (L2 -> L1 load backs)
        and ``"L3"`` (L3 -> L2 prefetches), for the admission's cost model."""
        pb = self.host_pool.layout.page_bytes
        q = {"L2": 0, "L3": 0}
        for t in self._pending:
            if t.kind in (_H2D, _L3_GET) and not t.ready():
                q["L2" if t.kind is _H2D else "L3"] += t.pages * pb
        return q

    def wait(self, job: int, timeout: float | None = None) -> bool:
        """Block until job ``job`` is done (not reported: call ``finished``); False
        on timeout. A job already reported counts as done."""
        t = self._jobs.get(job)
        if t is None:
            return True
        if t.cuda_event is not None:
            t.cuda_event.synchronize()
            return True
        return t.ready_flag.wait(timeout)

    def wait_all(self) -> None:
        """Block until every submitted job is done (still to be reported by ``finished``)."""
        for job in list(self._jobs):
            self.wait(job)

    def close(self) -> None:
        """Wait for every job, then stop the worker threads (unreported results are dropped)."""
        self.wait_all()
        self._closed = True
        atexit.unregister(self._exit_hook)
        self._stop_workers(timeout=5)


def _move_backup(tc: TransferController, plan: PageCopy) -> Transfer:
    return tc.backup(plan.device, plan.host, plan.group)


def _move_store(tc: TransferController, plan: PageIo) -> Transfer:
    return tc.storage_put(plan.host, plan.hashes, plan.group)


def _move_prefetch(tc: TransferController, plan: PageIo) -> Transfer:
    return tc.storage_get(plan.hashes, plan.host, plan.group)


# One mover per (source, destination) medium: a new tier adds its movers here (and its
# plans a route), not a branch in ``submit``.
MOVERS: dict[Route, Callable[[TransferController, Any], Transfer]] = {
    L1_TO_L2: _move_backup,  # backup
    L2_TO_L1: TransferController._move_load,  # load back, layer by layer (a LoadHandle)
    L2_TO_L3: _move_store,  # store
    L3_TO_L2: _move_prefetch,  # prefetch
}
