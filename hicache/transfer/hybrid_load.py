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
from typing import Callable, Mapping, Protocol, Sequence

import torch

from hicache.core.errors import CacheStateError, IntegrityError, InvalidArgument, TransferError
from hicache.transfer.hybrid_copy import GroupCopy, HybridCopyPlan, Pool
from hicache.kernels.page_copy import PageCopier, default_copier
from hicache.core.layout import KVLayout
from hicache.memory.pools import DevicePool


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

    def sync_group(self, g: int) -> None:
        """The host blocks until group ``g``'s copies are done (GPU too: its pages may then be
        freed or rewritten by the host). Raises nothing: a failure is ``failed(g)``'s."""
        ev = self.events[g][-1]
        if self.on_gpu:
            ev.synchronize()
        else:
            ev.wait()

    def failed(self, g: int) -> BaseException | None:
        """What group ``g``'s copy raised (CPU lanes), once it is done; None: it did not fail."""
        return self.errors[g]

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


class LayerWaits(Protocol):
    """A load waited on per layer (``hicache.cache.hicache.Admission``)."""

    def wait_layer(self, i: int) -> None: ...

    def wait(self) -> None: ...


class AdmissionWaits:
    """What one ``HybridCache`` admission waits for, confined per layer group.

    A full-attention layer waits on ``full`` (``HiCache``'s layer-wise load of the full
    groups, whose layer ``j`` is the ``j``-th full layer of the hybrid layout); a layer of
    another group only on that group's copies in ``loads[g]`` (this admission's own load
    and the loads of earlier admissions still bringing an item it reads); the snapshot
    only on the state group's. So a full layer never waits for an SWA window or a
    snapshot, nor an SWA layer for the full pages. ``state_row``: the L1 row of the
    snapshot at the floor (``[layers, state_bytes]`` uint8), read by ``snapshot()``
    until ``release_state()`` (the request gave the row back). Valid until the request
    ends or is admitted again; ``wait_*`` raise as ``HybridLoadHandle``'s and ``HiCache``'s."""

    def __init__(self, layout: KVLayout, full: LayerWaits, loads: Mapping[int, Sequence[HybridLoadHandle]],
                 state_row: torch.Tensor | None = None):
        self.full, self.loads, self.state_row = full, {g: tuple(hs) for g, hs in loads.items()}, state_row
        self._state_released = False
        fulls = sorted(i for g in layout.groups if g.kind == "full" for i in g.layers)
        self._full_index = {layer: j for j, layer in enumerate(fulls)}
        self._group_of = {i: gi for gi, g in enumerate(layout.groups) if g.kind != "state" for i in g.layers}
        self._state_gi = next((gi for gi, g in enumerate(layout.groups) if g.kind == "state"), None)

    def wait_layer(self, i: int) -> None:
        """KV layer ``i`` of the hybrid layout is on L1 (GPU: the current stream waits)."""
        j = self._full_index.get(i)
        if j is not None:
            self.full.wait_layer(j)
            return
        if i not in self._group_of:
            raise IndexError(f"layer {i} is in no attention group of the layout ({len(self._group_of)} "
                             f"non-full and {len(self._full_index)} full layers)")
        for h in self.loads.get(self._group_of[i], ()):
            h.wait_layer(i)

    def wait_state(self) -> None:
        """The snapshot at the floor is on L1 (no-op without one)."""
        for h in self.loads.get(self._state_gi, ()) if self._state_gi is not None else ():
            h.wait_state()

    def snapshot(self) -> torch.Tensor | None:
        """A copy of the snapshot at the floor, once it is on L1; None without one. Raises
        ``CacheStateError`` after ``release_state()``: the row may hold another snapshot."""
        if self._state_released:
            raise CacheStateError("the snapshot at the floor was given back when the request first advanced; "
                                  "read HybridAdmission.state before its first commit or advance")
        if self.state_row is None:
            return None
        self.wait_state()
        return self.state_row.clone()

    def release_state(self) -> None:
        """The request gave the snapshot's L1 row back (``snapshot()`` raises from now on)."""
        self._state_released = self.state_row is not None

    def group_ready(self, g: int) -> bool:
        """Every copy of non-full group ``g`` this admission waits for is done."""
        return all(h.group_ready(g) for h in self.loads.get(g, ()))

    def wait(self) -> None:
        self.full.wait()
        for g, hs in self.loads.items():
            for h in hs:
                h.wait_group(g)


class HybridLoader:
    """Runs hybrid load backs from ``kv_src``/``state_src`` into ``kv_dst``/``state_dst``,
    one lane (CUDA stream or worker thread) per layer group of ``kv_dst.layout``.

    ``close()`` ends the CPU worker threads after the copies queued before it.
    """

    def __init__(self, kv_src: Pool, kv_dst: Pool, state_src: Pool | None = None, state_dst: Pool | None = None,
                 *, copier: PageCopier | None = None):
        lay = kv_dst.layout
        pools = {gi: (state_src, state_dst) if g.kind == "state" else (kv_src, kv_dst)
                 for gi, g in enumerate(lay.groups)}
        self._start(lay, pools, kv_dst, copier)

    @classmethod
    def per_group(cls, layout: KVLayout, pools: Mapping[int, tuple[Pool, Pool]], *,
                  copier: PageCopier | None = None) -> "HybridLoader":
        """A loader whose groups each copy between pools of their own (``HybridCache``'s
        group stores: ``pools[g] = (L2 pool, L1 pool)`` of group ``g``, plans in their
        planes, see ``hybrid_copy.on_group_pools``). A group without pools (the full
        groups, which ``HiCache`` loads) may only be given empty copies."""
        if not pools:
            raise InvalidArgument(f"layout {layout.model_id!r}: no group has pools; nothing to load")
        self = cls.__new__(cls)
        self._start(layout, {g: pools.get(g, (None, None)) for g in range(len(layout.groups))},
                    next(iter(pools.values()))[1], copier)
        return self

    def _start(self, layout: KVLayout, pools: Mapping[int, tuple[Pool | None, Pool | None]], dst: Pool,
               copier: PageCopier | None) -> None:
        self.layout = layout
        if not self.layout.groups:
            raise InvalidArgument(f"layout {self.layout.model_id!r} has no layer groups; use TransferController")
        self.pools = dict(pools)
        self.copier = copier or default_copier()
        dev = dst.device if isinstance(dst, DevicePool) else dst.buffer.device
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
            src, dst = self._pools_of(c) if c.src else (None, None)
            if self.on_gpu:
                self._enqueue_gpu(c, src, dst, h)
            else:
                self._queues[c.group].put(self._job(c, src, dst, h))
        return h

    def _pools_of(self, c: GroupCopy) -> tuple[Pool, Pool]:
        src, dst = self.pools[c.group]
        if src is None or dst is None:
            what = "state_src and state_dst (pools over hybrid_copy.state_layout(layout))" if c.kind == "state" \
                else "its pools"
            raise InvalidArgument(f"the plan moves {len(c.src)} item(s) of group {c.group} ({c.kind}); pass {what}")
        return src, dst

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
