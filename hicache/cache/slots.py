"""Owned metadata slots: per-request speculative metadata that outlives a transfer.

A prefill hands its decode side, besides KV pages, a little per-request
metadata: the first output token, the draft's top-k ids and probabilities,
and the target hidden-state row the draft head continues from. It lives in a
pool of preallocated slots (tensors allocated once, reused).
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import NamedTuple

import torch

from hicache.core.errors import CacheStateError, IntegrityError, SlotsExhausted, StaleSlot


class SlotView(NamedTuple):
    """A request's claim on one slot. Valid until that slot is consumed or released."""

    index: int  # slot index in the pool
    generation: int  # the slot's generation at acquisition
    owner: str  # request id that owns it


class SlotData(NamedTuple):
    """What a slot holds; fresh tensors (copies), valid as long as the caller keeps them."""

    first_token: int
    topk_ids: torch.Tensor  # [top_k] int64: draft proposals after the first token
    topk_probs: torch.Tensor  # [top_k] float32: their probabilities
    hidden: torch.Tensor  # [hidden_size]: target hidden row of the last prompt token


@dataclass(slots=True)
class SlotStats:
    acquired: int = 0
    consumed: int = 0
    released: int = 0  # aborts
    exhausted: int = 0  # acquire calls that found no free slot (waited or failed)
    stale: int = 0  # reads/writes refused through a stale view


@dataclass(slots=True)
class _Slot:
    generation: int = 0  # bumps on every release/consume
    owner: str | None = None  # None = free
    written: bool = False  # the producer has filled it since acquisition


class MetaSlotPool:
    """``num_slots`` reusable slots of ``top_k`` proposals and a ``hidden_size`` row.

    The contract (DESIGN.md "Handoff"): a slot is **owned** by one request from
    ``acquire`` until its consumer has read it (``consume``) or the request is
    aborted (``release``). It is never recycled while owned: when every slot is
    owned, ``acquire`` back-pressures (waits up to ``timeout``, then raises
    ``SlotsExhausted``) instead of handing out a slot somebody still needs. Every
    slot carries a generation that bumps on release; a ``SlotView`` remembers the
    generation it was acquired at, so a read or write through a view whose slot
    has moved on raises ``StaleSlot`` instead of serving another request's data.

    Thread-safe: transfers complete on worker threads, so every method takes the
    pool's lock (the tensors are small; copies happen under it).
    """

    def __init__(self, num_slots: int, top_k: int, hidden_size: int, *,
                 hidden_dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
        if num_slots < 1 or top_k < 1 or hidden_size < 1:
            raise ValueError(f"MetaSlotPool needs num_slots, top_k, hidden_size >= 1, got "
                             f"{num_slots}, {top_k}, {hidden_size}")
        self.num_slots, self.top_k, self.hidden_size = num_slots, top_k, hidden_size
        dev = torch.device(device)
        self.first_token = torch.zeros(num_slots, dtype=torch.int64, device=dev)
        self.topk_ids = torch.zeros((num_slots, top_k), dtype=torch.int64, device=dev)
        self.topk_probs = torch.zeros((num_slots, top_k), dtype=torch.float32, device=dev)
        self.hidden = torch.zeros((num_slots, hidden_size), dtype=hidden_dtype, device=dev)
        self._slots = [_Slot() for _ in range(num_slots)]
        self._free = list(range(num_slots - 1, -1, -1))  # stack: lowest index first
        self._cv = threading.Condition()
        self.stats = SlotStats()

    # ----------------------------------------------------------- ownership
    def try_acquire(self, owner: str) -> SlotView | None:
        """A free slot for ``owner``, or None when every slot is owned. Mutates the pool."""
        with self._cv:
            return self._take(owner)

    def acquire(self, owner: str, timeout: float | None = 0.0) -> SlotView:
        """A free slot for ``owner``; waits up to ``timeout`` seconds (None: forever) for
        a consumer or an abort to free one. Raises ``SlotsExhausted`` on timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cv:
            view = self._take(owner)
            while view is None:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise SlotsExhausted(
                        f"all {self.num_slots} metadata slots are owned (owners: "
                        f"{sorted(s.owner for s in self._slots if s.owner)[:8]}...) and none was "
                        f"consumed within {timeout}s; consume or abort requests, or raise num_slots")
                self._cv.wait(left)
                view = self._take(owner)
            return view

    def _take(self, owner: str) -> SlotView | None:
        if not self._free:
            self.stats.exhausted += 1
            return None
        i = self._free.pop()
        s = self._slots[i]
        assert s.owner is None and not s.written, f"free list holds slot {i} that is in use: {s}"
        s.owner = owner
        self.stats.acquired += 1
        return SlotView(i, s.generation, owner)

    def release(self, view: SlotView) -> None:
        """Abort: give the slot back unread. Raises ``StaleSlot`` if ``view`` is stale."""
        with self._cv:
            self._check(view, "release")
            self._free_slot(view.index)
            self.stats.released += 1

    def _free_slot(self, i: int) -> None:
        s = self._slots[i]
        s.generation += 1
        s.owner, s.written = None, False
        self._free.append(i)
        self._cv.notify()

    def _check(self, view: SlotView, op: str) -> _Slot:
        if not 0 <= view.index < self.num_slots:
            raise StaleSlot(f"{op}: slot {view.index} is not in this pool of {self.num_slots}")
        s = self._slots[view.index]
        if s.generation != view.generation or s.owner != view.owner:
            self.stats.stale += 1
            raise StaleSlot(f"{op}: view of slot {view.index} for {view.owner!r} at generation "
                            f"{view.generation}, the slot is at generation {s.generation} owned by "
                            f"{s.owner!r}; it was consumed or released already")
        return s

    # ---------------------------------------------------------------- data
    def write(self, view: SlotView, first_token: int, topk_ids: torch.Tensor, topk_probs: torch.Tensor,
              hidden: torch.Tensor) -> None:
        """Producer: fill the slot (copies). Raises ``StaleSlot`` through a stale view."""
        k, h = self.top_k, self.hidden_size
        if topk_ids.numel() != k or topk_probs.numel() != k or hidden.numel() != h:
            raise ValueError(f"slot write needs {k} top-k ids/probs and a hidden row of {h}, got "
                             f"{topk_ids.numel()}, {topk_probs.numel()}, {hidden.numel()}")
        with self._cv:
            s = self._check(view, "write")
            i = view.index
            self.first_token[i] = int(first_token)
            self.topk_ids[i].copy_(topk_ids.reshape(-1))
            self.topk_probs[i].copy_(topk_probs.reshape(-1))
            self.hidden[i].copy_(hidden.reshape(-1))
            s.written = True

    def read(self, view: SlotView) -> SlotData:
        """Copy the slot's data without releasing it. Raises ``StaleSlot`` through a
        stale view and ``CacheStateError`` before the producer wrote it."""
        with self._cv:
            return self._read(view, "read")

    def consume(self, view: SlotView) -> SlotData:
        """Consumer: read the slot, then free it (its generation moves on)."""
        with self._cv:
            data = self._read(view, "consume")
            self._free_slot(view.index)
            self.stats.consumed += 1
            return data

    def _read(self, view: SlotView, op: str) -> SlotData:
        s = self._check(view, op)
        if not s.written:
            raise CacheStateError(f"{op}: slot {view.index} of {view.owner!r} was acquired but not "
                                  "written yet; wait for the producer")
        i = view.index
        return SlotData(int(self.first_token[i]), self.topk_ids[i].clone(), self.topk_probs[i].clone(),
                        self.hidden[i].clone())

    # -------------------------------------------------------------- status
    @property
    def num_free(self) -> int:
        with self._cv:
            return len(self._free)

    def owners(self) -> dict[int, str]:
        """Slot index -> owner for every owned slot (a snapshot)."""
        with self._cv:
            return {i: s.owner for i, s in enumerate(self._slots) if s.owner is not None}

    def check_integrity(self) -> None:
        """Free list and ownership agree; every slot is free xor owned, none twice."""
        with self._cv:
            free = set(self._free)
            if len(free) != len(self._free):
                raise IntegrityError(f"slot free list repeats a slot: {self._free}")
            for i, s in enumerate(self._slots):
                if (i in free) == (s.owner is not None):
                    raise IntegrityError(f"slot {i}: owner={s.owner!r} but in free list={i in free}")
                if s.owner is None and s.written:
                    raise IntegrityError(f"slot {i}: free but marked written")
            st = self.stats
            if st.acquired - st.consumed - st.released != self.num_slots - len(free):
                raise IntegrityError(f"slot counters acquired={st.acquired} consumed={st.consumed} "
                                     f"released={st.released} disagree with "
                                     f"{self.num_slots - len(free)} owned slots")
