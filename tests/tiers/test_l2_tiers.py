"""The L2 strategy's two-phase contract (``hicache.tiers.l2.base``), for both strategies:
the private pinned pool and the node service's shared segment. Each movement
fails for real (the transfer engine's page copy raises), and what
``complete_*(..., ok=False)`` leaves is checked by value: L2 pages given back,
nothing indexed, node state as before, ``check_integrity()`` clean. Toy shape and
a real model's shape (``hicache.core.shapes``, two layers)."""
from __future__ import annotations

import contextlib

import pytest
import torch

import hicache.transfer.engine as tr
from hicache.core.config import HiCacheConfig
from hicache.core.errors import TransferError
from hicache.cache.hicache import HiCache
from hicache.core.layout import KVLayout
from hicache.core.shapes import model_shape
from tests.tiers.service_node import running_service, socket_url

PAGES = 3
LAYOUTS = {
    "toy": KVLayout(model_id="t", num_layers=2, num_kv_heads=1, head_dim=4, dtype="float32", page_size=4,
                    host_layout="page_first"),
    "llama-3.1-8b": model_shape("llama-3.1-8b").kv_layout(16, layers=2, host_layout="page_first"),
}

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(params=[(s, name) for s in ("private", "shared") for name in LAYOUTS],
                ids=lambda p: f"{p[0]}-{p[1]}")
def hc(request):
    """A ``HiCache`` with that L2 strategy (write_back: nothing backs up unless asked)."""
    strategy, name = request.param
    layout = LAYOUTS[name]
    with contextlib.ExitStack() as stack:
        url = "" if strategy == "private" else socket_url(stack.enter_context(running_service(layout, 16)))
        o = {"storage.url": url, "pool.device": "cpu", "pool.device_pages": "8", "pool.host_pages": "8",
             "policy.write_policy": "write_back", "policy.prefetch_policy": "wait_complete"}
        h = HiCache(HiCacheConfig.load(env={}, overrides=o), layout=layout)
        yield h
        h.close()


def tokens_of(hc: HiCache) -> list[int]:
    return list(range(100, 100 + PAGES * hc.layout.page_size + 1))


def rows_of(hc: HiCache, n: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    return [torch.randint(0, 256, (n, s.row_bytes), dtype=torch.uint8, generator=gen) for s in hc.layout.planes]


def serve(hc: HiCache, rid: str, tokens: list[int]):
    """Admit, write the rows not matched, commit, finish; the request's deepest node."""
    req = hc.new_request(rid, tokens)
    hc.admit(req).wait()
    start = req.computed_tokens
    req.alloc(len(tokens) - start)
    slots = hc.device_pool.slot_ids(req.pages)[start:len(tokens)]
    for buf, r in zip(hc.device_pool.buffers, rows_of(hc, len(tokens))):
        buf.view(buf.shape[0], -1).view(torch.uint8)[slots] = r[start:]
    req.commit()
    req.finish()
    return hc.cache.match(tokens).device_node


def l1_rows_equal(hc: HiCache, tokens: list[int]) -> bool:
    m = hc.cache.match(tokens)
    slots = hc.device_pool.slot_ids(m.device_pages)[:m.device_tokens]
    return m.device_tokens > 0 and all(
        torch.equal(buf.view(buf.shape[0], -1).view(torch.uint8)[slots], r[:m.device_tokens])
        for buf, r in zip(hc.device_pool.buffers, rows_of(hc, len(tokens))))


def l2_state(hc: HiCache) -> tuple:
    """What L2 holds: free private pages, or the service's reserved/locked/committed pages."""
    if hc.shared is None:
        return ("free", hc.host_pool.allocator.num_free)
    st = hc.shared.client.stats()
    return ("service", st["reserved_pages"], st["locked_pages"], st["committed_pages"])


def indexed_in_l2(hc: HiCache, node) -> bool:
    return node.host_pages is not None or node.in_storage


def broken_copies(monkeypatch) -> None:
    def broken(*a, **k):
        raise RuntimeError("simulated copy failure")
    monkeypatch.setattr(tr, "_copy_pages", broken)


def test_a_failed_backup_gives_its_l2_pages_back_and_indexes_nothing(hc, monkeypatch):
    node = serve(hc, "a", tokens_of(hc))
    before, lock = l2_state(hc), node.lock_ref
    assert hc.l2.unbacked(node)
    broken_copies(monkeypatch)
    plan = hc.l2.prepare_backup(node, pin=True)
    assert plan is not None and len(plan.host) == PAGES and not hc.l2.unbacked(node)
    assert l2_state(hc) != before  # L2 pages reserved while the copy runs
    hc._submit(plan)
    hc.drain()  # the failed copy completes with ok=False
    assert hc.tier_stats.transfer_errors == 1
    assert l2_state(hc) == before and node.lock_ref == lock and not indexed_in_l2(hc, node)
    assert hc.l2.unbacked(node) and node.device_pages is not None  # still on L1, backable again
    hc.check_integrity()
    monkeypatch.undo()
    hc.wait_job(hc.start_backup(node))  # and the real backup then lands: evict L1, load back, same bytes
    assert indexed_in_l2(hc, node) and not hc.l2.unbacked(node)
    hc.evict(100)
    adm = hc.admit(req := hc.new_request("b", tokens_of(hc)))
    adm.wait()
    assert adm.host_tokens == PAGES * hc.layout.page_size and l1_rows_equal(hc, tokens_of(hc))
    req.finish()
    hc.drain()
    hc.check_integrity()


def test_a_failed_load_releases_its_l2_side_and_the_cache_stops_serving(hc, monkeypatch):
    node = serve(hc, "a", tokens_of(hc))
    hc.wait_job(hc.start_backup(node))
    hc.evict(100)
    before = l2_state(hc)
    broken_copies(monkeypatch)
    req = hc.new_request("b", tokens_of(hc))
    adm = hc.admit(req)
    (job, plan), = hc._jobs.items()
    with pytest.raises(RuntimeError, match="simulated"):
        adm.wait()
    hc.transfers.wait_all()
    with pytest.raises(TransferError, match="unknown bytes"):
        hc.poll()  # complete_load(ok=False): the L1 pages stay indexed with unknown bytes
    assert hc.tier_stats.transfer_errors == 1 and job not in hc._jobs
    assert (plan.last.host_lock_ref, l2_state(hc)) == (0, before)  # the L2 side is released
    req.abort()
    assert plan.last.lock_ref == 0  # and nothing pins the L1 pages any more
    hc.check_integrity()
    with pytest.raises(TransferError):
        hc.admit(hc.new_request("c", tokens_of(hc)))


def test_a_cancelled_load_gives_everything_back_and_indexes_nothing(hc):
    node = serve(hc, "a", tokens_of(hc))
    hc.wait_job(hc.start_backup(node))
    hc.evict(100)
    before, free = l2_state(hc), hc.cache.device_allocator.num_free
    req = hc.new_request("b", tokens_of(hc))
    m = req.match()
    lb = hc.l2.plan_load(req, m, None)
    assert lb is not None and lb.num_pages == PAGES and lb.end_tokens == PAGES * hc.layout.page_size
    hc.l2.cancel_load(lb)
    after = req.match()
    assert (after.device_tokens, after.host_tokens, after.device_node) == (m.device_tokens, m.host_tokens,
                                                                          m.device_node)
    assert (l2_state(hc), hc.cache.device_allocator.num_free) == (before, free)
    hc.check_integrity()


def test_a_load_is_pinned_until_it_completes_and_then_unpinned(hc):
    node = serve(hc, "a", tokens_of(hc))
    hc.wait_job(hc.start_backup(node))
    hc.evict(100)
    req = hc.new_request("b", tokens_of(hc))
    lb = hc.l2.plan_load(req, req.match(), None)
    plan = hc.l2.prepare_load(req, lb, hc.cache.alloc_device(lb.num_pages))
    assert plan.last.lock_ref == 1 and hc.evict(100) == 0  # pinned on L1 while it would fill
    hc.check_integrity()
    hc.l2.complete_load(plan, ok=True)
    assert plan.last.lock_ref == 0 and plan.last.host_lock_ref == 0
    hc.check_integrity()


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_failed_l3_movements_of_the_private_l2_index_nothing(name):
    """The private L2's own L3 movements (``TierManager``): a store L3 took nothing of
    leaves the node unstored and unpinned; a prefetch where nothing landed gives its
    L2 pages back and indexes nothing."""
    import numpy as np
    from hicache.index.prefix_cache import as_key
    from hicache.core.hashing import page_hashes
    o = {"storage.url": "", "pool.device": "cpu", "pool.device_pages": "8", "pool.host_pages": "8",
         "policy.write_policy": "write_back"}
    hc = HiCache(HiCacheConfig.load(env={}, overrides=o), layout=LAYOUTS[name])
    toks = tokens_of(hc)
    node = serve(hc, "a", toks)
    hc.wait_job(hc.start_backup(node))
    plan = hc.tiers.prepare_store(node)
    assert plan is not None and node.host_lock_ref == 1
    hc.tiers.complete_store(plan, 0)
    assert (node.in_storage, node.host_lock_ref, hc.tier_stats.storage_put_dropped_pages) == (False, 0, PAGES)
    hc.check_integrity()
    ps, longer = hc.layout.page_size, toks[:-1] + list(range(900, 900 + 2 * hc.layout.page_size))
    free, m = hc.host_pool.allocator.num_free, hc.cache.match(longer)
    hashes = page_hashes(np.asarray(longer, dtype=np.uint32), ps)
    pf = hc.tiers.prepare_prefetch(as_key(longer), "", PAGES, hashes[PAGES:PAGES + 2])
    assert pf is not None and hc.host_pool.allocator.num_free == free - 2
    assert hc.tiers.complete_prefetch(pf, 0) == 0
    assert hc.host_pool.allocator.num_free == free and hc.cache.match(longer).tokens == m.tokens
    assert not hc.tiers.host_in_flight
    hc.check_integrity()
    hc.close()
