"""Serving a ``HybridModel`` through ``HiCache``, hits floored where every group resumes.

What is wired: the attention layers' pages go through ``HiCache`` (L1, L2,
L3) like any model's; the linear layers' state snapshots live in a
``SnapshotStore`` keyed by the chained page hash of the boundary's last page
(the same hash that keys the page in L3), with a digest per snapshot. At
admission the runner asks ``hicache.hybrid.resumable_floor`` for the resume
point: ``HiCache``'s hit gives the attention groups' pages, the store the
snapshots. When the floor is below the hit, the chunk between them is
*replayed* (computed to advance the recurrent state, its KV left as cached).

What is not wired: ``HiCache``'s index does not know the groups (it stores
every SWA page and matches as for a full-attention model), and snapshots do
not move between tiers (they stay in this host-memory store).
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from hicache.engine.model_hybrid import HybridModel, HybridState
from hicache.hashing import page_hashes
from hicache.hicache import HiCache
from hicache.hybrid import resumable_floor
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
    """Recurrent-state snapshots by page hash, bound to one layout fingerprint."""

    def __init__(self, fingerprint: str):
        self.fingerprint = fingerprint
        self._snaps: dict[PageHash, Snapshot] = {}
        self.corrupt = 0  # snapshots whose digest failed on get (dropped)

    def __len__(self) -> int:
        return len(self._snaps)

    def put(self, key: PageHash, pages: int, layers: list[torch.Tensor]) -> None:
        """Keep a copy of ``layers`` (mutates the store; overwrites an equal key)."""
        t = tuple(x.detach().cpu().clone() for x in layers)
        self._snaps[key] = Snapshot(pages, t, _digest(t))

    def has(self, key: PageHash) -> bool:
        return key in self._snaps

    def get(self, key: PageHash, pages: int) -> Snapshot | None:
        """The snapshot at ``key`` if it is intact and at ``pages``; a corrupt one is
        dropped and counted. The returned tensors stay valid until the next ``put`` of
        ``key``; copy before mutating."""
        s = self._snaps.get(key)
        if s is None:
            return None
        if s.pages != pages or _digest(s.layers) != s.digest:
            del self._snaps[key]
            self.corrupt += 1
            return None
        return s

    def check_integrity(self) -> None:
        for key, s in self._snaps.items():
            if _digest(s.layers) != s.digest or s.pages < 1 or len(key) != 16:
                raise AssertionError(f"SnapshotStore: snapshot {key.hex()} at {s.pages} pages is corrupt")


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
    store: SnapshotStore = field(init=False)

    def __post_init__(self) -> None:
        self.store = SnapshotStore(self.hc.layout.fingerprint())
        self.pool = self.hc.device_pool
        self.ps = self.pool.layout.page_size
        self.groups = self.hc.layout.groups

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
                    break
            else:
                break
        assert logits is not None, "the last prompt token is always computed (match caps at len - 1)"
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
        st.snapshots.clear()  # decode snapshots would need the output's hashes; not kept
        req.finish()
        return HybridResult(hit, resume, replayed, computed, prompt_logits, out_tokens)
