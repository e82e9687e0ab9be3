"""Prefill -> decode handoff between two instances, through L2 (same host) or L3.

A prefill instance exports a finished prefill: every page of the prompt's KV
(target and draft planes, the partial last page included) plus the request's
metadata slot (first output token, top-k, hidden row; ``hicache.cache.slots``). A
decode instance imports it into its own L1 and index and continues decoding
as if it had computed the prompt itself.
"""
from __future__ import annotations

import hashlib
import math
from typing import Mapping, NamedTuple, Sequence

import msgpack
import torch

from hicache.index.prefix_cache import Request, RequestState
from hicache.core.errors import CacheStateError, ContractMismatch, StorageError
from hicache.core.hashing import HASH_BYTES
from hicache.cache.hicache import HiCache
from hicache.core.layout import KVLayout
from hicache.memory.pools import DevicePool, HostPool
from hicache.cache.slots import MetaSlotPool, SlotData, SlotView

PROTOCOL_VERSION = 1


def hello(layout: KVLayout) -> dict:
    """The bootstrap message one side sends the other (msgpack/JSON-ready)."""
    return {"protocol": PROTOCOL_VERSION, "fingerprint": layout.fingerprint(), "layout": layout.to_dict()}


def check_peer(ours: KVLayout, peer: Mapping, *, shared_l2: bool = False) -> None:
    """Refuse to pair unless ``peer`` (its ``hello``) speaks our protocol and its pages
    have our bytes; ``shared_l2`` also requires the same host layout (both map one
    segment). Raises ``ContractMismatch`` naming every differing field and both values."""
    if peer.get("protocol") != PROTOCOL_VERSION:
        raise ContractMismatch("handoff bootstrap", [("protocol", PROTOCOL_VERSION, peer.get("protocol"))])
    theirs = KVLayout.from_dict(dict(peer["layout"]))
    if peer.get("fingerprint") != theirs.fingerprint():
        raise ContractMismatch("handoff bootstrap: the peer's fingerprint does not match its own layout "
                               "(different contract version?)",
                               [("fingerprint", theirs.fingerprint(), peer.get("fingerprint"))])
    ours.check_compatible(theirs, shared_l2=shared_l2)
    if ours.fingerprint() != theirs.fingerprint():  # check_compatible missed a field
        raise ContractMismatch("handoff bootstrap: compatible layouts with different fingerprints",
                               [("fingerprint", ours.fingerprint(), theirs.fingerprint())])


class Ticket(NamedTuple):
    """What the prefill side sends the decode side for one request (a bootstrap message)."""

    rid: str
    tokens: tuple[int, ...]  # the prompt; its KV travels
    fingerprint: str
    channel: str  # "l2" | "l3"
    pages: tuple[int, ...] = ()  # l2: channel host page ids, logical order
    keys: tuple[bytes, ...] = ()  # l3: object keys, logical order
    slot: SlotView | None = None  # l2: the request's slot in the shared slot pool
    meta: bytes = b""  # l3: the slot's data (the exporter consumed its slot)


class Imported(NamedTuple):
    """An imported prefill: a RUNNING request whose KV is all in L1, and its owned slot."""

    request: Request
    slot: SlotView  # in ``channel.slots``: consume it to read the metadata
    hit_tokens: int  # prompt tokens the decode side already had (not copied)


def _zero_tail(pool: HostPool, page: int, rows: int) -> None:
    """Zero rows ``[rows, page_size)`` of a host page: only the prompt's rows travel."""
    for i in range(len(pool.layout.planes)):
        pool.plane_page(i, page)[rows:].zero_()


class L2Channel:
    """Pages through a host pool both sides address; metadata through a shared slot pool.

    The side that owns the pool's allocator (the exporter) reserves pages; the
    importer copies them out and tells the owner (``done``) to free them.
    """

    kind = "l2"

    def __init__(self, pool: HostPool, slots: MetaSlotPool):
        self.pool, self.slots = pool, slots

    def send(self, src: DevicePool, pages: Sequence[int], num_tokens: int, rid: str,
             slot: SlotView) -> Ticket:
        from hicache.kernels.page_copy import copy_pages

        ids = self.pool.allocator.alloc(len(pages))  # raises OutOfPages: the caller retries later
        copy_pages(src, self.pool, list(pages), ids)
        _sync(src)
        tail = num_tokens - (len(pages) - 1) * src.page_size
        _zero_tail(self.pool, ids[-1], tail)
        return Ticket(rid, (), src.layout.fingerprint(), self.kind, pages=tuple(ids), slot=slot)

    def receive(self, ticket: Ticket, dst: DevicePool, first: int, dst_pages: Sequence[int]) -> SlotView:
        from hicache.kernels.page_copy import copy_pages

        if dst_pages:
            copy_pages(self.pool, dst, list(ticket.pages[first:]), list(dst_pages))
            _sync(dst)
        assert ticket.slot is not None
        return ticket.slot

    def done(self, ticket: Ticket) -> None:
        """Owner side: the importer has copied the pages; free them."""
        self.pool.allocator.free(list(ticket.pages))

    def abort(self, ticket: Ticket) -> None:
        """Owner side: the handoff will not complete; free pages and the slot."""
        self.done(ticket)
        if ticket.slot is not None:
            self.slots.release(ticket.slot)


class L3Channel:
    """Pages through an L3 backend both sides open; metadata inside the ticket.

    ``staging`` is this side's host pool (pages are borrowed from its allocator
    only for the duration of a call) and ``slots`` this side's slot pool.
    """

    kind = "l3"

    def __init__(self, storage, staging: HostPool, slots: MetaSlotPool):
        self.storage, self.staging, self.slots = storage, staging, slots

    def _keys(self, rid: str, n: int) -> tuple[bytes, ...]:
        """Request-scoped keys in the page-hash key space (never a chained page hash)."""
        fp = self.staging.layout.fingerprint()
        return tuple(hashlib.blake2b(f"hicache-handoff/{fp}/{rid}/{j}".encode(), digest_size=HASH_BYTES).digest()
                     for j in range(n))

    def send(self, src: DevicePool, pages: Sequence[int], num_tokens: int, rid: str,
             slot: SlotView) -> Ticket:
        from hicache.kernels.page_copy import copy_pages

        keys = self._keys(rid, len(pages))
        sizes = [s.page_bytes for s in self.staging.layout.planes]
        ids = self.staging.allocator.alloc(len(pages))
        try:
            copy_pages(src, self.staging, list(pages), ids)
            _sync(src)
            _zero_tail(self.staging, ids[-1], num_tokens - (len(pages) - 1) * src.page_size)
            stored = self.storage.put([(k, self.staging.read_page(p), sizes) for k, p in zip(keys, ids)])
        finally:
            self.staging.allocator.free(ids)
        if stored != len(keys):
            self.storage.delete(list(keys))
            raise StorageError(f"handoff of {rid!r}: L3 stored {stored} of {len(keys)} pages; "
                               "retry, or let the decode side recompute the prompt")
        meta = _pack(self.slots.consume(slot))  # the ticket carries it from here on
        return Ticket(rid, (), src.layout.fingerprint(), self.kind, keys=keys, meta=meta)

    def receive(self, ticket: Ticket, dst: DevicePool, first: int, dst_pages: Sequence[int]) -> SlotView:
        from hicache.kernels.page_copy import copy_pages

        keys = list(ticket.keys[first:])
        if keys:
            sizes = [s.page_bytes for s in self.staging.layout.planes]
            payloads = self.storage.get(keys, sizes)
            missing = [j + first for j, p in enumerate(payloads) if p is None]
            if missing:
                raise StorageError(f"handoff of {ticket.rid!r}: L3 has no valid object for pages "
                                   f"{missing} (missing, corrupt or foreign fingerprint); recompute")
            ids = self.staging.allocator.alloc(len(keys))
            try:
                for p, payload in zip(ids, payloads):
                    self.staging.write_page(p, payload)
                copy_pages(self.staging, dst, ids, list(dst_pages))
                _sync(dst)
            finally:
                self.staging.allocator.free(ids)
        view = self.slots.acquire(ticket.rid)  # raises SlotsExhausted: back off, retry
        d = _unpack(ticket.meta, self.slots)
        self.slots.write(view, d.first_token, d.topk_ids, d.topk_probs, d.hidden)
        return view

    def done(self, ticket: Ticket) -> None:
        self.storage.delete(list(ticket.keys))

    def abort(self, ticket: Ticket) -> None:
        self.done(ticket)


Channel = L2Channel | L3Channel


class Exporter:
    """Prefill side. Construction is the bootstrap: it checks the decode side's ``hello``.

    The call order::

        hello = handoff.hello(decode_hc.layout)                 # bootstrap message (decode -> prefill)
        tx = Exporter(prefill_hc, channel, hello)              # raises ContractMismatch on any layout
        rx = Importer(decode_hc, channel, handoff.hello(prefill_hc.layout))  # difference, nothing moved
        ticket = tx.export(req, slot_view)                     # prefill side; then req.finish()
        imported = rx.import_(ticket)                          # decode side: RUNNING request + its slot
        meta = rx.channel.slots.consume(imported.slot)         # the consumer reads: the slot is freed

    Channels: ``L2Channel`` (a ``HostPool`` both sides address: one object in a
    process, or one ``hicache.memory.shm`` segment mapped by both, plus a shared
    ``MetaSlotPool``) and ``L3Channel`` (an L3 backend both sides open, objects
    under request-scoped keys that are deleted once imported; the metadata
    travels in the ticket). Handoff objects are never cache entries: only the
    importer's index decides what it shares. Single-threaded per side.
    """

    def __init__(self, hc: HiCache, channel: Channel, peer: Mapping):
        check_peer(hc.layout, peer, shared_l2=channel.kind == "l2")
        if hc.layout.cp_size != 1:
            raise CacheStateError(f"export from a CP rank (cp_size={hc.layout.cp_size}): assemble the "
                                  "ranks' pages first (hicache.transfer.cp_assemble) and export from one pool")
        self.hc, self.channel = hc, channel

    def export(self, req: Request, slot: SlotView) -> Ticket:
        """Send ``req``'s prompt KV (it must be RUNNING with every token computed) and its
        written slot. Mutates the channel only; the caller then finishes ``req``."""
        n = req.num_tokens
        if req.state is not RequestState.RUNNING or req.computed_tokens != n:
            raise CacheStateError(f"export of {req!r}: needs a RUNNING request whose {n} tokens are "
                                  "all computed (export after the prefill, before finish)")
        pages = req.pages[:math.ceil(n / self.hc.layout.page_size)]
        t = self.channel.send(self.hc.device_pool, pages, n, req.rid, slot)
        return t._replace(tokens=tuple(req.tokens))


class Importer:
    """Decode side. Construction is the bootstrap: it checks the prefill side's ``hello``."""

    def __init__(self, hc: HiCache, channel: Channel, peer: Mapping):
        check_peer(hc.layout, peer, shared_l2=channel.kind == "l2")
        self.hc, self.channel = hc, channel

    def import_(self, ticket: Ticket, *, draft: bool | None = None) -> Imported:
        """Admit ``ticket``'s request here (reusing any prefix this instance already
        caches), copy the rest of its pages into fresh L1 pages and commit them.
        Returns the RUNNING request (all prompt tokens computed) and its slot."""
        fp = self.hc.layout.fingerprint()
        if ticket.fingerprint != fp:
            raise ContractMismatch(f"handoff ticket of {ticket.rid!r}", [("fingerprint", fp, ticket.fingerprint)])
        hc, ps, n = self.hc, self.hc.layout.page_size, len(ticket.tokens)
        req = hc.new_request(ticket.rid, list(ticket.tokens), draft=draft)
        try:
            adm = hc.admit(req)
            adm.wait()
            hit = req.computed_tokens
            fresh = req.alloc(n - hit)
            slot = self.channel.receive(ticket, hc.device_pool, hit // ps, fresh)
        except BaseException:
            req.abort()
            raise
        req.commit(n - hit, **({"draft_tokens": n - 1} if req.draft else {}))
        return Imported(req, slot, hit)


def _sync(pool: DevicePool) -> None:
    if pool.device.type == "cuda":
        torch.cuda.synchronize(pool.device)


def _pack(d: SlotData) -> bytes:
    def raw(t: torch.Tensor) -> bytes:
        return t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()
    return msgpack.packb({"first": d.first_token, "ids": raw(d.topk_ids), "probs": raw(d.topk_probs),
                          "hidden": raw(d.hidden)})


def _unpack(blob: bytes, slots: MetaSlotPool) -> SlotData:
    m = msgpack.unpackb(blob)

    def t(b: bytes, dt: torch.dtype) -> torch.Tensor:
        return torch.frombuffer(bytearray(b), dtype=torch.uint8).view(dt)
    return SlotData(int(m["first"]), t(m["ids"], torch.int64), t(m["probs"], torch.float32),
                    t(m["hidden"], slots.hidden.dtype))
