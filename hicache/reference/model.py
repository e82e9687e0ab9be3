"""The reference decoder-only transformer that hicache's engine loop drives.

It keeps its KV in a ``hicache.memory.pools.DevicePool``: it writes the rows of the
tokens it computes by slot id (``page_id * page_size + offset``, see
``model_kv.write_kv``) and reads context K/V by gathering the request's page
table (one slot id per context token) from the pool buffers.

Single-request greedy generation (``prefill``, ``greedy_generate``,
``speculative_generate``; tests and examples) shows the calling protocol the engine
loop follows: chunked prefill carrying ``hidden_last`` as the next chunk's
``pending_hidden``, one decode step per token, and speculative decoding
(``speculate`` -> verify chunk -> ``verify_greedy``). They allocate nothing: the
caller owns ``pool`` and the page table ``slot_ids``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Literal, NamedTuple, Sequence

import torch
import torch.nn.functional as F

from hicache.core.errors import InvalidArgument, PoolError
from hicache.core.types import Row
from hicache.memory.pools import DevicePool
from hicache.reference import model_layers as ml
from hicache.reference.model_kv import (check_rows, check_slot_bounds, gather_context, RowBatch, to_device, write_kv,
                                        write_rows)
from hicache.reference.model_spec import ModelSpec


Attention = Literal["exact", "sdpa"]
LayerHook = Callable[[int], None]
StoreFn = Callable[[int, dict], object]  # (layer, plane rows) -> writes them into the pool


class _Slots(NamedTuple):
    """A request's checked page table for one call (one slot id per position)."""

    dev: torch.Tensor  # int64 on the model's device
    host: torch.Tensor | None  # the same ids on the CPU, bounds-checked (sdpa path); None on the exact path


class ChunkOutput(NamedTuple):
    """Result of ``forward_chunk``; fresh tensors, valid until the caller drops them."""

    logits_last: torch.Tensor  # [vocab] float32: predicts the token after the chunk
    hidden_last: torch.Tensor  # [hidden]: target hidden of the chunk's last token (draft input)
    hidden: torch.Tensor  # [n, hidden]: target hidden of every chunk token
    logits: torch.Tensor | None  # [n, vocab] float32 when all_logits=True
    draft_rows: int  # draft KV rows written by this call


class Draft(NamedTuple):
    tokens: list[int]  # k proposed tokens
    logits: torch.Tensor  # [k, vocab] float32 draft logits
    hidden_last: torch.Tensor  # [hidden] draft hidden of the last step


class Verdict(NamedTuple):
    accept_length: int  # how many drafted tokens the target accepts greedily
    bonus_token: int  # the target's own token after the accepted drafts
    tokens: list[int]  # accepted drafts followed by the bonus token (accept_length + 1)


class Generation(NamedTuple):
    tokens: list[int]  # generated tokens
    logits: torch.Tensor  # [len(tokens), vocab]: the target logits each token was taken from
    accept_lengths: list[int]  # per verify step (speculative decoding only)


@dataclass(frozen=True, slots=True)
class _Stack:
    """A tower of decoder layers over one set of planes (target or draft)."""

    embed: Callable[..., torch.Tensor]  # padded inputs -> [T, hidden]
    layers: list[ml.LayerWeights]
    final_norm: torch.Tensor
    draft: bool


def verify_greedy(logits: torch.Tensor, drafted: Sequence[int]) -> Verdict:
    """Greedy acceptance: ``logits[i]`` (target, ``[k + 1, vocab]``) is the prediction
    after the verify chunk's token ``i``, whose token ``i + 1`` is ``drafted[i]``."""
    if logits.shape[0] != len(drafted) + 1:
        raise ValueError(f"verify needs len(drafted) + 1 = {len(drafted) + 1} logits rows, got "
                         f"{logits.shape[0]}; run the chunk [last token, *drafted] with all_logits=True")
    target = logits.argmax(dim=-1).tolist()
    a = 0
    while a < len(drafted) and target[a] == int(drafted[a]):
        a += 1
    return Verdict(a, target[a], [int(t) for t in drafted[:a]] + [target[a]])


class ReferenceModel:
    """Seeded random-weight transformer (MHA/GQA or MLA) with an optional draft head.

    Stateless between calls apart from the pool it is handed: every call
    reads context from and writes new KV rows to ``pool`` (mutates it).

    Bit-exact reuse (``attention="exact"``, the default)
    ----------------------------------------------------
    A cache hit must reproduce recomputation bit for bit (float32, CPU). Float
    results depend on reduction order, which depends on tensor shapes, so every
    computation runs on one fixed shape:

    * rows are processed in *tiles* of exactly ``page_size`` rows aligned to
      absolute positions ``[c * page_size, (c + 1) * page_size)``; rows of the
      tile that this call does not compute are padding (``Row.STATIC_PAD``, token
      0, never written to the pool); a decode step is a tile with one valid row;
    * every matmul and norm is row-local, so a row's result depends only on its
      own inputs and the (fixed) tile shape;
    * a query at position ``p`` attends over exactly ``ceil_to_page(p + 1)`` keys
      (causal mask), whose valid ones are read back from the pool after this
      tile's rows were written and whose masked tail is zeros, so its reduction
      length and inputs are the same whatever path produced the context.

    Runs being compared must use the same ``torch.get_num_threads()`` (BLAS may
    split work differently). Tiny shapes run fastest with one thread.

    ``attention="sdpa"`` computes a whole chunk at once with
    ``scaled_dot_product_attention`` (GPU timing runs; equal within a tolerance).
    It validates tokens, the page table and the rows' provenance once per call on
    the host (``model_kv.check_rows``), uploads them once (pinned, non-blocking)
    and then runs every layer without a host sync, so a GPU load back can overlap
    it layer by layer (``forward_chunk(before_layer=...)``). The exact path keeps
    ``write_kv``'s full per-call checks.

    Draft (NextN / EAGLE) head
    --------------------------
    The draft row at position ``j`` fuses the target's final hidden state ``h_j``
    (before the final norm) with the embedding of the *next* token ``t_{j+1}``,
    runs one decoder layer whose KV lives in the layout's draft planes at slot
    ``j`` (the target's page ids), and predicts ``t_{j+2}``. Row ``j`` therefore
    needs ``t_{j+1}``: the last row of a chunk is *pending* until the next token is
    known. Pass it as ``next_token`` (chunked prefill), or carry
    ``ChunkOutput.hidden_last`` into the next call as ``pending_hidden`` (or into
    ``speculate``, whose first step writes it). Consequence for reuse: the draft
    row of a page's last slot depends on the first token of the following page;
    a hit continued by a different token keeps a stale draft row there. Target
    logits never depend on the draft; draft proposals are exact when the
    continuation matches (e.g. a warm rerun of the same sequence).
    """

    def __init__(self, spec: ModelSpec, *, device: str | torch.device = "cpu", attention: Attention = "exact",
                 draft: bool = True):
        if attention not in ("exact", "sdpa"):
            raise ValueError(f"attention={attention!r}: use 'exact' (bit-reproducible) or 'sdpa' (fast)")
        self.spec, self.attention, self.device = spec, attention, torch.device(device)
        self.weights = ml.init_weights(spec, self.device, draft=draft)
        self._f32_cache: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        w = self.weights
        self._target = _Stack(lambda tok: w.embed[tok], w.layers, w.final_norm, False)
        self._draft = None if w.draft is None else _Stack(self._draft_embed, [w.draft.layer],
                                                          w.draft.final_norm, True)

    @property
    def has_draft(self) -> bool:
        return self._draft is not None

    def _draft_embed(self, tok: torch.Tensor, hid: torch.Tensor) -> torch.Tensor:
        d, eps = self.weights.draft, self.spec.norm_eps
        e = ml.rms_norm(self.weights.embed[tok], d.emb_norm, eps)
        return F.linear(torch.cat((e, ml.rms_norm(hid, d.hid_norm, eps)), dim=-1), d.fc)

    # ------------------------------------------------------------------ checks
    def check_pool(self, pool: DevicePool, *, draft: bool = False) -> None:
        """Raise ``PoolError`` unless ``pool`` has this model's planes (and draft planes if asked)."""
        lay, s = pool.layout, self.spec
        want = s.kv_layout(lay.page_size, lay.host_layout, draft_layers=lay.draft_layers, model_id=lay.model_id)
        diff = lay.diff(want)
        if diff:
            raise PoolError(f"pool layout does not fit {s.model_id}: " +
                            "; ".join(f"{f}: pool={a!r} model={b!r}" for f, a, b in diff))
        if draft and (lay.draft_layers < 1 or not self.has_draft):
            raise PoolError(f"draft=True needs a draft head (has_draft={self.has_draft}) and a layout with "
                            f"draft_layers=1 (got {lay.draft_layers}); build it with spec.kv_layout(..., "
                            "draft_layers=1) or pass draft=False")

    def _check_slots(self, pool: DevicePool, slot_ids: torch.Tensor, need: int) -> _Slots:
        """Shape checks; on the sdpa path also every slot's bounds, on the host (at most
        one sync, when ``slot_ids`` lives on the GPU), then one non-blocking upload."""
        if slot_ids.dim() != 1 or slot_ids.numel() < need:
            raise PoolError(f"slot_ids must be 1-D with one slot per token up to position {need - 1} "
                            f"({need} slots), got shape {tuple(slot_ids.shape)}")
        if need > self.spec.max_seq_len:
            raise PoolError(f"position {need - 1} is beyond the RoPE table (max_seq_len="
                            f"{self.spec.max_seq_len}); raise ModelSpec.max_seq_len")
        if self.attention == "exact":  # write_kv checks every batch itself
            return _Slots(slot_ids.to(device=self.device, dtype=torch.int64), None)
        mine = slot_ids[:need].to(torch.int64)
        host = mine.cpu()
        check_slot_bounds(pool, host, f"slot_ids[:{need}]")
        return _Slots(to_device(mine, self.device), host)

    def _check_tokens(self, tokens: Sequence[int] | torch.Tensor, next_token: int | None) -> torch.Tensor:
        """Token ids validated where they are (one sync for a GPU tensor), on the model's device."""
        tok = torch.as_tensor(tokens, dtype=torch.int64).reshape(-1)
        if tok.numel():
            lo, hi = torch.stack(torch.aminmax(tok)).tolist()
            if next_token is not None:
                lo, hi = min(lo, int(next_token)), max(hi, int(next_token))
            if lo < 0 or hi >= self.spec.vocab:
                raise ValueError(f"token ids must be in [0, vocab={self.spec.vocab}), got [{lo}, {hi}]; "
                                 "build the model with a vocab that covers the trace")
        return to_device(tok, self.device)

    # ------------------------------------------------------------------ core
    def _rows(self, pool: DevicePool, stack: _Stack, inputs: tuple[torch.Tensor, ...], lo: int, hi: int,
              slots: _Slots, logits_from: int | None,
              before_layer: LayerHook | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Compute rows for positions ``[lo, hi)`` of ``stack`` from ``inputs`` (each ``[hi - lo, ...]``).

        Returns the hidden rows and, when ``logits_from`` is given, the logits of
        positions ``[logits_from, hi)``.
        """
        if self.attention == "sdpa":
            assert slots.host is not None, "sdpa attention builds host slot ids in _Slots"
            # Provenance is made here, on the host: every computed row is VALID.
            prov = torch.full((hi - lo,), int(Row.VALID), dtype=torch.int8)
            batch = check_rows(pool, slots.host[lo:hi], prov, device_slots=slots.dev[lo:hi])
            h = self._tile(pool, stack, inputs, lo, hi - lo, self._store_checked(pool, batch, stack.draft),
                           slots.dev[:hi], before_layer)
            return h, (None if logits_from is None else self._logits(stack, h[logits_from - lo:]))
        slots = slots.dev
        ps = pool.page_size
        hid, logit = [], []
        for t0 in range(lo - lo % ps, hi, ps):
            a, b = max(lo, t0), min(hi, t0 + ps)
            padded = []
            for x in inputs:
                t = x.new_zeros((ps, *x.shape[1:]))
                t[a - t0:b - t0] = x[a - lo:b - lo]
                padded.append(t)
            prov = torch.full((ps,), int(Row.STATIC_PAD), dtype=torch.int8, device=self.device)
            prov[a - t0:b - t0] = int(Row.VALID)
            tslots = torch.full((ps,), -1, dtype=torch.int64, device=self.device)
            tslots[a - t0:b - t0] = slots[a:b]
            h = self._tile(pool, stack, tuple(padded), t0, ps, self._store_full(pool, tslots, prov, stack.draft),
                           slots[:b], before_layer)
            hid.append(h[a - t0:b - t0])
            if logits_from is not None and b > logits_from:
                c = max(a, logits_from)
                logit.append(self._logits(stack, h)[c - t0:b - t0])  # on the whole tile: fixed shape
        return torch.cat(hid), (None if logits_from is None else torch.cat(logit))

    def _logits(self, stack: _Stack, h: torch.Tensor) -> torch.Tensor:
        s = self.spec
        return F.linear(ml.rms_norm(h, stack.final_norm, s.norm_eps), self.weights.lm_head).float()

    @staticmethod
    def _store_full(pool: DevicePool, tslots: torch.Tensor, prov: torch.Tensor, draft: bool) -> StoreFn:
        return lambda i, kv: write_kv(pool, i, kv, tslots, prov, draft=draft)  # checks every call

    @staticmethod
    def _store_checked(pool: DevicePool, batch: RowBatch, draft: bool) -> StoreFn:
        return lambda i, kv: write_rows(pool, i, kv, batch, draft=draft)  # checked once by check_rows

    def _tile(self, pool: DevicePool, stack: _Stack, inputs: tuple[torch.Tensor, ...], t0: int, T: int,
              store: StoreFn, ctx_slots: torch.Tensor, before_layer: LayerHook | None) -> torch.Tensor:
        """Run ``T`` rows at positions ``t0 ..`` through every layer of ``stack``; the
        attention context is ``t0 + T`` keys (the valid ones are ``ctx_slots``).
        ``store(i, kv)`` writes layer ``i``'s new rows; ``before_layer(i)`` runs
        right before that, i.e. before layer ``i`` touches the pool."""
        s, w = self.spec, self.weights
        pos = torch.arange(t0, t0 + T, device=self.device)
        rpos = pos.clamp(max=s.max_seq_len - 1)  # padding rows may run past the table
        cos, sin = w.rope_cos[rpos], w.rope_sin[rpos]
        x = stack.embed(*inputs)
        exact = self.attention == "exact"
        # The fast path trades bit-exactness for fewer launches (it is host-bound
        # for short chunks): fused norms, one RoPE for q and k, one mask per call.
        allowed = None if exact or T == t0 + T else ml.causal_allowed(pos, t0 + T)
        for i, lw in enumerate(stack.layers):
            if exact:
                q, kv = ml.project(s, lw, ml.rms_norm(x, lw.attn_norm, s.norm_eps), cos, sin)
            else:
                q, kv = ml.project_fast(s, lw, ml.rms_norm_fused(x, self._f32(lw.attn_norm), s.norm_eps), cos, sin)
            if before_layer is not None:
                before_layer(i)
            store(i, kv)
            ctx = gather_context(pool, i, ctx_slots, t0 + T, x.dtype, draft=stack.draft)
            k, v = ml.expand_kv(s, lw, ctx)
            x = x + F.linear(ml.attend(q, k, v, pos, exact=exact, allowed=allowed), lw.w_o)
            if exact:
                x = x + ml.mlp(lw, ml.rms_norm(x, lw.mlp_norm, s.norm_eps))
            else:
                x = x + ml.mlp(lw, ml.rms_norm_fused(x, self._f32(lw.mlp_norm), s.norm_eps))
        return x

    def _f32(self, w: torch.Tensor) -> torch.Tensor:
        """A float32 copy of a norm weight, made once (fast path)."""
        got = self._f32_cache.get(id(w))
        if got is None or got[0] is not w:
            got = self._f32_cache[id(w)] = (w, w.float())
        return got[1]

    # ------------------------------------------------------------------ API
    def forward_chunk(self, pool: DevicePool, tokens: Sequence[int] | torch.Tensor, start_pos: int,
                      slot_ids: torch.Tensor, *, draft: bool = True, pending_hidden: torch.Tensor | None = None,
                      next_token: int | None = None, all_logits: bool = False,
                      before_layer: LayerHook | None = None) -> ChunkOutput:
        """Compute tokens ``[start_pos, start_pos + n)`` of one request.

        The KV of ``[0, start_pos)`` must already be in ``pool`` at
        ``slot_ids[:start_pos]``; the new rows are written to
        ``slot_ids[start_pos:start_pos + n]`` (target planes, and draft planes
        when ``draft``). ``slot_ids`` may be longer than needed. Draft rows
        written: ``[start_pos - 1 if pending_hidden is given else start_pos,
        end if next_token is given else end - 1)`` (see the class docstring).

        ``before_layer(i)`` is called before target layer ``i`` reads or writes
        the pool (possibly more than once per layer on the exact path): pass
        ``Admission.wait_layer`` to overlap a load back with compute. It covers
        target layers only, so it needs ``draft=False``. Raises ``ValueError``
        (tokens, arguments), ``PoolError`` (page table, pool layout),
        ``ProvenanceError`` (rows), all before anything is written.
        """
        if before_layer is not None and draft:
            raise ValueError("before_layer waits for target layers only; with draft=True wait for the whole "
                             "load first (Admission.wait()) and pass before_layer=None, or pass draft=False")
        n = len(tokens) if not isinstance(tokens, torch.Tensor) else int(tokens.numel())
        if n < 1 or start_pos < 0:
            raise ValueError(f"forward_chunk needs >= 1 token and start_pos >= 0, got n={n} start_pos={start_pos}")
        tok = self._check_tokens(tokens, next_token if draft else None)
        end = start_pos + n
        self.check_pool(pool, draft=draft)
        slots = self._check_slots(pool, slot_ids, end)
        hidden, logits = self._rows(pool, self._target, (tok,), start_pos, end, slots,
                                    start_pos if all_logits else end - 1, before_layer)
        rows = 0
        if draft:
            rows = self._draft_chunk(pool, tok, start_pos, hidden, slots, pending_hidden, next_token)
        return ChunkOutput(logits[-1], hidden[-1], hidden, logits if all_logits else None, rows)

    def _draft_chunk(self, pool: DevicePool, tok: torch.Tensor, start: int, hidden: torch.Tensor,
                     slots: _Slots, pending: torch.Tensor | None, next_token: int | None) -> int:
        end = start + int(tok.numel())
        if pending is not None and start == 0:
            raise ValueError("pending_hidden given at start_pos=0: there is no previous token")
        j0 = start - 1 if pending is not None else start
        j1 = end if next_token is not None else end - 1
        if j1 <= j0:
            return 0
        hid = hidden if pending is None else torch.cat((pending.reshape(1, -1).to(hidden), hidden))
        nxt = tok if next_token is None else torch.cat((tok, to_device(torch.tensor([int(next_token)]), tok.device)))
        self._rows(pool, self._draft, (nxt[j0 + 1 - start:j1 + 1 - start], hid[:j1 - j0]), j0, j1, slots, None)
        return j1 - j0

    def decode_step(self, pool: DevicePool, token: int, pos: int, slot_ids: torch.Tensor, *,
                    draft: bool = True, pending_hidden: torch.Tensor | None = None) -> ChunkOutput:
        """One token at ``pos``: ``forward_chunk`` of one token (same padded tile shape)."""
        return self.forward_chunk(pool, [token], pos, slot_ids, draft=draft, pending_hidden=pending_hidden)

    def speculate(self, pool: DevicePool, hidden_last: torch.Tensor, token: int, pos: int,
                  slot_ids: torch.Tensor, k: int) -> Draft:
        """Propose ``k`` tokens after ``token`` (the token sampled at ``pos + 1``).

        ``hidden_last`` is the target hidden at ``pos``. Writes draft rows
        ``pos .. pos + k - 1`` (row ``pos`` exact; later rows speculative until
        the verify ``forward_chunk`` rewrites them); needs ``slot_ids`` up to
        position ``pos + k - 1``.
        """
        if k < 1:
            raise ValueError(f"speculate needs k >= 1, got {k}")
        self.check_pool(pool, draft=True)
        slots = self._check_slots(pool, slot_ids, pos + k)
        h, t = hidden_last.reshape(1, -1), int(token)
        toks, logits = [], []
        for j in range(pos, pos + k):
            tt = to_device(torch.tensor([t], dtype=torch.int64), self.device)
            h, lg = self._rows(pool, self._draft, (tt, h), j, j + 1, slots, j)
            t = int(lg[0].argmax())
            toks.append(t)
            logits.append(lg[0])
        return Draft(toks, torch.stack(logits), h[0])


def prefill(model: ReferenceModel, pool: DevicePool, prompt: Sequence[int], slot_ids: torch.Tensor, *,
            start_pos: int = 0, chunk: int | None = None, draft: bool = True) -> ChunkOutput:
    """Compute ``prompt[start_pos:]`` in chunks of ``chunk`` tokens (default: one chunk).

    The KV of ``prompt[:start_pos]`` must be in ``pool`` already (a cache hit).
    Non-final chunks complete their last draft row with the next prompt token.
    Returns the last chunk's output.
    """
    n = len(prompt)
    if not 0 <= start_pos < n:
        raise InvalidArgument(f"start_pos={start_pos} must be in [0, len(prompt)={n})")
    step = chunk or n
    out = None
    for a in range(start_pos, n, step):
        b = min(n, a + step)
        out = model.forward_chunk(pool, prompt[a:b], a, slot_ids, draft=draft,
                                  next_token=prompt[b] if (draft and b < n) else None)
    assert out is not None, f"start_pos={start_pos} < n={n} runs at least one chunk"
    return out


def greedy_generate(model: ReferenceModel, pool: DevicePool, prompt: Sequence[int], slot_ids: torch.Tensor,
                    max_new_tokens: int, *, start_pos: int = 0, chunk: int | None = None,
                    draft: bool = True) -> Generation:
    """Prefill then decode greedily, one token per step.

    ``slot_ids`` needs ``len(prompt) + max_new_tokens - 1`` slots (the last
    generated token is never fed back). With ``draft`` the draft rows of every
    fed token except the last are written.
    """
    out = prefill(model, pool, prompt, slot_ids, start_pos=start_pos, chunk=chunk, draft=draft)
    toks, logits = [], []
    pos = len(prompt) - 1
    while True:
        logits.append(out.logits_last)
        toks.append(int(out.logits_last.argmax()))
        if len(toks) == max_new_tokens:
            break
        pos += 1
        out = model.decode_step(pool, toks[-1], pos, slot_ids, draft=draft,
                                pending_hidden=out.hidden_last if draft else None)
    return Generation(toks, torch.stack(logits), [])


def speculative_generate(model: ReferenceModel, pool: DevicePool, prompt: Sequence[int], slot_ids: torch.Tensor,
                         max_new_tokens: int, k: int, *, start_pos: int = 0) -> Generation:
    """Greedy generation through draft-and-verify steps of ``k`` drafted tokens.

    Produces exactly the tokens of ``greedy_generate`` (the target verifies
    every token; its logits are bit-identical to a decode step's).
    ``slot_ids`` needs ``len(prompt) + max_new_tokens + k`` slots (a verify
    chunk may run past the last kept token).
    """
    out = prefill(model, pool, prompt, slot_ids, start_pos=start_pos)
    tok = int(out.logits_last.argmax())
    toks, logits, accepts = [tok], [out.logits_last], []
    pos, hidden = len(prompt) - 1, out.hidden_last  # target hidden at pos; tok sits at pos + 1
    while len(toks) < max_new_tokens:
        d = model.speculate(pool, hidden, tok, pos, slot_ids, k)
        v = model.forward_chunk(pool, [tok, *d.tokens], pos + 1, slot_ids, all_logits=True)
        verdict = verify_greedy(v.logits, d.tokens)
        accepts.append(verdict.accept_length)
        toks += verdict.tokens
        logits += list(v.logits[:verdict.accept_length + 1])
        pos += 1 + verdict.accept_length
        hidden, tok = v.hidden[verdict.accept_length], verdict.bonus_token
    return Generation(toks[:max_new_tokens], torch.stack(logits[:max_new_tokens]), accepts)
