"""A request's life: chunked prefill, decode, preemption, abort; exact accounting."""
from __future__ import annotations

import pytest

from hicache.index.prefix_cache import RequestState
from hicache.core.errors import CacheStateError

P = list(range(200, 222))  # 22 tokens: 5 full pages + 2


def test_chunked_prefill_refresh_counts_own_partial_page(mk):
    c = mk()
    r = c.new_request("r", P)
    r.lock(r.match())
    assert r.alloc(10) == [0, 1, 2]
    assert r.commit() == 10
    # full pages shared, partial page private, own refresh counts it exactly
    assert (r.shared_pages, r.private_pages) == (2, [2])
    m = r.match()
    assert (m.device_tokens, m.exact_tokens) == (8, 10)
    # nobody else sees the partial page
    assert c.match(P).device_tokens == 8
    o = c.new_request("other", P)
    assert o.match().exact_tokens == 8
    c.check_integrity()
    assert r.alloc(8) == [3, 4]  # tokens 10..17 fill page 2 and use pages 3, 4
    assert r.commit(5) == 15  # only 5 of them computed so far
    assert (r.shared_pages, r.private_pages, r.match().exact_tokens) == (3, [3, 4], 15)
    c.check_integrity()
    r.commit()
    assert (r.computed_tokens, r.shared_pages, r.private_pages) == (18, 4, [4])
    o.abort()
    r.finish()
    c.check_integrity()
    assert c.device_allocator.num_free == 32 - 4 and c.match(P).device_pages == [0, 1, 2, 3]


def test_decode_extends_and_shares_full_pages(mk):
    c = mk()
    r = c.new_request("r", P[:6])
    r.lock(r.match())
    r.alloc(6), r.commit()
    for t in (7, 8, 9):
        r.extend([t])
        with pytest.raises(CacheStateError, match="extend"):
            r.alloc(2)
        r.alloc(1)
        r.commit()
    assert (r.computed_tokens, r.shared_pages, r.pages) == (9, 2, [0, 1, 2])
    r.finish()
    assert c.match(P[:6] + [7, 8, 9]).device_tokens == 8
    c.check_integrity()


@pytest.mark.parametrize("evict_prefix,want_exact,want_pages", [
    (False, 10, [0, 1, 2]),  # prefix survived: the private tail continues it
    (True, 0, []),  # prefix evicted: the tail is stale and freed on lock
])
def test_refresh_after_preemption(mk, evict_prefix, want_exact, want_pages):
    c = mk()
    r = c.new_request("r", P)
    r.lock(r.match())
    r.alloc(12)
    r.commit(10)
    r.preempt()
    assert r.state is RequestState.PREEMPTED and r.private_pages == [2]
    c.check_integrity()  # pages 0, 1 in the index (unlocked), page 2 private, 3 freed
    assert c.device_allocator.num_free == 29
    if evict_prefix:
        assert c.evict(10) == 2
    m = r.match()
    assert m.exact_tokens == want_exact and m.device_tokens == want_exact // 4 * 4
    r.lock(m)
    assert (r.computed_tokens, r.pages) == (want_exact, want_pages)
    c.check_integrity()
    r.alloc(len(P) - r.allocated_tokens)
    r.commit()
    r.finish()
    c.check_integrity()
    assert c.match(P).device_tokens == 20 and c.device_allocator.num_free == 27


def test_abort_releases_everything_and_shares_nothing_new(mk):
    c = mk()
    r = c.new_request("r", P)
    r.lock(r.match())
    r.alloc(22)
    r.commit(9)  # two pages shared
    r.abort()
    assert c.requests == {} and r.pages == []
    assert c.match(P).device_tokens == 8 and c.device_allocator.num_free == 30
    assert c.tree.match(r.key).device_node.lock_ref == 0
    c.check_integrity()
    with pytest.raises(CacheStateError, match="aborted"):
        r.commit()
    c.new_request("r", P).abort()  # the id is free again
    s = c.stats()
    assert (s.requests, s.requests_aborted, s.inserted_pages) == (2, 2, 2)


def test_abort_preempted_frees_its_tail(mk):
    c = mk()
    r = c.new_request("r", P)
    r.lock(r.match())
    r.alloc(7), r.commit()
    r.preempt()
    assert r.private_pages == [1]
    r.abort()
    assert c.device_allocator.num_free == 31
    c.check_integrity()


def test_request_misuse_names_the_fix(mk):
    c = mk()
    r = c.new_request("r", P)
    with pytest.raises(CacheStateError, match=r"alloc\(\) needs state running"):
        r.alloc(1)
    with pytest.raises(CacheStateError, match="already live"):
        c.new_request("r", P)
    r.lock(r.match())
    r.alloc(4)
    with pytest.raises(CacheStateError, match="only 4 tokens are allocated"):
        r.commit(5)


def test_stats_snapshot(mk, run_req):
    c = mk()
    run_req(c, "a", P)
    r = c.new_request("b", P[:13] + [1, 2, 3])
    r.lock(r.match())
    r.alloc(3), r.commit()
    s = c.stats().as_dict()
    assert {k: s[k] for k in ("requests", "requests_finished", "admitted_tokens", "device_hit_tokens",
                              "device_hit_exact_tokens", "inserted_pages", "device_pages_cached",
                              "device_pages_private", "device_pages_free", "nodes", "live_requests")} == {
        # "a" missed; "b" hit 3 pages, computed 3 tokens of its private 4th page; a's node split
        "requests": 2, "requests_finished": 1, "admitted_tokens": 22 + 16, "device_hit_tokens": 12,
        "device_hit_exact_tokens": 12, "inserted_pages": 5, "device_pages_cached": 5,
        "device_pages_private": 1, "device_pages_free": 26, "nodes": 2, "live_requests": 1}
