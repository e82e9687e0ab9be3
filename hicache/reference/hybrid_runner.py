"""Serving a ``HybridModel`` through ``HiCache``, hits floored where every group resumes.

What is wired: the attention layers' pages go through ``HiCache`` (L1, L2,
L3) like any model's; the linear layers' state snapshots live in a
``SnapshotStore`` keyed by the chained page hash of the boundary's last page
(the same hash that keys the page in L3), with a digest per snapshot. At
admission the runner asks ``hicache.hybrid.resumable_floor`` for the resume
point: ``HiCache``'s hit gives the attention groups' pages, the store the
snapshots. When the floor is below the hit, the chunk between them is
*replayed* (computed to advance the recurrent state, its KV left as cached).

Snapshots have two tiers of their own: host memory and, with ``state_url``,
an L3 backend through the page codec (fingerprint, page hash, checksum).

What is not wired: ``HiCache``'s index does not know the groups (it stores
every SWA page and matches as for a full-attention model), and snapshots are
neither in ``HiCache``'s L2 pool nor in its eviction or prefetch.
"""
from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from hicache.reference.model_hybrid import HybridModel, HybridState
from hicache.errors import CacheStateError, IntegrityError
from hicache.hashing import page_hashes
from hicache.hicache import HiCache
from hicache.hybrid import resumable_floor
from hicache.storage import StorageBackend, open_storage
from hicache.storage.capacity import backend_options
from hicache.types import PageHash


class Snapshot(NamedTuple):
    pages: int  # the boundary, in pages
    layers: tuple[torch.Tensor, ...]  # every linear layer's state there (CPU copies)
    digest: bytes  # blake2b over the layers' bytes


def _digest(layers: tuple[torch.Tensor, ...]) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    for t in layers:
        h.update(t.contiguous().view(torch.uint8).numpy().tobytes())
    return h.digest()


class SnapshotStore:
    """Recurrent-state snapshots by page hash, bound to one layout fingerprint.

    Two tiers: a host-memory dict (digest-checked) and, when ``storage`` is
    given, an L3 backend written through on ``put``. L3 objects go through the
    page codec: the header carries the layout fingerprint, the page hash and a
    checksum, so a foreign, misplaced or corrupt snapshot reads as a miss. A
    snapshot found only in L3 is promoted into memory on ``get``.
    """

    def __init__(self, fingerprint: str, shapes: list[tuple[int, ...]], storage: StorageBackend | None = None):
        self.fingerprint, self.shapes, self.storage = fingerprint, shapes, storage
        self.sizes = [4 * math.prod(s) for s in shapes]  # float32 bytes of each layer's state
        self._snaps: dict[PageHash, Snapshot] = {}
        self.corrupt = 0  # in-memory snapshots whose digest failed on get (dropped)
        self.l3_hits = 0

    def __len__(self) -> int:
        return len(self._snaps)

    def put(self, key: PageHash, pages: int, layers: list[torch.Tensor]) -> None:
        """Keep a copy of ``layers`` (mutates the store; overwrites an equal key) and
        write it through to L3; an L3 that cannot take it drops it (counted there)."""
        t = tuple(x.detach().to("cpu", torch.float32).clone() for x in layers)
        self._snaps[key] = Snapshot(pages, t, _digest(t))
        if self.storage is not None:
            self.storage.put([(_l3_key(key), _encode(pages, t), [8, *self.sizes])])

    def has(self, key: PageHash) -> bool:
        """In memory or stored in L3 (L3 presence is verified by ``get``, not here)."""
        return key in self._snaps or (self.storage is not None and self.storage.exists([_l3_key(key)])[0])

    def get(self, key: PageHash, pages: int) -> Snapshot | None:
        """The snapshot at ``key`` if it is intact and at ``pages``; a corrupt one is
        dropped and counted. The returned tensors stay valid until the next ``put`` of
        ``key``; copy before mutating."""
        s = self._snaps.get(key)
        if s is None:
            return self._get_l3(key, pages)
        if s.pages != pages or _digest(s.layers) != s.digest:
            del self._snaps[key]
            self.corrupt += 1
            return self._get_l3(key, pages)
        return s

    def _get_l3(self, key: PageHash, pages: int) -> Snapshot | None:
        if self.storage is None:
            return None
        mv = self.storage.get([_l3_key(key)], [8, *self.sizes])[0]
        if mv is None:
            return None
        got = int.from_bytes(mv[:8], "little")
        if got != pages:  # the codec verified the bytes; a boundary mismatch is a logic error upstream
            raise IntegrityError(f"SnapshotStore: L3 snapshot {key.hex()} is at {got} pages, asked for {pages}")
        t, off = [], 8
        for shape, n in zip(self.shapes, self.sizes):
            t.append(torch.frombuffer(bytearray(mv[off:off + n]), dtype=torch.float32).view(shape))
            off += n
        snap = self._snaps[key] = Snapshot(pages, tuple(t), _digest(tuple(t)))
        self.l3_hits += 1
        return snap

    def evict_host(self) -> int:
        """Drop every in-memory snapshot (L3 keeps its copies); returns how many."""
        n = len(self._snaps)
        self._snaps.clear()
        return n

    def check_integrity(self) -> None:
        for key, s in self._snaps.items():
            if _digest(s.layers) != s.digest or s.pages < 1 or len(key) != 16:
                raise IntegrityError(f"SnapshotStore: snapshot {key.hex()} at {s.pages} pages is corrupt")
            if [tuple(x.shape) for x in s.layers] != self.shapes:
                raise IntegrityError(f"SnapshotStore: snapshot {key.hex()} has shapes "
                                     f"{[tuple(x.shape) for x in s.layers]}, expected {self.shapes}")
        if self.storage is not None:
            self.storage.check_integrity()


def _l3_key(page: PageHash) -> bytes:
    """The L3 key of the snapshot at ``page``: derived, so that it never equals a page
    object's key even where a backend ignores key prefixes (file:// names by key)."""
    return hashlib.blake2b(b"hicache-state\0" + page, digest_size=16).digest()


def _encode(pages: int, layers: tuple[torch.Tensor, ...]) -> bytes:
    return pages.to_bytes(8, "little") + b"".join(x.contiguous().view(torch.uint8).numpy().tobytes() for x in layers)


class HybridResult(NamedTuple):
    hit: int  # HiCache's page-floored hit (tokens) at the last admission
    resume: int  # the floor: tokens whose state and KV were reused
    replayed: int  # tokens computed only to advance the state (hit - resume)
    computed: int  # prompt tokens computed (replayed ones included)
    last_logits: torch.Tensor  # after the prompt
    output: list[int]  # greedy tokens


@dataclass
class HybridRunner:
    """Drives one request at a time through ``hc`` with ``model`` (mutates both)."""

    hc: HiCache
    model: HybridModel
    chunk_tokens: int = 8
    state_url: str = ""  # L3 for state snapshots (an open_storage URL); "" keeps them in memory only
    # Also snapshot each request's last full page (of the prompt, and of prompt + output):
    # a follow-up turn then resumes at its parent's end instead of the last k-page boundary.
    snapshot_ends: bool = False
    store: SnapshotStore = field(init=False)

    def __post_init__(self) -> None:
        fp = self.hc.layout.fingerprint()
        l3 = None
        if self.state_url:  # snapshots under their own prefix, opened as HiCache opens its L3 (same
            # cap and ledger on a shared file:// directory, same timeouts and MAC key)
            st = self.hc.config.storage
            l3 = open_storage(self.state_url, fingerprint=fp, key_prefix=f"hicache:{fp[:8]}:state:",
                              timeout_ms=st.timeout_ms, max_retries=st.max_retries,
                              auth_key=st.resolved_auth_key(), **backend_options(st, self.state_url))
        self.store = SnapshotStore(fp, [self.model.hspec.state_shape] * self.model.hspec.num_linear, l3)
        self.pool = self.hc.device_pool
        self.ps = self.pool.layout.page_size
        self.groups = self.hc.layout.groups

    def close(self) -> None:
        """Close the snapshots' L3 backend (the ``HiCache`` is the caller's to close)."""
        if self.store.storage is not None:
            self.store.storage.close()

    def _admit(self, req, hashes: list[PageHash]) -> tuple[int, int, HybridState]:
        """Admit ``req``; returns (hit, floor, the state at the floor)."""
        adm = self.hc.admit(req)
        adm.wait()
        hit = req.computed_tokens // self.ps * self.ps  # full pages only: snapshots sit on page boundaries
        n = hit // self.ps
        holds = [[g.kind != "state" or self.store.has(hashes[i]) for i in range(n)] for g in self.groups]
        floor = resumable_floor(self.groups, self.ps, holds)
        b = floor.pages
        while b:  # a snapshot that fails its digest is a miss: floor again without it
            snap = self.store.get(hashes[b - 1], b)
            if snap is not None:
                return hit, b * self.ps, HybridState.at(b * self.ps, list(snap.layers))
            holds = [[h and (g.kind != "state" or i != b - 1) for i, h in enumerate(row)]
                     for g, row in zip(self.groups, holds)]
            b = resumable_floor(self.groups, self.ps, holds).pages
        return hit, 0, HybridState.zeros(self.model.hspec)

    def _keep(self, st: HybridState, hashes: list[PageHash]) -> None:
        for pages, layers in st.snapshots.items():
            if pages <= len(hashes):
                self.store.put(hashes[pages - 1], pages, layers)
        st.snapshots.clear()

    def serve(self, rid: str, prompt: list[int], new_tokens: int = 3, *, preempt_at: int | None = None,
              namespace: str = "") -> HybridResult:
        """Prefill ``prompt`` in chunks from the floor, decode ``new_tokens`` greedily, finish.

        ``preempt_at``: preempt the request once at least that many prompt tokens are
        computed, drop its live state and admit it again (it resumes from the floor)."""
        hashes = page_hashes(prompt, self.ps, namespace)
        req = self.hc.new_request(rid, prompt, namespace)
        hit, resume, st = self._admit(req, hashes)
        ends = {len(prompt) // self.ps, (len(prompt) + new_tokens) // self.ps} if self.snapshot_ends else set()
        st.marks = ends
        replayed = computed = 0
        logits = None
        while True:
            done = req.computed_tokens  # the hit, plus its own partial page after a preemption
            if st.pos < done:  # floor below the hit: replay the gap to advance the state
                slots = self.pool.slot_ids(req.pages)[:done]
                self.model.forward_chunk(self.pool, prompt[st.pos:done], st.pos, slots, state=st, replay=True)
                replayed += done - resume
                computed += done - resume
                self._keep(st, hashes)
            while req.computed_tokens < len(prompt):
                start = req.computed_tokens
                n = min(self.chunk_tokens, len(prompt) - start)
                req.alloc(n)
                out = self.model.forward_chunk(self.pool, prompt[start:start + n], start,
                                               self.pool.slot_ids(req.pages)[:start + n], state=st)
                req.commit(n)
                computed += n
                logits = out.logits_last
                self._keep(st, hashes)
                if preempt_at is not None and req.computed_tokens >= preempt_at and req.computed_tokens < len(prompt):
                    preempt_at = None
                    req.preempt()
                    hit, resume, st = self._admit(req, hashes)
                    st.marks = ends
                    break
            else:
                break
        if logits is None:  # the match caps at len - 1, so the last prompt token is always computed
            raise CacheStateError(f"request {rid!r}: no prompt token was computed (prompt of {len(prompt)})")
        prompt_logits, out_tokens = logits.clone(), []
        for _ in range(new_tokens):
            tok = int(logits.argmax())
            out_tokens.append(tok)
            pos = req.num_tokens
            req.extend([tok])
            req.alloc(1)
            logits = self.model.decode_step(self.pool, tok, pos, self.pool.slot_ids(req.pages)[:pos + 1],
                                            state=st).logits_last
            req.commit(1)
        self._keep(st, page_hashes(req.tokens, self.ps, namespace))  # decode's, by the output's hashes
        req.finish()
        return HybridResult(hit, resume, replayed, computed, prompt_logits, out_tokens)
