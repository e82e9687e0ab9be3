"""Draft (NextN) head: speculation, verification, accept lengths, draft-plane reuse."""
from __future__ import annotations

import pytest
import torch

from hicache.reference.model import verify_greedy
from hicache.reference.model import greedy_generate, prefill, speculative_generate


def test_verify_greedy_exact_values():
    logits = torch.zeros(4, 10)
    for i, t in enumerate([3, 5, 7, 9]):  # the target's argmax after each chunk token
        logits[i, t] = 1.0
    assert verify_greedy(logits, [3, 5, 7]) == (3, 9, [3, 5, 7, 9])
    assert verify_greedy(logits, [3, 6, 7]) == (1, 5, [3, 5])
    assert verify_greedy(logits, [0, 5, 7]) == (0, 3, [3])
    with pytest.raises(ValueError, match="len\\(drafted\\) \\+ 1 = 3"):
        verify_greedy(logits, [3, 5])


@pytest.mark.parametrize("k", [1, 3, 5])
def test_speculative_generation_equals_greedy(make_bench, kind, k):
    b = make_bench(kind, 4)
    toks = b.tokens(10, seed=11)
    n_new = 14
    pool = b.pool()
    _, slots = b.table(10 + n_new + k)
    ref = greedy_generate(b.model, pool, toks, slots, n_new)
    pool = b.pool()
    spec = speculative_generate(b.model, pool, toks, slots, n_new, k)
    assert spec.tokens == ref.tokens
    assert torch.equal(spec.logits, ref.logits)
    assert sum(a + 1 for a in spec.accept_lengths) + 1 >= n_new
    assert all(0 <= a <= k for a in spec.accept_lengths)


def test_oracle_draft_is_fully_accepted(make_bench, kind):
    """Drafting the target's own greedy continuation gives accept_length == k."""
    b = make_bench(kind, 4)
    toks = b.tokens(9, seed=12)
    pool = b.pool()
    _, slots = b.table(9 + 8)
    ref = greedy_generate(b.model, pool, toks, slots, 6)
    pool = b.pool()
    out = prefill(b.model, pool, toks, slots)
    k = 4
    chunk = [ref.tokens[0], *ref.tokens[1:1 + k]]
    v = b.model.forward_chunk(pool, chunk, len(toks), slots, all_logits=True)
    verdict = verify_greedy(v.logits, ref.tokens[1:1 + k])
    assert verdict == (k, ref.tokens[k + 1], ref.tokens[1:k + 2])
    assert torch.equal(v.logits, ref.logits[1:k + 2])
    assert int(out.logits_last.argmax()) == ref.tokens[0]


def test_speculate_warm_equals_cold(make_bench, page_copy, kind):
    """Draft proposals after a cache hit (draft planes reused) equal a cold run's."""
    b = make_bench(kind, 4)
    toks = b.tokens(22, seed=13)
    pool_a = b.pool()
    pages_a, slots_a = b.table(22 + 4)
    cold = prefill(b.model, pool_a, toks, slots_a)
    nxt = int(cold.logits_last.argmax())
    d_cold = b.model.speculate(pool_a, cold.hidden_last, nxt, 21, slots_a, 4)
    pool_b = b.pool()
    pages_b, slots_b = b.table(22 + 4, reverse=True)
    page_copy(pool_a, pages_a[:4], pool_b, pages_b[:4])
    warm = prefill(b.model, pool_b, toks, slots_b, start_pos=16)
    d_warm = b.model.speculate(pool_b, warm.hidden_last, nxt, 21, slots_b, 4)
    assert d_warm.tokens == d_cold.tokens
    assert torch.equal(d_warm.logits, d_cold.logits)


def test_corrupted_draft_plane_changes_proposals_only(make_bench, page_copy, kind):
    b = make_bench(kind, 4)
    toks = b.tokens(22, seed=14)
    pool_a = b.pool()
    pages_a, slots_a = b.table(22 + 3)
    cold = prefill(b.model, pool_a, toks, slots_a)
    nxt = int(cold.logits_last.argmax())
    d_cold = b.model.speculate(pool_a, cold.hidden_last, nxt, 21, slots_a, 3)
    pool_b = b.pool()
    pages_b, slots_b = b.table(22 + 3, reverse=True)
    page_copy(pool_a, pages_a[:4], pool_b, pages_b[:4])
    plane = "draft_k" if kind == "mha" else "draft_latent"
    pool_b.page_view(pages_b[2])[(plane, 0)].view(torch.uint8).view(-1)[2] ^= 0x55
    warm = prefill(b.model, pool_b, toks, slots_b, start_pos=16)
    assert torch.equal(warm.logits_last, cold.logits_last)  # the target never reads draft planes
    d_warm = b.model.speculate(pool_b, warm.hidden_last, nxt, 21, slots_b, 3)
    assert not torch.equal(d_warm.logits, d_cold.logits)


def test_pending_draft_row_protocol(make_bench, kind):
    """Draft rows written per call: pending_hidden adds the row before the chunk,
    next_token adds the chunk's last row."""
    b = make_bench(kind, 4)
    toks = b.tokens(8, seed=15)
    pool = b.pool()
    _, slots = b.table(8)
    out = b.model.forward_chunk(pool, toks[:4], 0, slots)
    assert out.draft_rows == 3  # rows 0..2; row 3 waits for token 4
    out = b.model.forward_chunk(pool, toks[4:6], 4, slots, pending_hidden=out.hidden_last)
    assert out.draft_rows == 2  # rows 3..4
    out = b.model.forward_chunk(pool, toks[6:8], 6, slots, pending_hidden=out.hidden_last, next_token=1)
    assert out.draft_rows == 3  # rows 5..7
    assert b.model.forward_chunk(pool, toks[7:8], 7, slots).draft_rows == 0
    with pytest.raises(ValueError, match="start_pos=0"):
        b.model.forward_chunk(pool, toks[:1], 0, slots, pending_hidden=out.hidden_last)
