"""The persistent eviction heaps (built-in policies) evict exactly what a fresh
per-call scan over all candidates would, on L1 and on L2."""
import random

import pytest

from hicache.allocator import PageAllocator
from hicache.cache import PrefixCache
from hicache.eviction import LFU, LRU
from hicache.layout import KVLayout


class ScanLRU(LRU):
    name = "scan-lru"  # not a built-in: the tree falls back to a per-call scan


class ScanLFU(LFU):
    name = "scan-lfu"


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
                c.set_host(n, c.host_allocator.alloc(len(n.device_pages)))
        if step % 7 == 3:
            log.append(("L1", c.evict(rng.randrange(1, 6)), c.stats().device_pages_cached))
        if step % 11 == 5:
            log.append(("L2", sorted(c.evict_host(rng.randrange(1, 6))), c.stats().host_pages_cached))
        c.check_integrity()
    return log


@pytest.mark.parametrize("builtin,scan", [("lru", ScanLRU()), ("lfu", ScanLFU())])
@pytest.mark.parametrize("seed", range(6))
def test_heap_eviction_equals_scan(builtin, scan, seed):
    log = drive(builtin, seed)
    assert any(e[0] == "L1" and e[1] for e in log) and any(e[0] == "L2" and e[1] for e in log)
    assert log == drive(scan, seed)
