"""Miss reasons page by page against a brute-force oracle.

The oracle names pages by their whole token prefix (no hashing), reads what is
cached by walking the tree, and gives every missed page its reason from first
principles: computed before here (``l1_evicted``, GPU-only), cached under another
namespace now (``other_namespace``), else ``first_use``; the last page is
``partial_page``. Random traces branch off earlier prompts at any page, so hits
end inside radix nodes as often as on their boundaries.
"""
from __future__ import annotations

import random

import pytest

from hicache.core.layout import KVLayout
from hicache.index.eviction import POLICIES
from hicache.index.misses import MissTracker, admission_misses
from hicache.index.prefix_cache import PrefixCache
from hicache.memory.allocator import PageAllocator

PS = 2


def cached_prefixes(cache: PrefixCache) -> set[tuple[str, tuple[int, ...]]]:
    """(namespace, tokens of pages 0..j) of every page on L1, by walking the tree."""
    out = set()
    for n in cache.tree.iter_nodes():
        if n.device_pages is None:
            continue
        path, m = [], n
        while m.parent is not None:
            path.append(m.tokens)
            m = m.parent
        toks = [t for part in reversed(path) for t in part]
        for j in range(n.start_page, n.start_page + n.num_pages):
            out.add((n.namespace, tuple(toks[:(j + 1) * PS])))
    return out


def oracle(toks: list[int], ns: str, cached: set, computed: set, namespaces: set[str]) -> tuple[int, list[str]]:
    """(hit pages, reason of each missed page) for ``toks`` in ``ns``."""
    n = len(toks)
    cap, pages = (n - 1) // PS, -(-n // PS)
    hit = 0
    while hit < cap and (ns, tuple(toks[:(hit + 1) * PS])) in cached:
        hit += 1
    reasons = []
    for j in range(hit, cap):
        pre = tuple(toks[:(j + 1) * PS])
        if (ns, pre) in computed:
            reasons.append("l1_evicted")
        elif any(all((o, tuple(toks[:(i + 1) * PS])) in cached for i in range(j + 1)) for o in namespaces - {ns}):
            reasons.append("other_namespace")
        else:
            reasons.append("first_use")
    return hit, reasons + ["partial_page"] * (pages - max(hit, cap))


def random_trace(rng: random.Random, n: int) -> list[tuple[list[int], str]]:
    """Prompts that extend or branch off earlier ones at any page or token."""
    out: list[tuple[list[int], str]] = []
    for _ in range(n):
        if out and rng.random() < 0.75:
            base, ns = rng.choice(out)
            cut = rng.randrange(0, len(base) + 1)
            toks = base[:cut] + [rng.randrange(1, 4) for _ in range(rng.randrange(1, 9))]
            ns = ns if rng.random() < 0.85 else rng.choice(["", "a"])
        else:
            toks, ns = [rng.randrange(1, 4) for _ in range(rng.randrange(1, 13))], rng.choice(["", "", "a"])
        out.append((toks, ns))
    return out


def drive(policy: str, seed: int, l1_pages: int) -> int:
    """Replay a random trace, checking every admission's reasons page by page; pages compared."""
    lay = KVLayout("t", 1, num_kv_heads=1, head_dim=1, page_size=PS)
    cache = PrefixCache(lay, PageAllocator(l1_pages), eviction=policy)
    tracker = MissTracker(window=1 << 20)
    rng = random.Random(seed)
    computed: set = set()
    checked = 0
    for i, (toks, ns) in enumerate(random_trace(rng, 150)):
        cached = cached_prefixes(cache)
        namespaces = {k for k, _ in cached}
        want_hit, want = oracle(toks, ns, cached, computed, namespaces)
        req = cache.new_request(f"r{i}", toks, ns)
        m = req.match()
        req.lock(m)
        got: list[str] = []
        admission_misses(tracker, cache, req.key, ns, m.device_tokens, m.device_node, None, per_page=got)
        assert (m.device_tokens // PS, got) == (want_hit, want), (i, toks, ns)
        req.alloc(len(toks) - req.computed_tokens)
        req.commit()
        req.finish()
        cache.check_integrity()
        tracker.check_integrity()
        computed.update((ns, tuple(toks[:(j + 1) * PS])) for j in range(len(toks) // PS))
        checked += len(got)
    return checked


@pytest.mark.parametrize("policy", sorted(POLICIES))
@pytest.mark.parametrize("seed", range(4))
def test_reasons_page_by_page_match_the_oracle(policy, seed):
    assert drive(policy, seed, l1_pages=10) > 300


def test_a_hit_ending_inside_a_node_chains_from_the_last_hit_page():
    # The reproducer at the index level: [1 2 3 4 5], [1 2 10 11 12] (its hit ends inside
    # the first node), two 6-page fillers, then [1 2 10 11 13]: pages 1 2 10 11 were computed before.
    lay = KVLayout("t", 1, num_kv_heads=1, head_dim=1, page_size=1)
    cache = PrefixCache(lay, PageAllocator(6), eviction="lru")
    tracker = MissTracker(window=100)
    for i, toks in enumerate([[1, 2, 3, 4, 5], [1, 2, 10, 11, 12], list(range(20, 26)), list(range(30, 36)),
                              [1, 2, 10, 11, 13]]):
        req = cache.new_request(f"r{i}", toks)
        m = req.match()
        req.lock(m)
        admission_misses(tracker, cache, req.key, "", m.device_tokens, m.device_node, None)
        req.alloc(len(toks) - req.computed_tokens)
        req.commit()
        req.finish()
    s = tracker.stats
    assert (s.first_use, s.l1_evicted, s.partial_page) == (16, 4, 5)
