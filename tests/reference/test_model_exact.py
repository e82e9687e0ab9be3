"""Bit-exactness of the reference model: a cache hit reproduces recomputation.

Every comparison is ``torch.equal`` on float32 CPU tensors: logits, and the KV
rows written to the pool.
"""
from __future__ import annotations

import pytest
import torch

from hicache.reference.model import greedy_generate, prefill

N_PAGES = 5  # prompts span 5 full pages plus a partial one


def _cold(bench, toks, draft=True):
    pool = bench.pool()
    pages, slots = bench.table(len(toks))
    out = bench.model.forward_chunk(pool, toks, 0, slots, draft=draft, all_logits=True)
    return pool, pages, slots, out


def _planes(bench):
    return [(s.name, s.layer) for s in bench.layout.planes]


def _assert_rows_equal(bench, pool_a, slots_a, pool_b, slots_b, upto, draft_upto=None):
    for name, layer in _planes(bench):
        n = draft_upto if name.startswith("draft_") and draft_upto is not None else upto
        a = pool_a.plane(name, layer)[slots_a[:n]]
        b = pool_b.plane(name, layer)[slots_b[:n]]
        assert torch.equal(a, b), (name, layer, (a - b).abs().max())


@pytest.mark.parametrize("ps", [1, 3, 4])
@pytest.mark.parametrize("draft", [False, True])
def test_warm_equals_cold_at_every_page_split(make_bench, page_copy, kind, ps, draft):
    b = make_bench(kind, ps, draft, num_pages=64)
    n = N_PAGES * ps + 2
    toks = b.tokens(n)
    cold_pool, cold_pages, cold_slots, cold = _cold(b, toks, draft)
    for split in range(ps, n, ps):
        pool = b.pool()
        pages, slots = b.table(n, reverse=True)  # different page ids than the cold run
        hit = split // ps
        page_copy(cold_pool, cold_pages[:hit], pool, pages[:hit])
        warm = b.model.forward_chunk(pool, toks[split:], split, slots, draft=draft, all_logits=True)
        assert torch.equal(warm.logits, cold.logits[split:]), split
        assert torch.equal(warm.hidden_last, cold.hidden_last)
        _assert_rows_equal(b, cold_pool, cold_slots, pool, slots, n, draft_upto=n - 1)


@pytest.mark.parametrize("chunk", [4, 8, 12, 3, 5])  # 1/2/3 pages of 4, and unaligned chunks
def test_chunked_prefill_equals_one_chunk(make_bench, kind, chunk):
    b = make_bench(kind, 4)
    n = N_PAGES * 4 + 2
    toks = b.tokens(n, seed=1)
    cold_pool, _, cold_slots, cold = _cold(b, toks)
    pool = b.pool()
    _, slots = b.table(n, first=3)
    logits = []
    for a in range(0, n, chunk):
        e = min(n, a + chunk)
        out = b.model.forward_chunk(pool, toks[a:e], a, slots, all_logits=True,
                                    next_token=toks[e] if e < n else None)
        logits.append(out.logits)
    assert torch.equal(torch.cat(logits), cold.logits)
    _assert_rows_equal(b, cold_pool, cold_slots, pool, slots, n, draft_upto=n - 1)


def test_decode_steps_equal_prefill(make_bench, kind):
    """Teacher-forced decode steps (one valid row in a padded tile) match one prefill."""
    b = make_bench(kind, 4)
    n = N_PAGES * 4 + 2
    toks = b.tokens(n, seed=2)
    cold_pool, _, cold_slots, cold = _cold(b, toks)
    pool = b.pool()
    _, slots = b.table(n, first=7)
    out = b.model.forward_chunk(pool, toks[:5], 0, slots, all_logits=True)
    logits = [out.logits]
    for p in range(5, n):
        out = b.model.decode_step(pool, toks[p], p, slots, pending_hidden=out.hidden_last)
        logits.append(out.logits_last[None])
    assert torch.equal(torch.cat(logits), cold.logits)
    _assert_rows_equal(b, cold_pool, cold_slots, pool, slots, n, draft_upto=n - 1)


@pytest.mark.parametrize("hit_pages", [1, 3, 5])
def test_prefix_from_previous_request_decode(make_bench, kind, hit_pages):
    """Request B reuses pages that request A produced by prefill + decode steps
    (shared page table entries in one pool), then diverges."""
    b = make_bench(kind, 4)
    a_toks = b.tokens(8)
    pool = b.pool()
    a_pages, a_slots = b.table(N_PAGES * 4 + 4)
    gen = greedy_generate(b.model, pool, a_toks, a_slots, N_PAGES * 4 - 4)
    a_seq = a_toks + gen.tokens  # A's fed tokens are a_seq[:-1]
    split = hit_pages * 4
    b_toks = a_seq[:split] + b.tokens(9, seed=3)
    # B's table: A's first hit_pages pages, then fresh pages.
    fresh_pages, _ = b.table(len(b_toks), first=len(a_pages))
    b_pages = a_pages[:hit_pages] + fresh_pages[hit_pages:]
    b_slots = (torch.tensor(b_pages)[:, None] * 4 + torch.arange(4)).reshape(-1)
    warm = b.model.forward_chunk(pool, b_toks[split:], split, b_slots, all_logits=True)
    _, _, _, cold = _cold(b, b_toks)
    assert torch.equal(warm.logits, cold.logits[split:])


def test_greedy_generation_warm_equals_cold(make_bench, page_copy, kind):
    b = make_bench(kind, 4)
    toks = b.tokens(14, seed=4)
    pool_a = b.pool()
    pages_a, slots_a = b.table(14 + 10)
    cold = greedy_generate(b.model, pool_a, toks, slots_a, 10, chunk=4)
    pool_b = b.pool()
    pages_b, slots_b = b.table(14 + 10, reverse=True)
    page_copy(pool_a, pages_a[:3], pool_b, pages_b[:3])
    warm = greedy_generate(b.model, pool_b, toks, slots_b, 10, start_pos=12)
    assert warm.tokens == cold.tokens
    assert torch.equal(warm.logits, cold.logits)


def test_draft_does_not_change_target(make_bench, kind):
    with_d, without = make_bench(kind, 4, True), make_bench(kind, 4, False)
    toks = with_d.tokens(N_PAGES * 4 + 2, seed=5)
    a = _cold(with_d, toks, True)[3]
    b = _cold(without, toks, False)[3]
    assert torch.equal(a.logits, b.logits)


@pytest.mark.parametrize("kind,plane", [("mha", "k"), ("mha", "v"), ("mla", "latent")])
def test_corrupted_cached_byte_changes_logits(make_bench, page_copy, kind, plane):
    """The check can fail: one byte of one cached page flips the warm logits."""
    b = make_bench(kind, 4, draft=False)
    n = N_PAGES * 4 + 2
    toks = b.tokens(n, seed=6)
    cold_pool, cold_pages, _, cold = _cold(b, toks, False)
    pool = b.pool()
    pages, slots = b.table(n, reverse=True)
    page_copy(cold_pool, cold_pages[:3], pool, pages[:3])
    raw = pool.page_view(pages[1])[(plane, 0)].view(torch.uint8)  # layer 0, second cached page
    raw.view(-1)[6] ^= 0x55  # a high mantissa byte of one float32
    warm = b.model.forward_chunk(pool, toks[12:], 12, slots, draft=False, all_logits=True)
    assert not torch.equal(warm.logits, cold.logits[12:])
    # and restoring the byte restores bit-exactness
    raw.view(-1)[6] ^= 0x55
    warm = b.model.forward_chunk(pool, toks[12:], 12, slots, draft=False, all_logits=True)
    assert torch.equal(warm.logits, cold.logits[12:])


def test_prefill_helper_chunks_match(make_bench, kind):
    b = make_bench(kind, 4)
    toks = b.tokens(N_PAGES * 4 + 1, seed=7)
    _, _, _, cold = _cold(b, toks)
    pool = b.pool()
    _, slots = b.table(len(toks))
    out = prefill(b.model, pool, toks, slots, chunk=8)
    assert torch.equal(out.logits_last, cold.logits_last)
