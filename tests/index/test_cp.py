"""Context parallelism: page ownership, per-rank page lists, floored hits, row order."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from hicache.core.cp import Blocked, CPRowOrder, RoundRobin, make_ownership

T = list(range(400, 422))  # 22 tokens: 5 full pages + 2 tokens


@pytest.mark.parametrize("own", [RoundRobin(1), RoundRobin(2), RoundRobin(4), RoundRobin(3),
                                 Blocked(2, 2), Blocked(3, 4)], ids=repr)
def test_ownership_counts_match_brute_force(own):
    for rank in range(own.cp_size):
        for a in range(0, 12):
            for b in range(a, 20):
                assert own.count(a, b, rank) == sum(own.owner(j) == rank for j in range(a, b))


def test_make_ownership_checks_names_and_sizes():
    assert make_ownership("round_robin", 2).owner(3) == 1
    with pytest.raises(ValueError, match="known: \\['blocked', 'round_robin'\\]"):
        make_ownership("zigzag", 2)
    with pytest.raises(ValueError, match="cp_size=4"):
        make_ownership(RoundRobin(2), 4)


@pytest.mark.parametrize("cp_size", [1, 2, 4])
def test_each_rank_holds_only_its_pages_and_hits_agree(mk, cp_size):
    ranks = [mk(cp_size=cp_size, cp_rank=r) for r in range(cp_size)]
    hits = []
    for rank, c in enumerate(ranks):
        r = c.new_request("a", T)
        r.lock(r.match())
        r.alloc(22)
        owned = [j for j in range(6) if j % cp_size == rank]
        assert len(r.pages) == len(owned)  # one id per owned logical page, partial page included
        r.commit()
        assert r.private_pages == (r.pages[-1:] if 5 % cp_size == rank else [])
        assert r.match().exact_tokens == 21  # own refresh: exact, capped at all-but-last token
        pages = list(r.pages)
        r.finish()
        c.check_integrity()
        m = c.match(T)
        assert m.device_pages == pages[:len([j for j in owned if j < 5])]
        assert c.device_allocator.num_used == len([j for j in owned if j < 5])
        b = c.new_request("b", T[:14] + [1, 2, 3])  # diverges in logical page 3
        mb = b.match()
        b.lock(mb)
        hits.append((m.device_tokens, mb.device_tokens, mb.exact_tokens))
        assert len(b.pages) == len([j for j in range(3) if j % cp_size == rank])
        c.check_integrity()
        assert c.evict(100) == 2  # the unlocked branch (logical pages 3, 4) on every rank
        c.check_integrity()
    assert hits == [(20, 12, 12)] * cp_size  # page-floored and identical on every rank


def test_row_order_positions_round_robin():
    ro = CPRowOrder(RoundRobin(2), 4)
    assert ro.local_positions(0, 22, 0).tolist() == [0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19]
    assert ro.local_positions(0, 22, 1).tolist() == [4, 5, 6, 7, 12, 13, 14, 15, 20, 21]
    assert ro.local_positions(6, 13, 0).tolist() == [8, 9, 10, 11]
    assert ro.local_positions(6, 13, 1).tolist() == [6, 7, 12]


@pytest.mark.parametrize("own", [RoundRobin(1), RoundRobin(2), RoundRobin(4), Blocked(2, 3)], ids=repr)
@pytest.mark.parametrize("start,n", [(0, 22), (5, 17), (16, 1), (3, 0)])
def test_row_order_round_trip(own, start, n):
    ro = CPRowOrder(own, 4)
    rows = torch.arange(start, start + n, dtype=torch.float32)[:, None].repeat(1, 3)
    per_rank = [ro.to_local(rows, start, r) for r in range(own.cp_size)]
    for r, loc in enumerate(per_rank):
        assert loc[:, 0].long().tolist() == ro.local_positions(start, start + n, r).tolist()
    assert torch.equal(ro.to_global(per_rank, start), rows)
    if own.cp_size > 1 and n > 8:
        with pytest.raises(ValueError, match="owns"):
            ro.to_global([per_rank[0][:-1]] + per_rank[1:], start)


def test_local_rows_address_the_ranks_page_table(mk):
    """Local row i of rank r lives at slot pages[i // ps] * ps + i % ps of that rank."""
    c = mk(cp_size=2, cp_rank=1)
    r = c.new_request("a", T)
    r.lock(r.match())
    r.alloc(22)
    pos = c.row_order.local_positions(0, 22, 1)
    slots = np.array([r.pages[i // 4] * 4 + i % 4 for i in range(len(pos))])
    assert pos.tolist() == [4, 5, 6, 7, 12, 13, 14, 15, 20, 21]
    assert slots.tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 8, 9]
