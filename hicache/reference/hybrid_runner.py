"""Serving a ``HybridModel`` through ``HybridCache``, hits floored where every group resumes.

The full-attention layers' pages go through the ``HybridCache``'s ``HiCache``,
the sliding-window layers' pages and the linear layers' state snapshots
through its group stores (L1, L2, L3 each). At admission the cache returns
the floor (``HybridAdmission.resume``) and the snapshot there, their loads
still in flight: every forward waits per attention layer for that layer's
group (``HybridAdmission.wait_layer``), the state for the snapshot; when the floor
is below the full layers' hit, the span between them is *replayed*: computed
again for the SWA and linear layers (the SWA KV rewritten, the state
advanced), the full layers' KV reused as cached.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from hicache.core.errors import CacheStateError
from hicache.cache.hybrid_admission import HybridAdmission
from hicache.cache.hybrid import HybridCache
from hicache.cache.hybrid_request import HybridRequest
from hicache.reference.model_hybrid import HybridModel, HybridState


class HybridResult(NamedTuple):
    hit: int  # the full layers' hit (tokens) at the last admission
    resume: int  # the floor: tokens whose state and KV were reused in every group
    replayed: int  # tokens computed only for the SWA and state layers (hit - resume, every admission)
    computed: int  # prompt tokens computed (replayed ones included)
    last_logits: torch.Tensor  # after the prompt
    output: list[int]  # greedy tokens


@dataclass
class HybridRunner:
    """Drives one request at a time through ``cache`` with ``model`` (mutates both)."""

    cache: HybridCache
    model: HybridModel
    chunk_tokens: int = 8
    # Also snapshot each request's last full page (of the prompt, and of prompt + output):
    # a follow-up turn then resumes at its parent's end instead of the last k-page boundary.
    snapshot_ends: bool = False

    def __post_init__(self) -> None:
        self.pool = self.cache.hc.device_pool
        self.ps = self.cache.ps
        self.swa_gi = next((gi for gi, g in enumerate(self.cache.groups) if g.kind == "swa"), None)

    def _swa(self, req: HybridRequest):
        if self.swa_gi is None:
            return None
        return self.cache.stores[self.swa_gi].device, req.slot_ids(self.swa_gi)

    def _state(self, adm: HybridAdmission) -> HybridState:
        if adm.state is None:  # resume at 0, or a model without recurrent layers (nothing to carry)
            st = HybridState.zeros(self.model.hspec)
            if adm.resume and self.model.hspec.num_linear:
                raise CacheStateError(f"resume at {adm.resume} without a snapshot or a live state")
            st.pos = adm.resume
            return st
        shape = self.model.hspec.state_shape
        return HybridState.at(adm.resume, [row.view(torch.float32).view(shape) for row in adm.state])

    def _forward(self, req: HybridRequest, adm: HybridAdmission, tokens: list[int], start: int, st: HybridState,
                 *, replay: bool = False):
        """One chunk; each attention layer first waits for its own group's load (``adm``)."""
        return self.model.forward_chunk(self.pool, tokens, start, req.slot_ids(), state=st, replay=replay,
                                        swa=self._swa(req), before_layer=adm.wait_layer)

    def _replay(self, req: HybridRequest, adm: HybridAdmission, st: HybridState) -> int:
        """Recompute ``[st.pos, computed)`` for the SWA and state layers; tokens replayed."""
        done = req.computed_tokens
        if st.pos >= done:
            return 0
        n = done - st.pos
        self._forward(req, adm, req.tokens[st.pos:done], st.pos, st, replay=True)
        req.advance(done, st.snapshots)
        st.snapshots.clear()
        return n

    def serve(self, rid: str, prompt: list[int], new_tokens: int = 3, *, preempt_at: int | None = None,
              namespace: str = "") -> HybridResult:
        """Prefill ``prompt`` in chunks from the floor, decode ``new_tokens`` greedily, finish.

        ``preempt_at``: preempt the request once at least that many prompt tokens are
        computed, drop its live state and admit it again (it resumes from the floor)."""
        req = self.cache.new_request(rid, prompt, namespace)
        adm = self.cache.admit(req)
        st = self._state(adm)
        ends = {len(prompt) // self.ps, (len(prompt) + new_tokens) // self.ps} if self.snapshot_ends else set()
        st.marks = ends | {adm.hit // self.ps}  # a fork the floor fell short of: snapshot it on the way
        replayed = self._replay(req, adm, st)
        computed, logits = replayed, None
        while req.computed_tokens < len(prompt):
            start = req.computed_tokens
            n = min(self.chunk_tokens, len(prompt) - start)
            req.alloc(n)
            logits = self._forward(req, adm, prompt[start:start + n], start, st).logits_last
            req.commit(n, st.snapshots)
            st.snapshots.clear()
            computed += n
            if preempt_at is not None and preempt_at <= req.computed_tokens < len(prompt):
                preempt_at = None
                req.preempt()
                adm = self.cache.admit(req)  # the live state was dropped: live_state_tokens=0
                st = self._state(adm)
                st.marks = ends | {adm.hit // self.ps}
                r = self._replay(req, adm, st)
                replayed, computed = replayed + r, computed + r
        if logits is None:  # the match caps at len - 1, so the last prompt token is always computed
            raise CacheStateError(f"request {rid!r}: no prompt token was computed (prompt of {len(prompt)})")
        prompt_logits, out_tokens = logits.clone(), []
        for _ in range(new_tokens):
            tok = int(logits.argmax())
            out_tokens.append(tok)
            pos = req.num_tokens
            req.extend([tok])
            req.alloc(1)
            logits = self._forward(req, adm, [tok], pos, st).logits_last
            req.commit(1, st.snapshots)
            st.snapshots.clear()
        req.finish()
        return HybridResult(adm.hit - adm.hit % self.ps, adm.resume, replayed, computed, prompt_logits,
                            out_tokens)
