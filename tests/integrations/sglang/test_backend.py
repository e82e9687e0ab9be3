"""HiCacheBackend built by SGLang's own StorageBackendFactory and driven by its
real HiCacheController, over real CPU host pools, in every supported layout."""
from __future__ import annotations

import os

import pytest
import redis
import torch
from sglang.srt.managers.cache_controller import PrefetchOperation
from sglang.srt.mem_cache.hicache_storage import HiCacheFile
from sglang.srt.mem_cache.storage import StorageBackendFactory
from sglang.srt.mem_cache.utils import get_storage_hash_str
from sglang.srt.observability.metrics_collector import StorageMetrics

from hicache.core.errors import ConfigError, IntegrityError
from hicache.integrations.sglang import HiCacheBackend
from hicache.integrations.sglang_keys import page_key
from hicache.storage import open_storage

from .conftest import LAYOUTS, PAGE, controller, host_pool, storage_config

KINDS = ("mha", "mla")


def keys_for(n_pages: int, seed: int = 0) -> list[str]:
    """SGLang's own chained page hashes for n_pages of tokens."""
    tokens = [seed * 1000 + i for i in range(n_pages * PAGE)]
    return get_storage_hash_str(tokens, None, page_size=PAGE)


def pages_of(pool, idx: torch.Tensor) -> list[torch.Tensor]:
    """Copies of the host pool's pages at ``idx`` (SGLang's flat data pages), as raw
    bytes: the random bits include NaN patterns, which torch.equal on bf16 rejects."""
    return [pool.get_data_page(int(idx[i]), flat=True).clone().view(torch.uint8)
            for i in range(0, len(idx), PAGE)]


def make_backend(kind, layout, url, model, **kw):
    pool = host_pool(kind, layout)
    cfg = storage_config(kind, layout, url, model=model, **kw)
    b = StorageBackendFactory.create_backend("dynamic", cfg, pool)
    b.register_mem_pool_host(pool)  # what HiCacheController does right after create_backend
    return b, pool


def corrupt(backend: HiCacheBackend, key: str) -> None:
    """Flip the last payload byte of the stored object of ``key``."""
    store = backend.store
    full = store.key_prefix + page_key(key)
    if backend.url.startswith("file://"):
        h = page_key(key).hex()
        path = os.path.join(store.dir, h[:2], h)
        with open(path, "r+b") as f:
            f.seek(-1, os.SEEK_END)
            b = f.read(1)
            f.seek(-1, os.SEEK_END)
            f.write(bytes([b[0] ^ 0xFF]))
    else:
        r = redis.Redis.from_url(backend.url)
        obj = r.get(full)
        r.setrange(full, len(obj) - 1, bytes([obj[-1] ^ 0xFF]))


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("kind", KINDS)
def test_factory_builds_it_and_v1_round_trips(kind, layout, l3_url, model):
    b, pool = make_backend(kind, layout, l3_url, model)
    assert isinstance(b, HiCacheBackend)
    keys = keys_for(3)
    src, dst = pool.alloc(3 * PAGE), pool.alloc(3 * PAGE)
    want = pages_of(pool, src)
    assert not any(torch.equal(a, w) for a, w in zip(pages_of(pool, dst), want))
    assert b.batch_exists(keys) == 0
    assert b.batch_set_v1(keys, src) == [True] * 3
    assert b.batch_exists(keys) == 3
    assert b.batch_get_v1(keys, dst) == [True] * 3
    assert all(torch.equal(a, w) for a, w in zip(pages_of(pool, dst), want))
    stats = b.get_stats()
    assert isinstance(stats, StorageMetrics)
    assert stats.backup_pgs == [3] and stats.prefetch_pgs == [3]
    assert b.get_stats().prefetch_pgs == []  # drained
    b.check_integrity()
    assert b.clear() and b.batch_exists(keys) == 0
    b.close()


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("kind", KINDS)
def test_controller_zero_copy_and_generic_paths_are_byte_exact(kind, layout, l3_url, model, controllers):
    """SGLang's _page_set_zero_copy / _page_get_zero_copy and the generic
    (non-v1) paths; each path reads what the other wrote."""
    v1 = controller(kind, layout, l3_url, model)
    controllers.append(v1)
    assert v1.page_get_func == v1._page_get_zero_copy
    pool = v1.mem_pool_host
    keys = keys_for(4, seed=1)
    src, dst, dst2 = (pool.alloc(4 * PAGE) for _ in range(3))
    want = pages_of(pool, src)
    assert v1._page_set_zero_copy(keys[:2], src[:2 * PAGE]) is True
    assert v1._generic_page_set(keys[2:], src[2 * PAGE:]) is True
    op = PrefetchOperation("req-1", list(range(4 * PAGE)))
    assert v1._page_get_zero_copy(op, keys, dst) == 4
    assert all(torch.equal(a, w) for a, w in zip(pages_of(pool, dst), want))
    assert v1._generic_page_get(op, keys, dst2) == 4
    assert all(torch.equal(a, w) for a, w in zip(pages_of(pool, dst2), want))
    v1.storage_backend.check_integrity()


@pytest.mark.parametrize("kind", KINDS)
def test_missing_page_mid_run_ends_the_hit(kind, l3_url, model, controllers):
    c = controller(kind, "page_first", l3_url, model)
    controllers.append(c)
    b, pool = c.storage_backend, c.mem_pool_host
    keys = keys_for(4, seed=2)
    src, dst = pool.alloc(4 * PAGE), pool.alloc(4 * PAGE)
    want, before = pages_of(pool, src), pages_of(pool, dst)
    assert c._page_set_zero_copy(keys, src)
    assert b.store.delete([page_key(keys[2])]) == 1
    assert b.batch_exists(keys) == 2
    assert c._page_get_zero_copy(PrefetchOperation("r", []), keys, dst) == 2
    got = pages_of(pool, dst)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    # Absent: reported not loaded. A store that reads into the pool before verifying
    # (file://, hicache.storage.into) zeroes every page it did not load; the others
    # copy verified payloads only and leave it as it was. Page 3 verified: left as read.
    assert (not got[2].any()) if b.store.DIRECT_IO else torch.equal(got[2], before[2])
    assert before[2].any()
    assert torch.equal(got[3], want[3])


@pytest.mark.parametrize("layout", ("layer_first", "page_first"))
def test_corrupt_object_is_a_miss_where_sglang_file_backend_loads_wrong_bytes(layout, l3_url, model, tmp_path,
                                                                               controllers):
    keys = keys_for(3, seed=3)
    # SGLang's built-in HiCacheFile: raw bytes, no checksum.
    ref = controller("mha", layout, "", model, backend="file",
                     extra={"file_storage_path": str(tmp_path / "sglang-file")})
    ours = controller("mha", layout, l3_url, model)
    controllers.extend([ref, ours])
    assert isinstance(ref.storage_backend, HiCacheFile)
    for c in (ref, ours):
        pool = c.mem_pool_host
        src, dst = pool.alloc(3 * PAGE), pool.alloc(3 * PAGE)
        want = pages_of(pool, src)
        assert c.page_set_func(keys, src)
        if c is ref:
            path = os.path.join(ref.storage_backend.file_path,
                                ref.storage_backend._get_suffixed_key(keys[1]) + ".bin")
            with open(path, "r+b") as f:
                f.seek(-1, os.SEEK_END)
                last = f.read(1)
                f.seek(-1, os.SEEK_END)
                f.write(bytes([last[0] ^ 0xFF]))
            hits = c.page_get_func(PrefetchOperation("r", []), keys, dst)
            got = pages_of(pool, dst)
            assert hits == 3 and not torch.equal(got[1], want[1])  # wrong bytes served as a hit
        else:
            corrupt(c.storage_backend, keys[1])
            hits = c.page_get_func(PrefetchOperation("r", []), keys, dst)
            got = pages_of(pool, dst)
            assert hits == 1 and torch.equal(got[0], want[0])
            # Pages 2 and 3 are reported not loaded, so SGLang never serves their memory
            # (which may hold what was read: loads verify in the pool, hicache.storage.into).
            s = c.storage_backend.hicache_stats()
            assert s.corrupt == 1 and s.misses == 1  # page 2 verified but not loaded: after the miss
            c.storage_backend.check_integrity()  # the corrupt object was deleted on read


def test_mla_pages_read_in_place_report_corrupt_and_foreign_objects_missing(l3_url, model):
    """MLA pages are one segment each: loads read into the host pool and verify there
    (``StorageBackend.get_into``). A corrupt first page, then a foreign one, ends the hit."""
    b, pool = make_backend("mla", "page_first", l3_url, model)
    keys = keys_for(3, seed=9)
    src = pool.alloc(3 * PAGE)
    want = pages_of(pool, src)
    assert b.batch_set_v1(keys, src) == [True] * 3
    assert b.batch_set_v1(keys, src) == [True] * 3  # stored pages are skipped, not rewritten
    assert b.hicache_stats().put_ok == 3
    dst = pool.alloc(3 * PAGE)
    assert b.batch_get_v1(keys, dst) == [True] * 3
    assert all(torch.equal(g, w) for g, w in zip(pages_of(pool, dst), want))
    corrupt(b, keys[0])
    assert b.batch_get_v1(keys, pool.alloc(3 * PAGE)) == [False] * 3
    s = b.hicache_stats()
    assert (s.corrupt, s.hits) == (1, 5)  # pages 2 and 3 verified, not reported: after the miss
    other = open_storage(l3_url, fingerprint=b.layout.replace(num_layers=1).fingerprint(),
                         key_prefix=b.store.key_prefix)
    payload = bytes(other.fingerprint.encode()) * (b.layout.page_bytes // 32 + 1)
    assert other.put([(page_key(keys[0]), payload[:b.layout.page_bytes], [b.layout.page_bytes])]) == 1
    other.close()
    assert b.batch_get_v1(keys[:1], pool.alloc(PAGE)) == [False]
    assert b.hicache_stats().fingerprint_mismatch == 1
    assert b.store.delete([page_key(keys[0])]) == 1  # kept (another layout's), so removed here
    b.check_integrity()
    b.close()


def test_tp2_mha_ranks_are_isolated(l3_url, model):
    keys = keys_for(2, seed=4)
    r0, p0 = make_backend("mha", "page_first", l3_url, model, tp_rank=0, tp_size=2)
    r1, p1 = make_backend("mha", "page_first", l3_url, model, tp_rank=1, tp_size=2)
    assert r0.layout.fingerprint() != r1.layout.fingerprint()
    src0, src1 = p0.alloc(2 * PAGE), p1.alloc(2 * PAGE)
    assert r0.batch_set_v1(keys, src0) == [True, True]
    assert r1.batch_exists(keys) == 0
    assert r1.batch_set_v1(keys, src1) == [True, True]
    dst0, dst1 = p0.alloc(2 * PAGE), p1.alloc(2 * PAGE)
    assert r0.batch_get_v1(keys, dst0) == [True, True] and r1.batch_get_v1(keys, dst1) == [True, True]
    assert all(torch.equal(a, b) for a, b in zip(pages_of(p0, dst0), pages_of(p0, src0)))
    assert all(torch.equal(a, b) for a, b in zip(pages_of(p1, dst1), pages_of(p1, src1)))
    assert not torch.equal(pages_of(p0, dst0)[0], pages_of(p1, dst1)[0])


def test_foreign_object_under_a_shared_prefix_is_a_miss(l3_url, model):
    """Two TP ranks forced onto one key prefix: rank 1 sees rank 0's objects
    but the fingerprint check rejects them; SGLang is told nothing loaded."""
    keys = keys_for(2, seed=5)
    r0, p0 = make_backend("mha", "page_first", l3_url, model, tp_rank=0, tp_size=2, key_prefix=f"{model}:")
    r1, p1 = make_backend("mha", "page_first", l3_url, model, tp_rank=1, tp_size=2, key_prefix=f"{model}:")
    assert r0.batch_set_v1(keys, p0.alloc(2 * PAGE)) == [True, True]
    assert r1.batch_exists(keys) == 2  # present, not yet verified
    dst = p1.alloc(2 * PAGE)
    assert r1.batch_get_v1(keys, dst) == [False, False]
    # Pages from the miss on are reported not loaded; their host memory may hold what was
    # read (loads verify in the pool, hicache.storage.into), which SGLang frees unread.
    assert r1.hicache_stats().fingerprint_mismatch == 2


def test_tp2_mla_ranks_share_pages_with_one_writer(l3_url, model, controllers):
    keys = keys_for(3, seed=6)
    c0 = controller("mla", "page_first", l3_url, model, tp_rank=0, tp_size=2)
    c1 = controller("mla", "page_first", l3_url, model, tp_rank=1, tp_size=2)
    controllers.extend([c0, c1])
    b0, b1 = c0.storage_backend, c1.storage_backend
    assert b0.layout.fingerprint() == b1.layout.fingerprint()
    assert not c0.backup_skip and c1.backup_skip  # SGLang: rank 0 writes MLA pages
    src1 = c1.mem_pool_host.alloc(3 * PAGE)
    assert b1.batch_set_v1(keys, src1) == [True] * 3  # a non-writer stores nothing
    assert b1.batch_exists(keys) == 0 and b1.skipped_writes == 3
    p0 = c0.mem_pool_host
    src0 = p0.alloc(3 * PAGE)
    assert c0._page_set_zero_copy(keys, src0)
    dst1 = c1.mem_pool_host.alloc(3 * PAGE)
    assert b1.batch_exists(keys) == 3
    assert c1._page_get_zero_copy(PrefetchOperation("r", []), keys, dst1) == 3
    assert all(torch.equal(a, b) for a, b in zip(pages_of(c1.mem_pool_host, dst1), pages_of(p0, src0)))


def test_redis_down_means_misses_and_failed_writes(model, controllers):
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    c = controller("mha", "page_first", f"redis://127.0.0.1:{port}/0", model)
    controllers.append(c)
    pool, keys = c.mem_pool_host, keys_for(2, seed=7)
    src, dst = pool.alloc(2 * PAGE), pool.alloc(2 * PAGE)
    before = pages_of(pool, dst)
    assert c._page_set_zero_copy(keys, src) is False
    assert c.storage_backend.batch_exists(keys) == 0
    assert c._page_get_zero_copy(PrefetchOperation("r", []), keys, dst) == 0
    # Reads land straight in the destination, so a refused page is zeroed (as on file://):
    # untouched or zero, never bytes from anywhere else.
    assert all(torch.equal(a, b) or not a.any() for a, b in zip(pages_of(pool, dst), before))
    s = c.storage_backend.hicache_stats()
    assert s.put_dropped == 2 and s.misses == 2
    c.storage_backend.check_integrity()


def test_redis_going_down_mid_run(model, private_redis_url):
    url, stop = private_redis_url
    b, pool = make_backend("mla", "layer_first", url, model, timeout_ms=100, max_retries=0)
    keys = keys_for(2, seed=8)
    assert b.batch_set_v1(keys, pool.alloc(2 * PAGE)) == [True, True]
    stop()
    dst = pool.alloc(2 * PAGE)
    before = pages_of(pool, dst)
    assert b.batch_exists(keys) == 0
    assert b.batch_get_v1(keys, dst) == [False, False]
    assert b.batch_set_v1(keys_for(1, seed=9), pool.alloc(PAGE)) == [False]
    assert all(torch.equal(a, c) or not a.any() for a, c in zip(pages_of(pool, dst), before))  # zeroed or untouched
    assert b.store.down


def test_unsupported_pool_and_missing_url_fail_loudly(tmp_path, model):
    with pytest.raises(ConfigError, match="url"):
        HiCacheBackend(storage_config("mha", "page_first", "", model=model), {})
    b = HiCacheBackend(storage_config("mha", "page_head", f"file://{tmp_path}", model=model), {})
    pool = host_pool("mha", "page_first")
    pool.layout = "page_head"  # a layout this backend does not store
    with pytest.raises(ConfigError, match="page_head"):
        b.register_mem_pool_host(pool)
    with pytest.raises(RuntimeError, match="register_mem_pool_host"):
        b.batch_exists(["x"])


def test_check_integrity_catches_a_pool_that_changed_under_it(tmp_path, model):
    b, pool = make_backend("mla", "page_first", f"file://{tmp_path}/l3", model)
    b.check_integrity()
    pool.layout = "page_first_direct"  # the pool now stores pages in another byte order
    with pytest.raises(IntegrityError, match="fingerprint"):
        b.check_integrity()
