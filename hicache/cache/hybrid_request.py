"""``HybridRequest``: one request over every layer group of a hybrid layout.

The full groups' pages are the inner ``Request``'s (``HiCache``'s); each SWA
group has a page table of the request's own, and the state group's snapshot
it resumes from is pinned from admission to its first ``advance``. Its
``HybridCache`` calls ``take`` / ``reads`` / ``prepare`` / ``release_swa`` at
admission and ``keep_window`` when it records a boundary; the engine calls the
rest.
"""
from __future__ import annotations

from typing import Any

import torch

from hicache.core.errors import IntegrityError
from hicache.tiers.groups import GroupTiers
from hicache.core.hashing import page_hashes
from hicache.index.request import Request, RequestState, Tokens
from hicache.core.types import DevicePageId, PageHash



class HybridRequest:
    """One request over every group: ``inner`` is the full groups' ``HiCache`` request; each
    SWA group has a page table of this request's own (logical page -> L1 id, and the item's
    hash when the id is a store item it pins rather than a private page). Every method may
    mutate the cache."""

    def __init__(self, owner: Any, inner: Request):
        """``owner``: the ``HybridCache`` that made it (which imports this module)."""
        self.owner, self.inner = owner, inner
        self.rid = inner.rid
        self.resume = 0
        self.fork = 0  # pages: the full hit this admission's floor fell short of (recorded once reached)
        # SWA group -> logical page -> (L1 id, the store item's hash; None: a private page)
        self.swa: dict[int, dict[int, tuple[DevicePageId, PageHash | None]]] = {
            gi: {} for gi, g in enumerate(owner.groups) if g.kind == "swa"}
        self._state_item: tuple[PageHash, DevicePageId] | None = None  # the snapshot it pins (and its L1 row)
        self._waits: Any = None  # the last HybridAdmission (its snapshot row is given back here)
        self._hashes: list[PageHash] = []

    @property
    def computed_tokens(self) -> int:
        return self.inner.computed_tokens

    @property
    def num_tokens(self) -> int:
        return self.inner.num_tokens

    @property
    def tokens(self) -> list[int]:
        return self.inner.tokens

    def hashes(self, num_pages: int) -> list[PageHash]:
        """Chained hashes of the first ``num_pages`` pages of this request's tokens."""
        if len(self._hashes) < num_pages:
            ps = self.owner.ps
            self._hashes = page_hashes(self.inner.tokens[:num_pages * ps], ps, self.inner.namespace)
        return self._hashes[:num_pages]

    def extend(self, tokens: Tokens) -> None:
        self.inner.extend(tokens)

    @property
    def state_item(self) -> tuple[PageHash, DevicePageId] | None:
        """The snapshot this request pins since its admission (its hash, its L1 row); None: none."""
        return self._state_item

    # ------------------------------------------------------------ admission (the owner's calls)
    def take(self, hashes: list[PageHash], b: int) -> tuple[int, int] | None:
        """Take (pin on L1; a copy from L2 is listed as pending) what resuming at boundary ``b``
        reads: the SWA windows and the snapshot. On a miss undo that and return ``(group,
        page)`` of the item that failed."""
        o, ps = self.owner, self.owner.ps
        self._release_state()
        for gi, table in self.swa.items():
            lo = max(0, b * ps - o.groups[gi].window + 1) // ps
            for p in range(lo, b):
                if p in table:
                    continue  # a kept private tail page never sits below b; a pinned one is kept
                dev = o.stores[gi].take(hashes[p])
                if dev is None:
                    self.release_swa(pinned_only=True)
                    return gi, p
                table[p] = (dev, hashes[p])
        if o.state_gi is not None and b:
            st = o.stores[o.state_gi]
            dev = st.take(hashes[b - 1])
            if dev is None:
                self.release_swa(pinned_only=True)
                return o.state_gi, b - 1
            self._state_item = (hashes[b - 1], dev)
        return None

    def reads(self) -> dict[int, dict[PageHash, DevicePageId]]:
        """Per group store: the items this request pins (its SWA window, its snapshot)."""
        out: dict[int, dict[PageHash, DevicePageId]] = {gi: {} for gi in self.owner.stores}
        for gi, table in self.swa.items():
            out[gi].update({h: dev for dev, h in table.values() if h is not None})
        if self._state_item is not None and self.owner.state_gi is not None:
            out[self.owner.state_gi][self._state_item[0]] = self._state_item[1]
        return out

    def _release_state(self) -> None:
        """Unpin the snapshot it read (kept from admission until its first advance: the engine
        reads it first; the load's own pin holds it while the copy runs)."""
        if self._state_item is not None and self.owner.state_gi is not None:
            self.owner.stores[self.owner.state_gi].unpin(self._state_item[0])
            if self._waits is not None:
                self._waits.release_state()
        self._state_item = None

    def prepare(self, b: int, exact: int, waits: Any) -> None:
        """Keep ``waits`` (this admission's: its snapshot row is given back at the first
        ``advance``), then private SWA pages for ``[b, ceil(exact / page_size))`` (the
        replayed span), keeping a private tail page this request kept through a preemption."""
        self._waits = waits
        ps = self.owner.ps
        for gi, table in self.swa.items():
            for p in [p for p in table if p >= -(-exact // ps)]:
                self._drop_page(gi, p)
            want = [p for p in range(b, -(-exact // ps)) if p not in table]
            for p, dev in zip(want, self.owner.stores[gi].alloc(len(want))):
                table[p] = (dev, None)

    # ------------------------------------------------------------ compute
    def alloc(self, num_tokens: int) -> None:
        """Slots for the next ``num_tokens`` tokens in every group (full: ``Request.alloc``).
        Raises ``OutOfPages`` (allocating nothing in any group) or as ``Request.alloc``."""
        ps = self.owner.ps
        first = -(-self.inner.allocated_tokens // ps)
        end = -(-(self.inner.allocated_tokens + max(0, num_tokens)) // ps)
        got: dict[int, list[DevicePageId]] = {}
        try:
            for gi in self.swa:
                got[gi] = self.owner.alloc_group(gi, end - first)
            self.inner.alloc(num_tokens)
        except BaseException:
            for gi, ids in got.items():
                self.owner.stores[gi].free(ids)
            raise
        for gi, ids in got.items():
            self.swa[gi].update({p: (dev, None) for p, dev in zip(range(first, end), ids)})

    def slot_ids(self, gi: int | None = None) -> torch.Tensor:
        """Slot ids per position: the full groups' (``gi`` None) or SWA group ``gi``'s, ``-1``
        for a page this request does not hold (outside every window it reads)."""
        o = self.owner
        if gi is None:
            return o.full_slot_ids(self.inner.pages)
        table = self.swa[gi]
        n = -(-self.inner.allocated_tokens // o.ps)
        ids = torch.tensor([table[p][0] if p in table else -1 for p in range(n)], dtype=torch.int64)
        slots = ids[:, None] * o.ps + torch.arange(o.ps)
        return slots.masked_fill(ids[:, None] < 0, -1).reshape(-1)

    def commit(self, num_tokens: int | None = None, snapshots: dict[int, list] | None = None) -> int:
        """``Request.commit`` for the full groups, then ``advance``. Returns computed tokens."""
        self.inner.commit(num_tokens)
        self.advance(self.inner.computed_tokens, snapshots)
        return self.inner.computed_tokens

    def advance(self, upto: int, snapshots: dict[int, list] | None = None) -> None:
        """The engine's SWA and state layers have consumed ``upto`` tokens (``<=``
        ``computed_tokens``; less while replaying): record the boundaries of ``snapshots``
        (boundary pages -> every state layer's tensor there) up to ``upto``, then free the
        SWA pages no later position reads and no recorded window keeps."""
        o, ps = self.owner, self.owner.ps
        self._release_state()  # the engine read the snapshot before computing from it
        if upto > self.inner.computed_tokens:
            raise ValueError(f"request {self.rid!r}: advance({upto}) beyond computed_tokens="
                             f"{self.inner.computed_tokens}")
        for b in sorted(snapshots or ()):
            if not 1 <= b <= upto // ps:
                raise ValueError(f"request {self.rid!r}: a snapshot at boundary {b} (pages) is not within "
                                 f"the {upto} tokens consumed")
            o.record(self, self.hashes(b), b, (snapshots or {})[b])
        if self.fork and upto >= self.fork * ps:
            b, self.fork = self.fork, 0
            if self.swa:
                o.record(self, self.hashes(b), b, None)
        for gi in self.swa:
            lo = max(0, upto - upto % ps - o.groups[gi].window + 1) // ps
            for p in [p for p in self.swa[gi] if p < lo]:
                self._drop_page(gi, p)

    def keep_window(self, gi: int, hashes: list[PageHash], lo: int, b: int, *, count: bool) -> None:
        """Hand pages ``[lo, b)`` of this request's SWA group ``gi`` to the store for a boundary
        (``count``: one more boundary needs each; else only re-store ones the store lost)."""
        st: GroupTiers = self.owner.stores[gi]
        table = self.swa[gi]
        for p in range(lo, b):
            dev, h = table.get(p, (None, None))
            if dev is None:
                raise IntegrityError(f"request {self.rid!r}: records boundary {b} of group {gi} but does not "
                                     f"hold its page {p}")
            if h is not None:
                if count:
                    st.ref(h)
            elif count or not st.holding([hashes[p]])[0]:
                table[p] = (st.keep(hashes[p], dev, needed=count), hashes[p])

    def _drop_page(self, gi: int, p: int) -> None:
        dev, h = self.swa[gi].pop(p)
        st = self.owner.stores[gi]
        if h is None:
            st.free([dev])
        else:
            st.unpin(h)

    def release_swa(self, *, keep_page: int = -1, pinned_only: bool = False) -> None:
        """Drop this request's SWA pages: all of them, but a private ``keep_page`` (a preempted
        request's partial page), or only the pinned store items (an admission's rollback);
        and the snapshot it pins in every case."""
        self._release_state()
        for gi, table in self.swa.items():
            for p in [p for p, (_, h) in table.items() if h is not None or not (pinned_only or p == keep_page)]:
                self._drop_page(gi, p)

    # ------------------------------------------------------------ endings
    def _record_end(self, snapshots: dict[int, list] | None) -> None:
        b = self.inner.computed_tokens // self.owner.ps
        self.advance(self.inner.computed_tokens, snapshots)
        if b and self.swa:
            self.owner.record(self, self.hashes(b), b, None)

    def finish(self, snapshots: dict[int, list] | None = None) -> None:
        """Record the end boundary (page-floored), share and release everything. -> FINISHED."""
        if self.inner.state is RequestState.RUNNING:
            self._record_end(snapshots)
        self.inner.finish()
        self.release_swa()
        self.owner.request_ended(self, RequestState.FINISHED)

    def preempt(self, snapshots: dict[int, list] | None = None) -> None:
        """Record the end boundary, then ``Request.preempt``; the SWA page of a private partial
        last page is kept with the full groups' (for an exact refresh). -> PREEMPTED."""
        self._record_end(snapshots)
        tail = self.inner.computed_tokens // self.owner.ps if self.inner.computed_tokens % self.owner.ps else -1
        self.inner.preempt()
        self.release_swa(keep_page=tail)
        self.resume = 0
        self.owner.request_ended(self, RequestState.PREEMPTED)

    def abort(self) -> None:
        """Release everything without recording anything. -> ABORTED."""
        self.inner.abort()
        self.release_swa()
        self.owner.request_ended(self, RequestState.ABORTED)

    def check_integrity(self) -> None:
        """Pinned pages are the store's L1 copies of their items; private ones are the store's
        private ids (and never held twice)."""
        for gi, table in self.swa.items():
            st = self.owner.stores[gi]
            for p, (dev, h) in table.items():
                ok = st.l1.get(h) == dev and h in st.pins if h is not None else dev in st.private
                if not ok:
                    raise IntegrityError(f"request {self.rid!r}: SWA group {gi} page {p} -> L1 {dev} "
                                         f"({'item ' + h.hex() if h else 'private'}) is not held that way")
        if self._state_item is not None:
            h, dev = self._state_item
            st = self.owner.stores[self.owner.state_gi] if self.owner.state_gi is not None else None
            if st is None or st.l1.get(h) != dev or h not in st.pins:
                raise IntegrityError(f"request {self.rid!r}: its snapshot {h.hex()[:8]} -> L1 {dev} is not pinned there")
