"""Context parallelism: each rank's pages land only in its own pool; a decode side
without CP assembles full logical pages from all ranks in global order (from their
L1 or their L2), byte for byte what a cp_size 1 run holds, and decodes the same."""
from __future__ import annotations

import pytest
import torch

from hicache.transfer.cp_assemble import RankPages, RequestRows, assemble, page_sources, rank_batch, store_batch
from hicache.reference.model import ReferenceModel
from hicache.reference.model_spec import ModelSpec
from hicache.core.types import Row

from .helpers import SENTINEL, make_hc

SPEC = ModelSpec(vocab=97, hidden=32, num_layers=2, num_q_heads=4, mlp=48, kind="mha",
                 num_kv_heads=2, head_dim=8, seed=3)
N = 22  # 5 full pages of 4 and a partial one


@pytest.fixture(scope="module")
def model():
    return ReferenceModel(SPEC)


def prompt():
    return torch.randint(1, 97, (N,), generator=torch.Generator().manual_seed(4)).tolist()


def prefill_cp1(model, layout):
    hc = make_hc(layout)
    req = hc.new_request("p", prompt())
    hc.admit(req)
    req.alloc(N)
    out = model.forward_chunk(hc.device_pool, prompt(), 0, hc.device_pool.slot_ids(req.pages))
    req.commit(draft_tokens=N - 1)
    return hc, req, out


def decode(model, hc, req, out, steps=5):
    """Greedy decode with the draft head, from a prefill's metadata (first token, hidden row)."""
    tok, hidden, toks, logits = int(out.logits_last.argmax()), out.hidden_last, [], []
    for _ in range(steps):
        pos = req.num_tokens
        req.extend([tok])
        req.alloc(1)
        o = model.decode_step(hc.device_pool, tok, pos, hc.device_pool.slot_ids(req.pages), pending_hidden=hidden)
        req.commit(1)
        tok, hidden = int(o.logits_last.argmax()), o.hidden_last
        toks.append(tok)
        logits.append(o.logits_last)
    return toks, torch.stack(logits)


@pytest.mark.parametrize("cp_size", [2, 4])
def test_ranks_hold_only_their_pages_and_assemble_to_cp1_bytes(model, cp_size):
    layout = SPEC.kv_layout(4, "page_first", draft_layers=1)
    ref_hc, ref_req, ref_out = prefill_cp1(model, layout)
    ref_pool, ps = ref_hc.device_pool, layout.page_size
    pages = -(-N // ps)
    ref_slots = ref_pool.slot_ids(ref_req.pages)
    glob = [torch.cat([b[ref_slots[:N]], torch.full((pages * ps - N, *b.shape[1:]), SENTINEL)])
            for b in ref_pool.buffers]  # global-order rows, page tail poisoned

    ranks = []
    for r in range(cp_size):
        hc = make_hc(layout.replace(cp_rank=r, cp_size=cp_size))
        req = hc.new_request("p", prompt())
        hc.admit(req)
        req.alloc(N)
        order = hc.cache.row_order
        rr = [RequestRows(0, N, req.pages)]
        batch = rank_batch(order, r, rr, static_rows=16)
        pos = batch.positions.clamp(min=0)
        rows = [g[pos].masked_fill((batch.provenance != Row.VALID).view(-1, *[1] * (g.dim() - 1)), SENTINEL)
                for g in glob]
        assert store_batch(hc.device_pool, range(len(layout.planes)), rows, batch, order, r, rr) == \
            len(order.local_positions(0, N, r))
        req.commit(draft_tokens=N - 1)
        hc.drain()
        ranks.append((hc, req))

    own = ranks[0][0].cache.ownership
    for r, (hc, req) in enumerate(ranks):
        pool = hc.device_pool
        assert len(req.pages) == own.count(0, pages, r)
        written = {p for p in range(pool.num_pages) if any(bool(b[p * ps:(p + 1) * ps].ne(0).any())
                                                           for b in pool.buffers)}
        assert written == set(req.pages)  # nothing outside the rank's own pages
        mine = [j for j in range(pages) if own.owner(j) == r]
        for k, j in enumerate(mine):  # and each holds exactly that logical page of the cp1 run
            for b, rb in zip(pool.buffers, ref_pool.buffers):
                p, q = req.pages[k], ref_req.pages[j]
                assert torch.equal(b[p * ps:(p + 1) * ps], rb[q * ps:(q + 1) * ps]), (r, j)
        hc.check_integrity()
    assert [r for r, _ in page_sources(own, pages, [RankPages(h.device_pool, q.pages) for h, q in ranks])] == \
        [j % cp_size for j in range(pages)]

    # decode side (no CP): import every page, partial last page included, from the ranks' L1
    dec = make_hc(layout)
    dreq = dec.new_request("d", prompt())
    dec.admit(dreq)
    dreq.alloc(N)
    assemble(own, [RankPages(h.device_pool, q.pages) for h, q in ranks], dec.device_pool, dreq.pages)
    dreq.commit(draft_tokens=N - 1)
    d_slots = dec.device_pool.slot_ids(dreq.pages)
    for a, b in zip(dec.device_pool.buffers, ref_pool.buffers):
        assert torch.equal(a[d_slots], b[ref_slots])
    # ... and decodes exactly as the cp1 run, bit for bit (metadata: first token, hidden row)
    toks, logits = decode(model, dec, dreq, ref_out)
    ref_toks, ref_logits = decode(model, ref_hc, ref_req, ref_out)
    assert toks == ref_toks and torch.equal(logits, ref_logits)
    dec.check_integrity()

    # the full pages also assemble from the ranks' L2 (their write-through copies)
    full = N // ps
    host = []
    for hc, req in ranks:
        m = hc.cache.match(prompt())
        host.append(RankPages(hc.host_pool, hc.cache.tree.pages(m.device_node, full, host=True)))
    dec2 = make_hc(layout)
    dst = dec2.device_pool.allocator.alloc(full)
    assemble(own, host, dec2.device_pool, dst)
    s2 = dec2.device_pool.slot_ids(dst)
    for a, b in zip(dec2.device_pool.buffers, ref_pool.buffers):
        assert torch.equal(a[s2], b[ref_slots[:full * ps]])
    for hc in [h for h, _ in ranks] + [ref_hc, dec, dec2]:
        hc.close()


def test_assemble_refuses_a_rank_with_the_wrong_page_count():
    layout = SPEC.kv_layout(4, draft_layers=1)
    hc = make_hc(layout.replace(cp_rank=0, cp_size=2))
    own = hc.cache.ownership
    with pytest.raises(ValueError, match="rank 1 lists 2 pages, it owns 3"):
        page_sources(own, 6, [RankPages(hc.device_pool, [0, 1, 2]), RankPages(hc.device_pool, [3, 4])])
    with pytest.raises(ValueError, match="got pages of 1 ranks, cp_size is 2"):
        page_sources(own, 6, [RankPages(hc.device_pool, [0, 1, 2])])
    hc.close()
