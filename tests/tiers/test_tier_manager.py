"""The two-phase tier manager with no pools and no copies (tiny shapes, exact ids
and eviction order): what each prepare_* reserves and pins, what each
complete_* records, and that L1 pages may come from hicache or the engine."""
from __future__ import annotations

import pytest

from hicache.memory.allocator import PageAllocator
from hicache.index.prefix_cache import PrefixCache, as_key
from hicache.core.hashing import page_hashes
from hicache.core.layout import KVLayout
from hicache.tiers.manager import TierManager

PS = 4
X = list(range(100, 116))  # 4 pages
Y = list(range(200, 208))  # 2 pages


def make(device_pages=8, host_pages=8, device=None):
    lay = KVLayout("tiny", 1, num_kv_heads=1, head_dim=2, page_size=PS)
    c = PrefixCache(lay, device or PageAllocator(device_pages, "L1"), PageAllocator(host_pages, "L2"))
    return c, TierManager(c)


def compute(c, rid, toks):
    r = c.new_request(rid, toks + [0])
    r.lock(r.match())
    r.alloc(len(toks))
    r.commit()
    r.finish()
    return c.match(toks).device_node


def check(c, tm):
    c.check_integrity(host_in_flight=tm.host_in_flight)
    tm.check_integrity()


def test_backup_pins_until_complete_and_records_the_copy():
    c, tm = make()
    node = compute(c, "x", X)
    plan = tm.prepare_backup(node)
    assert (plan.device, plan.host, plan.pinned) == ([0, 1, 2, 3], [0, 1, 2, 3], True)
    assert node.lock_ref == 1 and c.device_victims(100) == [] and tm.host_in_flight == [0, 1, 2, 3]
    check(c, tm)
    assert tm.complete_backup(plan, ok=True) == [node]
    assert node.host_pages == [0, 1, 2, 3] and node.lock_ref == 0 and tm.host_in_flight == []
    assert tm.stats.backup_pages == 4
    check(c, tm)


def test_failed_backup_frees_its_l2_pages():
    c, tm = make()
    node = compute(c, "x", X)
    plan = tm.prepare_backup(node)
    assert tm.complete_backup(plan, ok=False) == []
    assert node.host_pages is None and c.host_allocator.num_free == 8 and tm.stats.transfer_errors == 1
    check(c, tm)


def test_backup_evicts_l2_in_lru_order_and_never_pinned_pages():
    c, tm = make(device_pages=16, host_pages=6)
    a = compute(c, "a", Y)
    b = compute(c, "b", [300 + i for i in range(8)])
    tm.complete_backup(tm.prepare_backup(a), True)  # L2: a = [0, 1]
    tm.complete_backup(tm.prepare_backup(b), True)  # L2: b = [2, 3]
    store = tm.prepare_store(a)  # pins a on L2
    x = compute(c, "x", X)
    plan = tm.prepare_backup(x)  # needs 4, 2 free: evicts b (a is pinned)
    assert plan.host == [3, 2, 4, 5] and b.host_pages is None and a.host_pages == [0, 1]
    tm.complete_store(store, 2)
    assert tm.prepare_backup(compute(c, "y", [400 + i for i in range(12)])) is None  # x's L2 is reserved
    assert tm.stats.backup_dropped_pages == 3
    tm.complete_backup(plan, True)
    check(c, tm)


@pytest.mark.parametrize("owner", ["hicache", "engine"])
def test_load_back_pins_its_pages_until_complete(owner):
    engine = EngineBlocks(8) if owner == "engine" else None
    c, tm = make(device=engine.allocator if engine else None)
    blocks = engine or c  # whoever owns L1 hands prepare_load its pages
    node = compute(c, "x", X)
    tm.complete_backup(tm.prepare_backup(node), True)
    c.evict(100)  # X is L2-only now
    m = c.match(X + [0])
    assert (m.device_tokens, m.host_tokens) == (0, 16)
    req = tm.plan_load(m)
    assert req.num_pages == 4 and req.last.host_lock_ref == 1
    assert tm.evict_host(100) == []  # pinned on L2 from plan_load on
    plan = tm.prepare_load(req, blocks.alloc_device(req.num_pages))
    assert (plan.host, plan.device) == ([0, 1, 2, 3], [3, 2, 1, 0])  # LIFO: the ids X freed
    assert c.match(X + [0]).device_tokens == 16 and plan.last.lock_ref == 1 and plan.last.host_lock_ref == 1
    assert c.evict(100) == 0  # the load pins the L1 pages it fills
    check(c, tm)
    tm.complete_load(plan, ok=True)
    assert (plan.last.lock_ref, plan.last.host_lock_ref, tm.stats.load_back_pages) == (0, 0, 4)
    assert c.evict(100) == 4 and tm.evict_host(100) == [0, 1, 2, 3]
    check(c, tm)


def test_cancelled_load_releases_its_pins():
    c, tm = make()
    node = compute(c, "x", X)
    tm.complete_backup(tm.prepare_backup(node), True)
    c.evict(100)
    req = tm.plan_load(c.match(X + [0]))
    tm.cancel_load(req)
    assert req.last.host_lock_ref == 0 and tm.evict_host(100) == [0, 1, 2, 3]
    check(c, tm)


def test_store_flags_the_node_only_when_every_page_landed():
    c, tm = make()
    node = compute(c, "x", X)
    tm.complete_backup(tm.prepare_backup(node), True)
    plan = tm.prepare_store(node)
    assert plan.hashes == page_hashes(X, PS) and plan.host == [0, 1, 2, 3] and node.host_lock_ref == 1
    tm.complete_store(plan, 3)
    assert not node.in_storage and tm.stats.storage_put_dropped_pages == 1
    tm.complete_store(tm.prepare_store(node), 4)
    assert node.in_storage and tm.prepare_store(node) is None and node.host_lock_ref == 0
    check(c, tm)


def test_prefetch_indexes_the_pages_that_landed_and_frees_the_rest():
    c, tm = make()
    compute(c, "y", X[:4])  # page 0 on L1 (and L2 below)
    tm.complete_backup(tm.prepare_backup(c.match(X[:4]).device_node), True)
    hashes = page_hashes(X, PS)
    plan = tm.prepare_prefetch(as_key(X), "", 1, hashes[1:4])
    assert plan.host == [1, 2, 3] and tm.host_in_flight == [1, 2, 3]
    check(c, tm)
    assert tm.complete_prefetch(plan, 2) == 2
    m = c.match(X)
    assert (m.device_tokens, m.host_tokens) == (4, 8) and m.host_node.in_storage
    assert c.host_allocator.num_free == 8 - 1 - 2 and tm.stats.prefetch_pages == 2
    check(c, tm)


class EngineBlocks:
    """An engine that owns L1 allocation (e.g. a block pool); the index shares its allocator."""

    def __init__(self, n: int):
        self.allocator = PageAllocator(n, "engine L1")

    def alloc_device(self, n):
        return self.allocator.alloc(n)

    def free_device(self, ids):
        self.allocator.free(ids)
