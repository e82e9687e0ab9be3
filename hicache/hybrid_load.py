"""Layer-wise load back of a hybrid layout, waited on per group.

A ``HybridLoader`` runs each layer group's copies (``hybrid_copy.GroupCopy``)
on a lane of its own: a CUDA stream per group on a GPU, a worker thread per
group on the CPU. Inside a lane the group's layers copy in order with a
completion (``torch.cuda.Event`` / ``threading.Event``) after each, so:

* ``wait_layer(i)`` waits for KV layer ``i``'s copy and the earlier layers *of
  its own group* only: a full-attention layer never waits for the SWA window or
  the state snapshot, an SWA layer never for the full pages (which are most of
  the bytes), and the first layer of every group can start at once;
* ``wait_state()`` waits for the snapshot copy alone.

On a GPU the waits are device-side (``stream.wait_event``): the host never
blocks, as with ``transfer.LoadHandle``. Each load is one kernel launch per
layer (no CUDA graph: the groups move different page lists, and a graph
per pool pair and group set is not captured yet).
"""
from __future__ import annotations

import queue
import threading
from typing import Callable

import torch

from hicache.errors import IntegrityError, InvalidArgument, TransferError
from hicache.hybrid_copy import GroupCopy, HybridCopyPlan, Pool, _pools
from hicache.kernels.page_copy import PageCopier, default_copier
from hicache.layout import KVLayout
from hicache.pools import DevicePool


class HybridLoadHandle:
    """One hybrid load back, waited on per layer with the wait confined to the layer's group.

    Valid until every group is done and the caller dropped it; waiting after that
    returns at once. ``wait_*`` raise ``TransferError`` (CPU) when the group's copy failed.
    """

    def __init__(self, layout: KVLayout, plan: HybridCopyPlan, on_gpu: bool):
        self.plan = plan
        self.on_gpu = on_gpu
        self._step_of: dict[int, tuple[int, int]] = {}  # KV layer -> (group, step)
        self._state_group: int | None = None
        self.events: list[list] = []  # [group][step]: what completes after that step
        for c in plan.copies:
            if c.kind == "state":
                self._state_group = c.group
            for k, layer in enumerate(c.layers):
                if c.kind != "state" and layer >= 0:
                    self._step_of[layer] = (c.group, k)
            self.events.append([None if on_gpu else threading.Event() for _ in c.steps])
        self.errors: list[BaseException | None] = [None] * len(plan.copies)
        missing = set(range(layout.num_layers)) - set(self._step_of)
        if missing:
            raise InvalidArgument(f"layers {sorted(missing)} belong to no group of the plan; "
                                  f"plan_load covers every layer of the layout (its groups: "
                                  f"{[g.kind for g in layout.groups]})")

    # ------------------------------------------------------------ the engine's side
    def wait_layer(self, i: int) -> None:
        """KV layer ``i`` (and its group's earlier layers) is in place: on a GPU the current
        stream waits for it; on the CPU the host blocks until it is."""
        if i not in self._step_of:
            raise IndexError(f"layer {i} out of range [0, {len(self._step_of)})")
        self._wait(*self._step_of[i])

    def wait_state(self) -> None:
        """The state snapshot is in place (no-op for a layout without a state group)."""
        if self._state_group is not None:
            self._wait(self._state_group, 0)

    def wait_group(self, g: int) -> None:
        """Every copy of group ``g`` (draft planes included for the full group) is in place."""
        self._wait(g, len(self.events[g]) - 1)

    def wait(self) -> None:
        for g in range(len(self.events)):
            self.wait_group(g)

    def layer_ready(self, i: int) -> bool:
        g, k = self._step_of[i]
        return self._ready(g, k)

    def group_ready(self, g: int) -> bool:
        return self._ready(g, len(self.events[g]) - 1)

    def done(self) -> bool:
        return all(self.group_ready(g) for g in range(len(self.events)))

    # ------------------------------------------------------------ internals
    def _ready(self, g: int, k: int) -> bool:
        ev = self.events[g][k]
        return ev.query() if self.on_gpu else ev.is_set()

    def _wait(self, g: int, k: int) -> None:
        ev = self.events[g][k]
        if self.on_gpu:
            torch.cuda.current_stream().wait_event(ev)
            return
        ev.wait()
        if self.errors[g] is not None:
            raise TransferError(f"hybrid load back: group {g} ({self.plan.copies[g].kind}) failed: "
                                f"{self.errors[g]!r}") from self.errors[g]


class HybridLoader:
    """Runs hybrid load backs from ``kv_src``/``state_src`` into ``kv_dst``/``state_dst``,
    one lane (CUDA stream or worker thread) per layer group of ``kv_dst.layout``.

    ``close()`` ends the CPU worker threads after the copies queued before it.
    """

    def __init__(self, kv_src: Pool, kv_dst: Pool, state_src: Pool | None = None, state_dst: Pool | None = None,
                 *, copier: PageCopier | None = None):
        self.layout = kv_dst.layout
        if not self.layout.groups:
            raise InvalidArgument(f"layout {self.layout.model_id!r} has no layer groups; use TransferController")
        self.kv_src, self.kv_dst, self.state_src, self.state_dst = kv_src, kv_dst, state_src, state_dst
        self.copier = copier or default_copier()
        dev = kv_dst.device if isinstance(kv_dst, DevicePool) else kv_dst.buffer.device
        self.on_gpu = dev.type == "cuda"
        n = len(self.layout.groups)
        self.streams = [torch.cuda.Stream(device=dev) for _ in range(n)] if self.on_gpu else []
        self._queues: list[queue.Queue] = [] if self.on_gpu else [queue.Queue() for _ in range(n)]
        self._threads = [threading.Thread(target=_lane, args=(q,), name=f"hicache-hybrid-load-{g}", daemon=True)
                         for g, q in enumerate(self._queues)]
        for t in self._threads:
            t.start()
        self._closed = False

    def load(self, plan: HybridCopyPlan) -> HybridLoadHandle:
        """Start every group's copies of ``plan`` (GPU: enqueued on the group's stream after
        the current stream's work; CPU: queued on the group's thread). Returns at once."""
        if self._closed:
            raise InvalidArgument("HybridLoader.load after close()")
        if len(plan.copies) != len(self.layout.groups):
            raise InvalidArgument(f"plan has {len(plan.copies)} group copies, the layout {len(self.layout.groups)} "
                                  "groups; build it with hybrid_copy.plan_load(layout, ...)")
        h = HybridLoadHandle(self.layout, plan, self.on_gpu)
        for c in plan.copies:
            src, dst = _pools(c, self.kv_src, self.kv_dst, self.state_src, self.state_dst) if c.src else (None, None)
            if self.on_gpu:
                self._enqueue_gpu(c, src, dst, h)
            else:
                self._queues[c.group].put(self._job(c, src, dst, h))
        return h

    def _enqueue_gpu(self, c: GroupCopy, src, dst, h: HybridLoadHandle) -> None:
        s = self.streams[c.group]
        # The ids go up on the caller's stream, never on ours: a group's stream may be busy
        # (or held) and an upload queued behind it must not hold the host.
        si = torch.as_tensor(c.src, dtype=torch.int64).to(s.device, non_blocking=True)
        di = torch.as_tensor(c.dst, dtype=torch.int64).to(s.device, non_blocking=True)
        if c.src:  # likewise the address tables a first copy of these planes builds (a blocking upload)
            for planes in c.steps:
                self.copier.plan(src, dst, planes)
        s.wait_stream(torch.cuda.current_stream())  # the destination pages are free, the ids uploaded
        with torch.cuda.stream(s):
            for k, planes in enumerate(c.steps):
                if c.src:
                    self.copier.copy_pages(src, dst, si, di, planes=planes)
                ev = torch.cuda.Event()
                ev.record(s)
                h.events[c.group][k] = ev
        si.record_stream(s)
        di.record_stream(s)

    def _job(self, c: GroupCopy, src, dst, h: HybridLoadHandle) -> Callable[[], None]:
        def job() -> None:
            try:
                for k, planes in enumerate(c.steps):
                    if c.src:
                        self.copier.copy_pages(src, dst, list(c.src), list(c.dst), planes=planes)
                    h.events[c.group][k].set()
            except BaseException as e:  # surfaced to every waiter of the group
                h.errors[c.group] = e
                for ev in h.events[c.group]:
                    ev.set()
        return job

    def check_integrity(self) -> None:
        """One lane per group, and every CPU lane alive until ``close()``."""
        n = len(self.layout.groups)
        if (len(self.streams) if self.on_gpu else len(self._threads)) != n:
            raise IntegrityError(f"hybrid loader: {len(self.streams) or len(self._threads)} lanes for {n} groups")
        dead = [t.name for t in self._threads if not t.is_alive()]
        if dead and not self._closed:
            raise IntegrityError(f"hybrid loader lanes {dead} ended before close(); their loads never run")

    def close(self) -> None:
        self._closed = True
        for q in self._queues:
            q.put(None)
        for t in self._threads:
            t.join(timeout=10)


def _lane(q: queue.Queue) -> None:
    while True:
        job = q.get()
        if job is None:
            return
        job()
