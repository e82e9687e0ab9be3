"""SGLang's v2 hybrid-pool methods through its real ``HybridCacheController`` and
hybrid host pools (``HostPoolGroup``: KV anchor + ``swa`` / ``mamba``), at the
gpt-oss-120b and qwen3-next-80b-a3b shapes with all their layers (see
``hybrid.py``), over file://, memory:// and redis://.

The controller's own threads run the v2 calls: the backup thread
(``batch_set_v2`` for the side pool, then ``batch_set_v1`` for KV), the
prefetch query thread (``batch_exists_v2``, with SGLang's sparse-boundary
reduction) and the prefetch I/O thread (``batch_get_v1`` for KV, then
``batch_get_v2`` for the side pool). The test does only what SGLang's
scheduler does between them: hand over host pages, allocate host memory for a
hit, queue the transfer.
"""
from __future__ import annotations

import os
from dataclasses import replace

import pytest
import redis
import torch
from sglang.srt.mem_cache.base_prefix_cache import CacheRequestHandle
from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransfer
from sglang.srt.mem_cache.utils import get_storage_hash_str

from hicache.core.errors import ConfigError
from hicache.integrations.metrics import PoolCounts
from hicache.integrations.sglang import HiCacheBackend
from hicache.integrations.sglang_keys import page_key, sglang_layout
from hicache.integrations.sglang_pools import PoolVerdict, fold_hits, mamba_layout, pool_key, side_timeout_ms
from hicache.core.shapes import model_shape

from ..service_proc import start_serve, stop_serve
from .conftest import LAYOUTS, host_pool, storage_config
from .hybrid import GPT_OSS, QWEN3_NEXT, gpt_oss_group, hybrid_controller, qwen3_next_group
from .launch import page_bytes

PAGE = 16  # trtllm_mha's smallest page (test_real_shapes.py); the SWA window is 8 such pages
TRAILING = PoolHitPolicy.TRAILING_PAGES
pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(params=["file", "memory", "redis"])
def url(request, tmp_path, redis_url):
    return {"file": f"file://{tmp_path}/l3", "memory": "memory://", "redis": redis_url}[request.param]


def chain(n_pages: int, seed: int = 0, page: int = PAGE) -> tuple[list[int], list[str]]:
    tokens = [seed * 100_000 + i for i in range(n_pages * page)]
    return tokens, get_storage_hash_str(tokens, None, page_size=page)


def backup(c, host_idx, tokens, keys, side: PoolTransfer):
    """What the radix tree's BACKUP_STORAGE hands the controller for one node."""
    c.write_storage(host_idx, tokens, hash_value=keys, extra_pools=[side])
    return c.ack_backup_queue.get(timeout=60)


def prefetch(c, tokens, side: PoolTransfer, alloc_side):
    """Query, then (as the scheduler) allocate host memory for the hit and queue the
    transfer; returns (operation, its acks)."""
    op = c.prefetch(CacheRequestHandle("req", 0), tokens, extra_pools=[side])
    assert c.prefetch_hit_queue.get(timeout=60) is op
    if op.storage_hit_count == 0:
        return op, []
    op.host_indices = c.mem_pool_host.anchor_entry.host_pool.alloc(op.storage_hit_count)
    side.host_indices = alloc_side()
    c.prefetch_buffer.put(op)
    acks = []
    while not acks or not acks[-1].completed_req:
        acks.append(c.ack_prefetch_queue.get(timeout=60))
    return op, acks


def loaded(acks) -> tuple[int, dict]:
    """(KV tokens loaded, side pool pages loaded) as SGLang's acks report them."""
    kv = [a.completed_tokens for a in acks if a.completed_tokens is not None]
    side = [a.pool_hits for a in acks if a.pool_hits is not None]
    return kv[-1], side[-1]


def same_pages(host, a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(page_bytes(host, a), page_bytes(host, b), strict=True))


def side_file(b: HiCacheBackend, pool: str, key: str) -> str:
    store = b.side.get(pool).store
    h = pool_key(pool, key).hex()
    return os.path.join(store.dir, h[:2], h)


def tamper(b: HiCacheBackend, pool: str, key: str, obj: bytes | None = None) -> None:
    """Flip the last payload byte of a side pool's stored page, or put ``obj`` in its place."""
    store = b.side.get(pool).store
    if b.url.startswith("file://"):
        with open(side_file(b, pool, key), "r+b") as f:
            data = bytearray(f.read()) if obj is None else bytearray(obj)
            if obj is None:
                data[-1] ^= 0xFF
            f.seek(0)
            f.truncate()
            f.write(data)
        return
    r = redis.Redis.from_url(b.url)
    full = store.key_prefix + pool_key(pool, key)
    data = bytearray(r.get(full)) if obj is None else bytearray(obj)
    if obj is None:
        data[-1] ^= 0xFF
    r.set(full, bytes(data))


def kv_object(b: HiCacheBackend, key: str) -> bytes:
    if b.url.startswith("file://"):
        h = page_key(key).hex()
        with open(os.path.join(b.store.dir, h[:2], h), "rb") as f:
            return f.read()
    return redis.Redis.from_url(b.url).get(b.store.key_prefix + page_key(key))


# ------------------------------------------------------------------- SWA
def swa_stack(layout, url, model, controllers, page: int = PAGE):
    window = -(-128 // page)
    group, dev = gpt_oss_group(page, layout, dev_pages=2 * (window + 2))
    c = hybrid_controller(group, dev, page, url, f"{model}-{GPT_OSS}", model_shape(GPT_OSS).layers)
    controllers.append(c)
    return c, group.get_pool(PoolName.KV), group.get_pool(PoolName.SWA)


# SGLang's default page size (1: a 128-page window) in one layout, trtllm_mha's 16 in every layout.
SWA_CASES = [*((layout, PAGE) for layout in LAYOUTS), ("page_first", 1)]


@pytest.mark.parametrize("layout, page", SWA_CASES)
def test_swa_window_round_trips_byte_exact_through_the_hybrid_controller(layout, page, url, model, controllers):
    c, kv, swa = swa_stack(layout, url, model, controllers, page)
    b = c.storage_backend
    window = -(-128 // page)  # SGLang's window pages for gpt-oss's 128-token window
    n = window + 2
    tokens, keys = chain(n, page=page)
    src, swa_src = kv.alloc(n * page), swa.alloc(window * page)
    done = backup(c, src, tokens, keys, PoolTransfer(PoolName.SWA, host_indices=swa_src, keys=keys[-window:],
                                                      hit_policy=TRAILING))
    assert done.completed_tokens == n * page
    assert done.pool_storage_result.extra_pool_hit_pages == {PoolName.SWA: window}

    side = PoolTransfer(PoolName.SWA, keys=["__placeholder__"] * window, hit_policy=TRAILING)
    op, acks = prefetch(c, tokens, side, lambda: swa.alloc(window * page))
    # Only boundary n has the whole window before it: the hit is all n pages.
    assert op.pool_storage_result.restorable_prefix_pages == [n]
    assert op.storage_hit_count == n * page and side.keys == keys[-window:]
    assert loaded(acks)[0] == n * page and loaded(acks)[1][PoolName.SWA] == window
    assert same_pages(kv, src, op.host_indices) and same_pages(swa, swa_src, side.host_indices)
    s = b.pool_stats(PoolName.SWA)
    page_bytes_ = b.side.get("swa").layout.page_bytes
    assert page_bytes_ == 18 * 2 * 8 * 64 * 2 * page  # 18 sliding layers, K and V, 8 heads of 64, bf16
    assert (s.put_ok, s.hits, s.misses, s.bytes_read) == (window, window, 0, window * page_bytes_)
    b.check_integrity()


def test_swa_pages_missing_from_the_window_are_a_miss(url, model, controllers):
    c, kv, swa = swa_stack("page_first", url, model, controllers)
    tokens, keys = chain(10, seed=1)
    window = 8
    # The KV pool holds all 10 pages, the SWA pool only the last 7 of the window.
    backup(c, kv.alloc(10 * PAGE), tokens, keys, PoolTransfer(PoolName.SWA, host_indices=swa.alloc(7 * PAGE),
                                                               keys=keys[-7:], hit_policy=TRAILING))
    r = c.storage_backend.batch_exists_v2(keys, [PoolTransfer(PoolName.SWA, keys=["x"] * window,
                                                              hit_policy=TRAILING)])
    assert (r.kv_hit_pages, r.restorable_prefix_pages) == (0, [])
    assert r.extra_pool_hit_pages == {PoolName.KV: 10}
    side = PoolTransfer(PoolName.SWA, keys=["__placeholder__"] * window, hit_policy=TRAILING)
    op, acks = prefetch(c, tokens, side, lambda: swa.alloc(window * PAGE))
    assert op.storage_hit_count == 0 and acks == []
    # SGLang's clear (its /clear_hicache_storage_backend) clears the side pools too.
    b = c.storage_backend
    assert b.side.exists("swa", keys[-7:]) == [True] * 7
    assert c.clear_storage_backend()
    assert b.batch_exists(keys) == 0 and b.side.exists("swa", keys[-7:]) == [False] * 7


@pytest.mark.parametrize("scheme", ["file", "redis"])
def test_corrupt_swa_page_is_counted_and_loads_nothing_after_it(scheme, tmp_path, redis_url, model, controllers):
    url = f"file://{tmp_path}/l3" if scheme == "file" else redis_url
    c, kv, swa = swa_stack("page_first_direct", url, model, controllers)
    b = c.storage_backend
    tokens, keys = chain(10, seed=2)
    swa_src = swa.alloc(8 * PAGE)
    backup(c, kv.alloc(10 * PAGE), tokens, keys, PoolTransfer(PoolName.SWA, host_indices=swa_src, keys=keys[-8:],
                                                              hit_policy=TRAILING))
    tamper(b, "swa", keys[5])
    side = PoolTransfer(PoolName.SWA, keys=["__placeholder__"] * 8, hit_policy=TRAILING)
    op, acks = prefetch(c, tokens, side, lambda: swa.alloc(8 * PAGE))
    assert op.storage_hit_count == 10 * PAGE  # exists, not verified: the read verifies
    assert loaded(acks)[1][PoolName.SWA] == 3  # pages 2, 3, 4 of the window; 5 is corrupt
    assert same_pages(swa, swa_src[:3 * PAGE], side.host_indices[:3 * PAGE])
    s = b.pool_stats("swa")
    assert (s.corrupt, s.hits, s.misses) == (1, 7, 1)  # the store reads all 8; the run ends at the corrupt one
    got = b.adapter_stats()
    assert got.corrupt == 1
    # per pool (hicache_adapter_pool_pages_total{pool=...}), and the totals are their sums
    kv_s = b.pool_stats("kv")
    assert got.pools["swa"] == PoolCounts(hits=7, misses=1, stored=8, dropped=0)
    assert got.pools["kv"] == PoolCounts(hits=kv_s.hits, misses=kv_s.misses, stored=kv_s.put_ok,
                                         dropped=kv_s.put_dropped)
    assert set(got.pools) == {"kv", "swa"} and got.hits == kv_s.hits + 7 and got.stored == kv_s.put_ok + 8
    b.check_integrity()


# ----------------------------------------------------------------- Mamba
def mamba_stack(layout, url, model, controllers):
    group, dev = qwen3_next_group(PAGE, layout)
    c = hybrid_controller(group, dev, PAGE, url, f"{model}-{QWEN3_NEXT}", model_shape(QWEN3_NEXT).layers)
    controllers.append(c)
    return c, group.get_pool(PoolName.KV), group.get_pool(PoolName.MAMBA)


def state(idx) -> PoolTransfer:
    return PoolTransfer(PoolName.MAMBA, host_indices=idx, keys=None, hit_policy=TRAILING)


def backup_nodes(c, kv, mamba, tokens, keys, ends=(4, 8)):
    """Two radix nodes, pages [0, 4) and [4, 8), each with its state at its end."""
    kv_src, states, start = kv.alloc(8 * PAGE), {}, 0
    for end in ends:
        slot = mamba.alloc(1)
        t = state(slot)
        t.keys = [keys[end - 1]]
        done = backup(c, kv_src[start * PAGE:end * PAGE], tokens[start * PAGE:end * PAGE], keys[start:end], t)
        assert done.completed_tokens == (end - start) * PAGE
        assert done.pool_storage_result.extra_pool_hit_pages == {PoolName.MAMBA: 1}
        states[end], start = slot, end
    return kv_src, states


@pytest.mark.parametrize("layout", ["page_first", "page_first_direct"])  # MambaPoolHost's own layouts
def test_mamba_state_round_trips_byte_exact_through_the_hybrid_controller(layout, url, model, controllers):
    c, kv, mamba = mamba_stack(layout, url, model, controllers)
    b = c.storage_backend
    tokens, keys = chain(8)
    kv_src, states = backup_nodes(c, kv, mamba, tokens, keys)
    side = PoolTransfer(PoolName.MAMBA, keys=["__placeholder__"], hit_policy=TRAILING)
    op, acks = prefetch(c, tokens, side, lambda: mamba.alloc(1))
    assert op.pool_storage_result.restorable_prefix_pages == [4, 8]
    assert op.storage_hit_count == 8 * PAGE and side.keys == [keys[7]]
    assert loaded(acks)[0] == 8 * PAGE and loaded(acks)[1][PoolName.MAMBA] == 1
    assert same_pages(kv, kv_src, op.host_indices)
    assert same_pages(mamba, states[8], side.host_indices)
    assert not same_pages(mamba, states[4], side.host_indices)
    page = b.side.get("mamba").layout.page_bytes
    # 36 Gated DeltaNet layers: [32, 128, 128] float32 + [8192, 3] bfloat16 each
    assert page == mamba.size_per_token == 36 * (32 * 128 * 128 * 4 + 8192 * 3 * 2)
    s = b.pool_stats(PoolName.MAMBA)
    assert (s.put_ok, s.hits, s.bytes_read) == (2, 1, page)
    b.check_integrity()


def test_a_missing_state_floors_the_hit_to_the_last_snapshot(url, model, controllers):
    c, kv, mamba = mamba_stack("page_first", url, model, controllers)
    b = c.storage_backend
    tokens, keys = chain(8, seed=3)
    kv_src, states = backup_nodes(c, kv, mamba, tokens, keys)
    assert b.side.get("mamba").store.delete([pool_key("mamba", keys[7])]) == 1
    side = PoolTransfer(PoolName.MAMBA, keys=["__placeholder__"], hit_policy=TRAILING)
    op, acks = prefetch(c, tokens, side, lambda: mamba.alloc(1))
    # KV holds 8 pages, the state only exists at page 4: the hit is floored there.
    assert op.pool_storage_result.restorable_prefix_pages == [4]
    assert op.storage_hit_count == 4 * PAGE and side.keys == [keys[3]]
    assert loaded(acks)[0] == 4 * PAGE and loaded(acks)[1][PoolName.MAMBA] == 1
    assert same_pages(kv, kv_src[:4 * PAGE], op.host_indices)
    assert same_pages(mamba, states[4], side.host_indices)
    # Without any state the KV pages alone are a miss.
    assert b.side.get("mamba").store.delete([pool_key("mamba", keys[3])]) == 1
    r = b.batch_exists_v2(keys, [PoolTransfer(PoolName.MAMBA, keys=["x"], hit_policy=TRAILING)])
    assert (r.kv_hit_pages, r.extra_pool_hit_pages) == (0, {PoolName.KV: 8})


@pytest.mark.parametrize("scheme", ["file", "redis"])
def test_a_kv_object_in_a_state_slot_is_foreign_and_counted(scheme, tmp_path, redis_url, model, controllers):
    url = f"file://{tmp_path}/l3" if scheme == "file" else redis_url
    c, kv, mamba = mamba_stack("page_first_direct", url, model, controllers)
    b = c.storage_backend
    tokens, keys = chain(8, seed=4)
    backup_nodes(c, kv, mamba, tokens, keys, ends=(4,))
    slot = mamba.alloc(1)
    tamper(b, "mamba", keys[3], kv_object(b, keys[3]))  # a well-formed object of the KV layout
    got = b.batch_get_v2([PoolTransfer(PoolName.MAMBA, host_indices=slot, keys=[keys[3]])])
    assert got == {PoolName.MAMBA: [False]}
    s = b.pool_stats("mamba")
    assert (s.fingerprint_mismatch, s.misses, s.hits) == (1, 1, 0)
    assert b.adapter_stats().foreign == 1


# ------------------------------------------------------- registration, keys
def test_every_pool_has_its_own_fingerprint_and_keys(tmp_path, model, controllers):
    c, _, _ = mamba_stack("page_first", f"file://{tmp_path}/l3", model, controllers)
    b = c.storage_backend
    m = b.side.get("mamba")
    assert len({b.layout.fingerprint(), m.layout.fingerprint()}) == 2
    assert m.layout.model_id.endswith("#sglang:page_first:mamba") and m.layout.kind == "rows"
    assert b.side.get("mamba").store.key_prefix != b.store.key_prefix
    assert len({page_key("ab"), pool_key("mamba", "ab"), pool_key("swa", "ab")}) == 3
    # Mamba state is TP-sharded even where KV is MLA-replicated: each rank its own fingerprint.
    ranks = [mamba_layout(m.segments.host_pool, "mamba", replace(b.storage_config, tp_rank=r, tp_size=2,
                                                                     is_mla_model=True), m.layout.page_bytes)
             for r in (0, 1)]
    assert len({r.fingerprint() for r in ranks} | {m.layout.fingerprint()}) == 3
    with pytest.raises(ConfigError, match="register_mem_pool_host"):
        b.register_mem_host_pool_v2(m.segments.host_pool, PoolName.KV)
    # Per-page timeouts: the KV store keeps the default, a 74 MiB state slot gets 1.5 s.
    assert (b.store.options.timeout_ms, m.store.options.timeout_ms) == (50, -(-m.layout.page_bytes // 50_000))
    assert (side_timeout_ms(1 << 20, None), side_timeout_ms(1 << 20, 200), side_timeout_ms(10**8, 200)) == (
        50, 200, 2000)


def test_v2_kv_transfers_are_v1_objects_and_bad_transfers_move_nothing(tmp_path, model, controllers):
    c, kv, swa = swa_stack("page_first", f"file://{tmp_path}/l3", model, controllers)
    b = c.storage_backend
    tokens, keys = chain(3, seed=5)
    src, dst, dst2 = kv.alloc(3 * PAGE), kv.alloc(3 * PAGE), kv.alloc(3 * PAGE)
    assert b.batch_set_v2([PoolTransfer(PoolName.KV, host_indices=src, keys=keys)]) == {PoolName.KV: [True] * 3}
    assert b.batch_exists(keys) == 3 and b.batch_get_v1(keys, dst) == [True] * 3
    assert b.batch_get_v2([PoolTransfer(PoolName.KV, host_indices=dst2, keys=keys)]) == {PoolName.KV: [True] * 3}
    assert same_pages(kv, src, dst) and same_pages(kv, src, dst2)
    # Indices that do not cover the keys (SGLang's file backend: nothing moves), an
    # unregistered pool, and nothing stored yet: all False, no exception.
    short = PoolTransfer(PoolName.SWA, host_indices=swa.alloc(PAGE), keys=keys[:2])
    assert b.batch_set_v2([short]) == {PoolName.SWA: [False, False]}
    ghost = PoolTransfer(PoolName.MAMBA, host_indices=torch.tensor([0]), keys=keys[:1])
    assert b.batch_get_v2([ghost]) == {PoolName.MAMBA: [False]}
    fresh = PoolTransfer(PoolName.SWA, host_indices=swa.alloc(2 * PAGE), keys=keys[:2])
    assert b.batch_get_v2([fresh]) == {PoolName.SWA: [False, False]}
    assert b.pool_stats("swa").put_ok == 0
    b.check_integrity()


def test_the_node_service_refuses_side_pools_at_attach(model):
    """The service serves one layout (the KV pool's): SGLang's attach fails, naming why.
    (SGLang's hybrid attach has started its storage threads by then and does not stop
    them on this failure; they are daemon threads, idle on empty queues.)"""
    group, dev = gpt_oss_group(PAGE, "page_first")
    kv_layout = sglang_layout(group.get_pool(PoolName.KV),
                              storage_config("mha", "page_first", "memory://", model=f"{model}-{GPT_OSS}"))
    serve = start_serve(kv_layout)
    try:
        with pytest.raises(ConfigError, match="side pool 'swa' .* node-local service"):
            hybrid_controller(group, dev, PAGE, serve.url, f"{model}-{GPT_OSS}", model_shape(GPT_OSS).layers)
    finally:
        stop_serve(serve)


def test_a_replicated_side_pool_is_written_by_the_writer_rank_only(tmp_path, model):
    url = f"file://{tmp_path}/l3"
    stores = []
    for rank in (0, 1):
        anchor, side = host_pool("mla", "page_first"), host_pool("mla", "page_first")
        b = HiCacheBackend(storage_config("mla", "page_first", url, model=model, tp_rank=rank, tp_size=2))
        b.register_mem_pool_host(anchor)
        b.register_mem_host_pool_v2(side, PoolName.DRAFT)
        idx = side.alloc(2 * 4)
        keys = get_storage_hash_str(list(range(8)), None, page_size=4)
        assert b.batch_set_v2([PoolTransfer(PoolName.DRAFT, host_indices=idx, keys=keys)]) == {
            PoolName.DRAFT: [True, True]}
        stores.append((b.pool_stats("draft").put_ok, b.skipped_writes))
        b.close()
    assert stores == [(2, 0), (0, 2)]


def test_fold_hits_follows_sglang_hit_policies():
    t, a = PoolHitPolicy.TRAILING_PAGES, PoolHitPolicy.ALL_PAGES
    # Mamba: snapshots after pages 2 and 5 (0-based), trailing 1.
    mamba = PoolVerdict("mamba", t, 1, [False, False, True, False, False, True, False])
    r = fold_hits(7, [mamba])
    assert (r.kv_hit_pages, r.restorable_prefix_pages, r.extra_pool_hit_pages) == (6, [3, 6], {"kv": 7, "mamba": 6})
    # SWA window of 3 pages: boundaries 4 .. 5 (pages 1 .. 4 held); with all_pages up to 4.
    swa = PoolVerdict("swa", t, 3, [False, True, True, True, True, False, False])
    idx = PoolVerdict("indexer", a, 0, [True, True, True, True, False, True, True])
    r = fold_hits(7, [swa, idx])
    assert (r.kv_hit_pages, r.restorable_prefix_pages) == (4, [4])
    assert r.extra_pool_hit_pages == {"kv": 7, "swa": 5, "indexer": 4}
    assert fold_hits(0, [PoolVerdict("swa", t, 3, [])]).restorable_prefix_pages == []
    with pytest.raises(ValueError, match="block_groups"):
        fold_hits(2, [PoolVerdict("c4", PoolHitPolicy.BLOCK_GROUPS, 1, [True, True])])
