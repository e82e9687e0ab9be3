"""Worker half of an engine KV connector: runs a ``StepPlan`` on one rank (no engine imports).

The engine's paged KV tensors are this rank's L1 (a ``DevicePool`` over them,
page id == block id); its L2 is a host pool of its own heads (pinned when
CUDA is present); L3 is any hicache storage URL. Copies and L3 I/O run on the
transfer engine (``hicache.transfer.engine``: a CUDA stream with the page-copy
kernels, or a CPU thread). Per engine step (not thread-safe: one worker thread)::

    w.start(plan)                 # before the forward: saves, then loads
    w.wait_layer(i)               # in the forward, before attention of layer i (layer-wise loads)
    step = w.finish_step(ended)   # after it: what finished, failed blocks, JobReports

A load whose L3 part fails verification or is missing loads the pages before
it and reports every later block in ``load_errors``; a failed copy reports all
of its blocks. No block is ever reported loaded that does not hold the page.
"""
from __future__ import annotations

import dataclasses
import logging

from hicache.connector.plan import JobKind, JobReport, LoadSpec, SaveSpec, StepPlan, WorkerStep
from hicache.core.errors import CacheStateError, IntegrityError
from hicache.core.layout import KVLayout
from hicache.memory.pools import DevicePool, HostPool
from hicache.transfer.engine import LoadHandle, TransferController, TransferKind

log = logging.getLogger(__name__)


@dataclasses.dataclass(slots=True)
class _Load:
    spec: LoadSpec
    landed: int = 0  # leading pages of the L3 part verified into L2
    l3_seconds: float = 0.0
    handle: LoadHandle | None = None  # the L2 -> blocks copy, once started
    ok: bool = True


@dataclasses.dataclass(slots=True)
class _Save:
    spec: SaveSpec
    ok: bool = True
    copied: bool = False  # the blocks are no longer read


class ConnectorWorker:
    """One rank's mover (see the module docstring)."""

    def __init__(self, layout: KVLayout, host_pages: int, *, rank: int = 0, storage=None,
                 pin: bool | None = None, link=None):
        """``link``: the node service's segment (``ServiceHostTier``), mapped as this rank's
        L2 instead of a pool of ``host_pages`` of its own."""
        self.layout = layout
        self.rank = rank
        self.link = link
        self.host_pool = link.pool if link is not None else HostPool(layout, host_pages, pin=pin)
        self.storage = storage
        self.transfers: TransferController | None = None
        self._jobs: dict[int, _Load | _Save] = {}  # transfer job -> what it serves
        self._layerwise: list[_Load] = []  # this step's synchronous loads
        self._running: list[int] = []  # this step's saves of running requests (transfer jobs)
        self._after: list[SaveSpec] = []  # this step's saves of blocks its forward writes (after_forward)
        self._step = WorkerStep()
        self._unsent: set[str] = set()  # saved rids the engine has not yet said finished
        self._ended: set[str] = set()  # rids the engine said finished, not yet reported saved

    def register(self, device_pool: DevicePool) -> None:
        """Adopt the engine's KV tensors as L1 (once, before the first step)."""
        if self.transfers is not None:
            raise CacheStateError("ConnectorWorker.register: the engine's KV tensors are registered already")
        if device_pool.layout != self.layout:
            raise CacheStateError("ConnectorWorker.register: the KV tensors' layout differs from the "
                                  f"connector's: {device_pool.layout.diff(self.layout)}")
        self.transfers = TransferController(device_pool, self.host_pool, self.storage)

    @property
    def _tc(self) -> TransferController:
        if self.transfers is None:
            raise CacheStateError("ConnectorWorker used before register(device_pool)")
        return self.transfers

    # ------------------------------------------------------------- a step
    def start(self, plan: StepPlan) -> None:
        """Submit ``plan``'s saves (blocks -> L2), then its loads (L3 -> L2 -> blocks)."""
        for s in plan.saves:
            if s.after_forward:
                self._after.append(s)
            else:
                self._save(s)
        for spec in plan.loads:
            ld = _Load(spec)
            if spec.l3_host:
                if spec.layerwise:
                    raise CacheStateError(f"load job {spec.job}: an L3 part cannot load layer-wise")
                self._jobs[self._tc.storage_get(spec.l3_hashes, spec.l3_host).job] = ld
            else:
                self._start_copy(ld)
            if spec.layerwise:
                self._layerwise.append(ld)

    def _save(self, s: SaveSpec) -> None:
        job = self._tc.backup(s.blocks, s.host).job
        self._jobs[job] = _Save(s)
        if s.running:
            self._running.append(job)

    def _start_copy(self, ld: _Load) -> None:
        """L2 (the L2 part and the L3 pages that landed) -> the engine's blocks."""
        spec = ld.spec
        host = spec.host + spec.l3_host[:ld.landed]
        h = self._tc.load_back(host, spec.blocks[:len(host)])
        ld.handle = h
        self._jobs[h.transfer.job] = ld

    def wait_layer(self, layer: int) -> None:
        """Before attention of ``layer``: this step's layer-wise loads have it (a failed
        copy returns; its blocks are reported in ``load_errors``)."""
        for ld in self._layerwise:
            if ld.handle is not None and ld.ok:
                try:
                    ld.handle.wait_layer(layer)
                except Exception as e:  # the copy failed: the blocks are reported, the forward goes on
                    log.warning("hicache connector: layer-wise load of job %d failed: %s", ld.spec.job, e)
                    ld.ok = False

    def finish_step(self, ended: set[str] | frozenset[str] = frozenset()) -> WorkerStep:
        """After the step's forward: observe finished transfers (waiting only for this
        step's layer-wise loads) and return what to tell the engine and the scheduler.
        ``ended``: request ids the engine says finished this step."""
        tc = self._tc
        for s in self._after:  # the forward has written these blocks: copy them now
            self._save(s)
        self._after = []
        for ld in self._layerwise:
            if ld.handle is not None:
                tc.wait(ld.handle.transfer.job)
        for job in self._running:  # the engine may free a running request's blocks after this step
            tc.wait(job)
        self._layerwise, self._running = [], []
        self._ended |= set(ended)
        for r in tc.finished():
            obj = self._jobs.pop(r.job)
            if r.kind is TransferKind.H2D:
                self._load_done(obj, r.ok, r.seconds)
            elif r.kind is TransferKind.L3_GET:
                obj.landed, obj.l3_seconds = (r.pages if r.ok else 0), r.seconds
                self._start_copy(obj) if obj.spec.host or obj.landed else self._load_done(obj, True, 0.0)
            elif r.kind is TransferKind.D2H:
                self._save_done(obj, r.ok)
            else:  # L3_PUT
                self._report(JobKind.STORE, obj.spec.job, r.ok, r.pages if r.ok else 0)
        self._flush_sent()
        out, self._step = self._step, WorkerStep()
        return out

    def _load_done(self, ld: _Load, ok: bool, seconds: float) -> None:
        spec = ld.spec
        ok = ok and ld.ok
        good = len(spec.host) + ld.landed if ok else 0
        self._step.load_errors.update(spec.blocks[good:])
        if not spec.layerwise:
            self._step.finished_loads.add(spec.rid)
            if good < len(spec.blocks):
                self._step.failed_loads.add(spec.rid)
        self._step.reports.append(JobReport(spec.job, self.rank, JobKind.LOAD, ok, ld.landed if ok else 0,
                                            seconds, ld.l3_seconds, good * self.layout.page_bytes))

    def _save_done(self, sv: _Save, ok: bool) -> None:
        spec = sv.spec
        sv.ok, sv.copied = ok, True
        self._report(JobKind.SAVE, spec.job, ok)
        if not spec.running:  # the engine holds blocks for a final save only
            self._unsent.add(spec.rid)
        if spec.hashes:
            if ok:
                if spec.rows:  # a partial last page: only its tokens' rows travel, never padding
                    for i in range(len(self.layout.planes)):
                        self.host_pool.plane_page(i, spec.host[-1])[spec.rows:].zero_()
                self._jobs[self._tc.storage_put(spec.host, spec.hashes).job] = sv
            else:
                self._report(JobKind.STORE, spec.job, False, 0)

    def _flush_sent(self) -> None:
        """Saved rids go to the engine once it has named them finished (its contract)."""
        sent = self._unsent & self._ended
        self._step.finished_saves |= sent
        self._unsent -= sent
        self._ended -= sent

    def _report(self, kind: JobKind, job: int, ok: bool, pages: int = 0) -> None:
        self._step.reports.append(JobReport(job, self.rank, kind, ok, pages))

    # ------------------------------------------------------------- lifecycle
    @property
    def in_flight(self) -> int:
        return len(self._jobs) + len(self._after)

    def drain(self) -> WorkerStep:
        """Wait for every transfer (chained ones included) and return their outcome."""
        merged = WorkerStep()
        while True:
            if self.transfers is not None:
                self.transfers.wait_all()
            step = self.finish_step()
            merged.finished_loads |= step.finished_loads
            merged.finished_saves |= step.finished_saves
            merged.load_errors |= step.load_errors
            merged.failed_loads |= step.failed_loads
            merged.reports += step.reports
            if not self._jobs:
                return merged

    def check_integrity(self) -> None:
        self.host_pool.check_integrity()
        if self.transfers is not None:
            self.transfers.check_integrity()
            self.transfers.device_pool.check_integrity()
        if self._unsent & self._ended:
            raise IntegrityError(f"saved requests {sorted(self._unsent & self._ended)} not reported")

    def close(self) -> None:
        if self.transfers is not None:
            self.drain()
            self.transfers.close()
        if self.storage is not None:
            self.storage.close()
        if self.link is not None:
            self.link.close()


class GroupWorkers:
    """One rank's movers for an engine with several KV cache groups: a ``ConnectorWorker``
    per group (its layers' blocks, its own L2), each running the specs of its group. A
    request's load or save is reported to the engine once every group's part finished."""

    def __init__(self, workers: dict[int, ConnectorWorker]):
        """``workers``: the engine's group index -> that group's worker."""
        self.workers = workers
        self._loads: dict[str, set[int]] = {}  # rid -> groups whose asynchronous load has not finished
        self._saves: dict[str, set[int]] = {}  # rid -> groups whose save has not been reported sent
        self._failed: set[str] = set()  # rids whose load failed in some group, until every group's ended

    def start(self, plan: StepPlan) -> None:
        for g, w in self.workers.items():
            w.start(StepPlan(tuple(s for s in plan.loads if s.group == g), tuple(s for s in plan.saves if s.group == g)))
        for s in plan.loads:
            if not s.layerwise:
                self._loads.setdefault(s.rid, set()).add(s.group)
        for s in plan.saves:
            if not s.running:  # a running save is never reported finished: nothing to wait for
                self._saves.setdefault(s.rid, set()).add(s.group)
        unknown = {s.group for s in (*plan.loads, *plan.saves)} - self.workers.keys()
        if unknown:
            raise CacheStateError(f"a plan for KV cache groups {sorted(unknown)}; this rank has {sorted(self.workers)}")

    def wait_layer(self, group: int, layer: int) -> None:
        """Before attention of ``layer`` (the group's own numbering) of ``group``."""
        self.workers[group].wait_layer(layer)

    def finish_step(self, ended: set[str] | frozenset[str] = frozenset()) -> WorkerStep:
        out = WorkerStep()
        for g, w in self.workers.items():
            step = w.finish_step(ended)
            out.load_errors |= step.load_errors
            out.reports += step.reports
            self._failed |= step.failed_loads
            out.finished_loads |= self._settle(self._loads, step.finished_loads, g)
            out.finished_saves |= self._settle(self._saves, step.finished_saves, g)
        out.failed_loads = self._failed & out.finished_loads  # failed in any group, told once all ended
        self._failed -= out.failed_loads
        return out

    @staticmethod
    def _settle(pending: dict[str, set[int]], done: set[str], group: int) -> set[str]:
        """Requests whose last pending group just finished."""
        out = set()
        for rid in done:
            left = pending.get(rid)
            if left is None:
                continue
            left.discard(group)
            if not left:
                del pending[rid]
                out.add(rid)
        return out

    @property
    def in_flight(self) -> int:
        return sum(w.in_flight for w in self.workers.values())

    def check_integrity(self) -> None:
        for w in self.workers.values():
            w.check_integrity()

    def close(self) -> None:
        for w in self.workers.values():
            w.close()
