"""ghost_lru, the segmented learning policy: its per-segment lazy heaps choose exactly
the candidate a scan over every L1 leaf would (smallest key + current offset), it is
plain LRU until evidence moves it, and it learns on the workloads it was built for."""
from __future__ import annotations

import random

import pytest

from hicache.core.layout import KVLayout
from hicache.index.eviction import GhostLRU, depth_class
from hicache.index.prefix_cache import PrefixCache
from hicache.memory.allocator import PageAllocator

PS = 2


def serve(cache: PrefixCache, rid: str, toks: list[int]) -> int:
    req = cache.new_request(rid, toks)
    req.lock(req.match())
    hit = req.computed_tokens
    req.alloc(len(toks) - hit)
    req.commit()
    req.finish()
    return hit


def scan_first(cache: PrefixCache) -> object:
    """The victim a scan picks: the unpinned L1 leaf with the smallest key + offset."""
    pol = cache.policy
    leaves = [n for n in cache.tree.device_candidates.leaves if not n.lock_ref]
    return min(leaves, key=lambda n: (pol.key(n)[0] + pol.offset(pol.segment(n)), n.nid))


def sessions(rng: random.Random, n: int, deep_reuse: bool):
    """Conversations that come back (deep, growing) and one-off prompts (shallow)."""
    convs: list[list[int]] = []
    for i in range(n):
        if convs and rng.random() < 0.6:
            c = rng.randrange(len(convs)) if deep_reuse else len(convs) - 1
            convs[c] = convs[c] + [rng.randrange(1, 50) for _ in range(rng.randrange(2, 7))]
            yield f"r{i}", convs[c]
        else:
            toks = [rng.randrange(50, 99) for _ in range(rng.randrange(3, 9))]
            convs.append(toks)
            yield f"r{i}", toks


@pytest.mark.parametrize("seed", range(5))
def test_segment_heaps_choose_what_a_scan_chooses(seed):
    rng = random.Random(seed)
    lay = KVLayout("t", 1, num_kv_heads=1, head_dim=1, page_size=PS)
    cache = PrefixCache(lay, PageAllocator(40), eviction="ghost_lru")
    pol = cache.policy
    pol.trust, pol.beta_depth, pol.beta_hit, pol.age = 1.0, 0.7, 0.4, 30.0  # offsets on from the start
    checked = 0
    for rid, toks in sessions(rng, 300, deep_reuse=True):
        serve(cache, rid, toks)
        if rng.random() < 0.3 and cache.tree.device_candidates.leaves:
            want = scan_first(cache)
            got = cache.device_victims(1)
            assert got and got[0] is want, (rid, got[:1], want)
            checked += 1
        cache.check_integrity()
    assert checked > 50


def test_segments_only_grow_with_a_node():
    assert [depth_class(p) for p in (0, 1, 2, 3, 4, 8, 31, 32, 10_000)] == [0, 0, 1, 1, 2, 3, 4, 5, 5]
    offsets = GhostLRU()
    offsets.beta_depth, offsets.beta_hit, offsets.age, offsets.trust = 0.3, 1.2, 10.0, 1.0
    # a split raises start_page, a hit raises hit_count: every move lands on an offset at least as large
    for d in range(6):
        for h in (0, 1):
            s = 2 * d + h
            for s2 in {2 * d2 + h2 for d2 in range(d, 6) for h2 in range(h, 2)}:
                assert offsets.offset(s2) >= offsets.offset(s), (s, s2)


def run(policy: str, reqs, pages: int) -> tuple[int, PrefixCache]:
    lay = KVLayout("t", 1, num_kv_heads=1, head_dim=1, page_size=PS)
    cache = PrefixCache(lay, PageAllocator(pages), eviction=policy)
    return sum(serve(cache, rid, toks) for rid, toks in reqs), cache


def test_it_is_lru_until_evidence_moves_it():
    reqs = list(sessions(random.Random(7), 60, deep_reuse=False))
    lru, _ = run("lru", reqs, 30)
    got, cache = run("ghost_lru", reqs, 30)
    assert cache.policy.trust == 0.0 and got == lru  # no disagreement won: every choice was LRU's


def node(nid: int, start: int, pages: int, hits: int = 0, last: int = 0):
    from hicache.index.node import Node
    key = b"".join(bytes([nid % 251, j % 251]) * (2 * PS) for j in range(pages))
    return Node(key, pages, start, None, "", nid, last_access=last, hit_count=hits)


def test_ghost_hits_on_deep_victims_raise_the_depth_offset_and_disagreements_move_trust():
    pol = GhostLRU()
    pol.now = 100
    for i in range(20):  # shallow victims, never back
        pol.evicted(node(i, 0, 1, last=90))
    deep = node(99, 40, 3, last=50)
    pol.evicted(deep)
    pol.added(_same(deep, 120))  # recomputed: a ghost hit
    assert pol.ghost_hits == 3 and pol.beta_depth > 0 and pol.trust == 0.0
    # LRU would evict `a`, the offsets `b`; `a` is hit again: evidence for the offsets
    a, b = node(300, 0, 2, last=10), node(301, 40, 2, last=20)
    pol.compared(b, a)
    pol.touched(a)
    assert pol.gained == 2 and pol.trust == pytest.approx(2 * GhostLRU.trust_step)
    c, d = node(302, 0, 4, last=10), node(303, 40, 4, last=20)
    pol.compared(d, c)
    pol.touched(d)  # the offsets would have evicted d, which was used: evidence for LRU
    assert pol.lost == 4 and pol.trust == 0.0  # clamped: back to LRU


def _same(n, last: int):
    from hicache.index.node import Node
    return Node(n.key, n.num_pages, n.start_page, None, n.namespace, n.nid + 1000, last_access=last)
