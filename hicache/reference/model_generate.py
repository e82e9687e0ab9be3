"""Single-request greedy generation on the reference model (tests and examples).

These loops show the calling protocol the engine loop follows: chunked
prefill carrying ``hidden_last`` as the next chunk's ``pending_hidden``, one
decode step per token, and speculative decoding (``speculate`` -> verify chunk
-> ``verify_greedy``). They allocate nothing: the caller owns ``pool`` and the
page table ``slot_ids``.
"""
from __future__ import annotations

from typing import Sequence

import torch

from hicache.reference.model import ChunkOutput, Generation, ReferenceModel, verify_greedy
from hicache.core.errors import InvalidArgument
from hicache.memory.pools import DevicePool


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
