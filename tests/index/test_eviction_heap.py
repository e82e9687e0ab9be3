"""The persistent eviction heaps (policies whose key only grows) evict exactly
what a fresh per-call scan over all candidates would, on L1 and on L2; a
policy whose key can shrink (MRU) is never served from a heap."""
import random

import pytest

from hicache.memory.allocator import PageAllocator
from hicache.index.prefix_cache import PrefixCache
from hicache.core.errors import ConfigError
from hicache.index.eviction import FIFO, LFU, LRU, MRU, SLRU, make_policy
from hicache.core.layout import KVLayout


def scan(cls):
    """The same order, declared non-monotone: the index falls back to a per-call scan."""
    return type(f"Scan{cls.__name__}", (cls,), {"name": f"scan-{cls.name}", "monotone": False})()


def drive(policy, seed):
    lay = KVLayout("t", 1, num_kv_heads=1, head_dim=2, page_size=2)
    c = PrefixCache(lay, PageAllocator(400), PageAllocator(400), eviction=policy, host_eviction=policy)
    rng = random.Random(seed)
    log = []
    for step in range(120):
        toks = [rng.randrange(3) for _ in range(rng.randrange(2, 16))]
        r = c.new_request(f"r{step}", toks)
        m = r.match()
        r.lock(m)
        r.alloc(len(toks) - r.computed_tokens)
        r.commit()
        r.finish()
        for n in list(c.tree.iter_nodes()):  # back up whatever can be (L2 prefix-closed)
            if (n.host_pages is None and n.device_pages is not None and n.parent.host_pages is not None
                    and c.host_allocator.can_alloc(len(n.device_pages)) and rng.random() < 0.5):
                c.tree.set_host(n, c.host_allocator.alloc(len(n.device_pages)))
        if step % 7 == 3:
            log.append(("L1", c.evict(rng.randrange(1, 6)), c.stats().device_pages_cached))
        if step % 11 == 5:
            log.append(("L2", sorted(c.evict_host(rng.randrange(1, 6))), c.stats().host_pages_cached))
        c.check_integrity()
    return log


@pytest.mark.parametrize("cls", [LRU, LFU, FIFO, SLRU])
@pytest.mark.parametrize("seed", range(6))
def test_heap_eviction_equals_scan(cls, seed):
    log = drive(cls.name, seed)
    assert any(e[0] == "L1" and e[1] for e in log) and any(e[0] == "L2" and e[1] for e in log)
    assert log == drive(scan(cls), seed)


def test_mru_is_scanned_and_evicts_most_recent_first():
    lay = KVLayout("t", 1, num_kv_heads=1, head_dim=2, page_size=2)
    c = PrefixCache(lay, PageAllocator(16), eviction="mru")
    for rid, toks in (("a", [1, 1, 9]), ("b", [2, 2, 9]), ("c", [3, 3, 9])):
        r = c.new_request(rid, toks)
        r.lock(r.match())
        r.alloc(3)
        r.commit()
        r.finish()
    assert [n.tokens for n in c.device_victims(2)] == [[3, 3], [2, 2]]  # most recent first
    assert c.evict(2) == 2 and [n.tokens for n in c.device_victims(9)] == [[1, 1]]
    assert not c.tree.device_candidates._heaps  # a shrinking key never uses the lazy heap
    c.check_integrity()


def test_unknown_policy_is_a_config_error_and_custom_policies_declare_monotone():
    with pytest.raises(ConfigError, match="unknown eviction policy 'lfru'.*known: .*'slru'"):
        make_policy("lfru")

    class NoDeclaration:
        def key(self, node):
            return (node.nid,)
    with pytest.raises(TypeError, match="monotone"):
        make_policy(NoDeclaration())
    assert make_policy(MRU()).monotone is False
