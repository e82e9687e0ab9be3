"""Hit rules, table-driven: page-floored prefixes, namespaces, splits, eviction order."""
from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from hicache.core.errors import CacheStateError, StaleMatch
from hicache.core.hashing import page_hashes, tokens_to_bytes

A = list(range(100, 116))  # 4 pages of 4 tokens, cached as pages [0, 1, 2, 3]

HIT_CASES = [
    # (name, query tokens, namespace, cache.match device_tokens, req.match device_tokens)
    ("same prompt", A, "", 16, 12),  # a request keeps its last token to compute
    ("longer prompt", A + [1, 2, 3, 4, 5], "", 16, 16),
    ("partial last page", A[:10], "", 8, 8),
    ("diverge at page boundary", A[:8] + [7] * 8, "", 8, 8),
    ("diverge mid page", A[:6] + [7] * 10, "", 4, 4),
    ("diverge in first page", A[:3] + [7] * 13, "", 0, 0),
    ("miss", [7] * 16, "", 0, 0),
    ("other namespace", A, "lora-1", 0, 0),
    ("shorter than a page", A[:3], "", 0, 0),
]


@pytest.mark.parametrize("name,query,ns,dev,req_dev", HIT_CASES, ids=[c[0] for c in HIT_CASES])
def test_hit_rules(mk, run_req, name, query, ns, dev, req_dev):
    c = mk()
    run_req(c, "a", A)
    m = c.match(query, ns)
    assert (m.device_tokens, m.host_tokens, m.exact_tokens) == (dev, 0, dev)
    assert m.device_pages == [0, 1, 2, 3][:dev // 4]
    r = c.new_request("q", query, ns)
    rm = r.match()
    assert (rm.device_tokens, rm.exact_tokens) == (req_dev, req_dev)
    r.lock(rm)
    assert r.pages == [0, 1, 2, 3][:req_dev // 4] and r.computed_tokens == req_dev
    c.check_integrity()


@pytest.mark.parametrize("form", ["list", "numpy", "tensor", "bytes"])
def test_token_forms_match_alike(mk, run_req, form):
    c = mk()
    run_req(c, "a", A)
    q = A[:13]
    arg = {"list": q, "numpy": np.array(q, dtype=np.int64), "tensor": torch.tensor(q),
           "bytes": tokens_to_bytes(q)}[form]
    assert c.match(arg).device_tokens == 12
    assert c.match(q, max_tokens=9).device_tokens == 8


def test_namespaces_never_share_pages(mk, run_req):
    c = mk()
    run_req(c, "a", A, "ns1")
    run_req(c, "b", A, "ns2")
    assert c.match(A, "ns1").device_pages == [0, 1, 2, 3]
    assert c.match(A, "ns2").device_pages == [4, 5, 6, 7]
    assert c.match(A).device_tokens == 0
    n1, n2 = c.match(A, "ns1").device_node, c.match(A, "ns2").device_node
    assert c.tree.hashes(n1) != c.tree.hashes(n2)
    assert c.tree.hashes(n1) == page_hashes(A, 4, "ns1")


def test_node_split_shares_prefix_and_frees_duplicates(mk, run_req):
    c = mk()
    run_req(c, "a", A)
    b = A[:8] + [1, 2, 3, 4, 5, 6, 7, 8]
    r = run_req(c, "b", b)
    assert c.tree.num_nodes == 3  # [A0 A1] -> {[A2 A3], [b2 b3]}
    assert c.match(b).device_pages == [0, 1, 4, 5]
    assert c.match(A).device_pages == [0, 1, 2, 3]
    top = c.match(A[:8]).device_node
    assert top.num_pages == 2 and len(top.children) == 2
    assert c.tree.hashes(c.match(b).device_node) == page_hashes(b, 4)[2:]
    assert c.stats().inserted_pages == 6 and r.state.value == "finished"


def test_two_requests_compute_the_same_pages(mk):
    """The second insert keeps the index's ids; the duplicate is freed and swapped in."""
    c = mk()
    r1, r2 = c.new_request("1", A), c.new_request("2", A)
    for r in (r1, r2):
        r.lock(r.match())
        r.alloc(16)
    assert (r1.pages, r2.pages) == ([0, 1, 2, 3], [4, 5, 6, 7])
    r1.commit(), r2.commit(10)
    assert r2.pages == [0, 1, 6, 7] and r2.private_pages == [6, 7]
    c.check_integrity()
    assert c.device_allocator.num_free == 32 - 6
    r2.commit()
    r1.finish(), r2.finish()
    c.check_integrity()
    assert c.stats().duplicate_pages == 4 and c.device_allocator.num_free == 28


def test_bisection_against_brute_force(mk):
    """Random shared-prefix prompts: every match equals the longest cached page prefix."""
    rng = random.Random(7)
    c = mk(pages=4096)
    bases = [[rng.randrange(50) for _ in range(rng.randrange(0, 40))] for _ in range(4)]
    cached: list[list[int]] = []
    for i in range(40):
        t = rng.choice(bases) + [rng.randrange(3) for _ in range(rng.randrange(1, 60))]
        r = c.new_request(str(i), t)
        r.lock(r.match())
        r.alloc(len(t) - r.allocated_tokens)
        r.commit()
        r.finish()
        cached.append(t)
        q = rng.choice(bases) + [rng.randrange(3) for _ in range(rng.randrange(0, 60))]
        best = max(_lcp(q, x) // 4 * 4 for x in cached)
        assert c.match(q).device_tokens == best
    c.check_integrity()


def _lcp(a, b):
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


@pytest.mark.parametrize("policy,evicted_first", [("lru", "old"), ("lfu", "cold"), ("fifo", "old")])
def test_eviction_order(mk, run_req, policy, evicted_first):
    c = mk(eviction=policy)
    old, cold = [1] * 8, [2] * 8
    run_req(c, "old", old)
    for i in range(3):  # make "old" popular, then touch "cold" last
        run_req(c, f"hot{i}", old + [9])
    run_req(c, "cold", cold)
    assert c.evict(2) == 2  # page-granular: exactly what was asked
    victim = old if evicted_first == "old" else cold
    assert c.match(victim).device_tokens == 0
    assert c.match(cold if victim is old else old).device_tokens == 8
    c.check_integrity()


def test_locked_prefix_is_never_evicted(mk, run_req):
    c = mk(pages=8)
    run_req(c, "a", A)
    r = c.new_request("b", A)
    r.lock(r.match())  # pins pages 0..2 (12 tokens hit): the node is split
    assert c.evict(100) == 1  # only the unlocked last page goes
    assert c.match(A).device_pages == [0, 1, 2]
    c.check_integrity()
    r.abort()
    assert c.evict(100) == 3 and c.device_allocator.num_free == 8
    c.check_integrity()


def test_alloc_evicts_then_raises(mk, run_req):
    c = mk(pages=6)
    run_req(c, "a", A)  # 4 pages cached, 2 free
    r = c.new_request("b", [9] * 20)
    r.lock(r.match())
    assert len(r.alloc(16)) == 4  # evicts A's last two pages (page-granular: what was short)
    assert c.match(A).device_tokens == 8 and c.stats().device_evicted_pages == 2
    with pytest.raises(Exception, match="need 2 pages, 2 free|nothing evictable"):
        r2 = c.new_request("c", [8] * 12)
        r2.lock(r2.match())
        r2.alloc(12)
    c.check_integrity()


def test_stale_match_is_refused(mk, run_req):
    c = mk()
    run_req(c, "a", A)
    r = c.new_request("b", A)
    m = r.match()
    c.evict(1)
    with pytest.raises(StaleMatch, match="epoch 0"):
        r.lock(m)
    r.lock(r.match())
    with pytest.raises(CacheStateError, match="needs state waiting/preempted"):
        r.lock(r.match())
