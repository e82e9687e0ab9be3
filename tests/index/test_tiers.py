"""Tier records: L2 copies, what inserts create and what eviction would take (the
caller acts: write-through, write-back), host hits, L2 eviction, load back."""
from __future__ import annotations

import pytest

from hicache.core.errors import CacheStateError

X = list(range(300, 316))  # 4 pages
Y = X[:8] + [1, 2, 3, 4, 5, 6, 7, 8]  # shares 2 pages with X


def backup(c, node):
    """What a write-through controller does: copy, then record the L2 ids."""
    ids = c.host_allocator.alloc(len(node.device_pages))
    c.tree.set_host(node, ids)
    return ids


def backup_path(c, node):
    """Write-back: L2 must stay prefix-closed, so copy the ancestors first."""
    for n in c.tree.path(node):
        if n.host_pages is None:
            backup(c, n)


def evict_with(c, num_pages, write_back):
    """Eviction in three steps: the index chooses, the caller writes back, the index drops."""
    victims = c.device_victims(num_pages)
    for n in victims:
        write_back(c, n)
    return c.drop_device(victims)


def share(c, rid, tokens):
    """Run a request through commit; returns what its insert created (what write-through backs up)."""
    req = c.new_request(rid, tokens)
    req.lock(req.match())
    req.alloc(req.num_tokens - req.allocated_tokens)
    req._advance(None, None)
    res = req._share()
    req._adopt(res)
    req.finish()
    return res


def test_insert_returns_new_nodes_and_victims_are_a_pure_choice(mk):
    c = mk(host_pages=16)
    created = [(n.start_page, n.num_pages) for n in share(c, "x", X).created]
    created += [(n.start_page, n.num_pages) for n in share(c, "y", Y).created]
    assert created == [(0, 4), (2, 2)]
    before = [(n.nid, n.device_pages, n.lock_ref) for n in c.tree.iter_nodes()]
    victims = c.device_victims(2)
    assert [(n.start_page, n.device_pages) for n in victims] == [(2, [2, 3])]  # LRU: X's tail
    assert [(n.nid, n.device_pages, n.lock_ref) for n in c.tree.iter_nodes()] == before  # chose only
    assert [(n.start_page, n.num_pages) for n in c.device_victims(100)] == [(2, 2), (2, 2), (0, 2)]
    assert c.drop_device(victims) == 2 and c.device_allocator.num_free == 32 - 4
    c.check_integrity()


def test_write_back_keeps_node_on_host_and_hit_continues(mk, run_req):
    c = mk(host_pages=16)
    run_req(c, "x", X)
    assert evict_with(c, 4, backup) == 4 and c.device_allocator.num_free == 32
    assert c.tree.num_nodes == 1 and c.stats().host_pages_cached == 4
    m = c.match(X)
    assert (m.device_tokens, m.host_tokens, m.host_pages, m.exact_tokens) == (0, 16, [0, 1, 2, 3], 16)
    assert m.host_node.num_pages == 4 and c.tree.path(m.host_node, m.device_node) == [m.host_node]
    c.check_integrity()


def test_device_then_host_hit_and_load_back(mk, run_req):
    c = mk(host_pages=16)
    run_req(c, "x", X)
    top = c.tree.split_at(c.match(X).device_node, 2)
    backup(c, top)
    backup(c, next(iter(top.children.values())))
    c.evict(2)  # the lower node becomes L2-only
    m = c.match(X[:14])
    assert (m.device_tokens, m.host_tokens, m.device_pages, m.host_pages) == (8, 4, [0, 1], [2])
    low = m.host_node
    with pytest.raises(CacheStateError, match="got 1 pages, need 2"):
        c.tree.set_device(low, [9])
    c.inc_host_lock(low)  # pinned while "loading"
    assert c.evict_host(100) == []  # the whole L2 path is pinned
    new = c.device_allocator.alloc(2)
    c.tree.set_device(low, new)
    c.dec_host_lock(low)
    c.check_integrity()
    assert c.match(X).device_pages == [0, 1] + new
    assert sorted(c.evict_host(100)) == [0, 1, 2, 3] and c.host_allocator.num_free == 16
    assert c.match(X).device_tokens == 16  # L1 kept
    c.check_integrity()


def test_evict_host_keeps_l2_prefix_closed(mk, run_req):
    c = mk(host_pages=16)
    run_req(c, "x", X)
    run_req(c, "y", Y)
    evict_with(c, 100, backup_path)  # everything L2-only: [X0 X1] -> {[X2 X3], [Y2 Y3]}
    assert c.tree.num_nodes == 3 and c.device_allocator.num_free == 32
    m = c.match(Y)
    c.inc_host_lock(m.host_node)
    freed = c.evict_host(1)  # only X's branch is an unpinned L2 leaf
    assert len(freed) == 2 and c.match(X).host_tokens == 8 and c.match(Y).host_tokens == 16
    assert c.evict_host(100) == []
    c.dec_host_lock(m.host_node)
    assert len(c.evict_host(100)) == 4 and c.tree.num_nodes == 0
    c.check_integrity()


def test_insert_brings_host_only_node_back_to_device(mk, run_req):
    c = mk(host_pages=16)
    run_req(c, "x", X)
    evict_with(c, 4, backup)
    r = run_req(c, "again", X + [1])  # recomputes X instead of loading it
    assert r.state.value == "finished"
    m = c.match(X)
    assert (m.device_tokens, m.host_tokens) == (16, 0) and m.device_node.host_pages == [0, 1, 2, 3]
    c.check_integrity()


def test_hashes_and_storage_flag(mk, run_req):
    c = mk()
    run_req(c, "x", X)
    n = c.match(X).device_node
    c.tree.set_stored(n)
    top = c.tree.split_at(n, 1)
    assert top.in_storage and n.in_storage
    from hicache.core.hashing import page_hashes
    assert c.tree.hashes(top) + c.tree.hashes(n) == page_hashes(X, 4)
    c.check_integrity()


def test_unbalanced_external_unlock_is_refused(mk, run_req):
    c = mk(host_pages=4)
    run_req(c, "x", X)
    n = c.match(X).device_node
    with pytest.raises(CacheStateError, match="without a matching inc"):
        c.dec_lock(n)
    c.inc_lock(n)
    assert c.evict(100) == 0
    c.check_integrity()
    c.dec_lock(n)
    assert c.evict(100) == 4
