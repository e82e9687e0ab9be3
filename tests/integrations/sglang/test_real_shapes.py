"""Every published model shape (hicache.core.shapes) through SGLang's own host pools,
storage backend factory and HiCacheController, at SGLang's page sizes, byte-exact
over file://, memory:// and redis://.

Page sizes, from SGLang 0.5.23's page-size resolution (``arg_groups/overrides.py``):
``page_size`` defaults to 1 (fa3, flashinfer, triton: the Hopper and Ampere
defaults); ``trtllm_mha`` needs 16, 32, 64 or 128 (16 is its smallest); the MLA
kernels ``flashmla``, ``trtllm_mla`` and ``cutedsl_mla`` force 64. So MHA/GQA
models run at 1 and 16, MLA models at 1 and 64.

Every model runs with all its layers (each page at its real bytes: up to 4.4 MiB
for DeepSeek-V3 at page 64, 4 MiB for Qwen3-32B at page 16). Hybrid rows of the
table: gpt-oss-120b's sliding layers are pooled as full KV (SGLang's
``--disable-hybrid-swa-memory``); qwen3-next's 12 full-attention layers are its
MHA pool (its Mamba state lives in a v2 side pool: test_hybrid_pools.py). DeepSeek-V3's MTP layer has its own pool in SGLang's draft worker,
so the target pool holds the 61 model layers.
"""
from __future__ import annotations

import pytest
import torch
from sglang.srt.managers.cache_controller import PrefetchOperation
from sglang.srt.mem_cache.storage import StorageBackendFactory
from sglang.srt.mem_cache.utils import get_storage_hash_str

from hicache.integrations.sglang import HiCacheBackend
from hicache.core.shapes import ModelShape, model_shapes

from .conftest import LAYOUTS, storage_config
from .launch import page_bytes, real_pools

PAGES = 3  # pages stored and read back per round trip
pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py: many MiB-sized tensor fills


def page_sizes(m: ModelShape) -> tuple[int, ...]:
    return (1, 64) if m.is_mla else (1, 16)


CASES = [pytest.param(m, ps, id=f"{m.name}-p{ps}") for m in model_shapes() for ps in page_sizes(m)]


def keys_for(page: int, n: int, seed: int) -> list[str]:
    return get_storage_hash_str([seed * 100_000 + i for i in range(n * page)], None, page_size=page)


def urls(tmp_path, redis_url) -> dict[str, str]:
    return {"file": f"file://{tmp_path}/l3", "memory": "memory://", "redis": redis_url}


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("m, page", CASES)
def test_real_shape_round_trips_through_sglang_pools(m, page, layout, tmp_path, redis_url, model):
    _, host = real_pools(m, page, layout)
    kind = "mla" if m.is_mla else "mha"
    per_page = m.layer_token_bytes * m.attention_layers * page
    assert host.get_size_per_token() * page == per_page  # SGLang's own page size is the table's
    for seed, (scheme, url) in enumerate(urls(tmp_path, redis_url).items()):
        cfg = storage_config(kind, layout, url, model=f"{model}-{m.name}")
        b = StorageBackendFactory.create_backend("dynamic", cfg, host)
        assert isinstance(b, HiCacheBackend)
        b.register_mem_pool_host(host)
        assert b.layout.page_bytes == per_page, (scheme, b.layout.page_bytes, per_page)
        keys = keys_for(page, PAGES, seed)
        src, dst = host.alloc(PAGES * page), host.alloc(PAGES * page)
        want = page_bytes(host, src)
        assert b.batch_set_v1(keys, src) == [True] * PAGES, scheme
        assert b.batch_exists(keys) == PAGES
        assert b.batch_get_v1(keys, dst) == [True] * PAGES, scheme
        got = page_bytes(host, dst)
        assert all(torch.equal(g, w) for g, w in zip(got, want)), f"{scheme}: bytes differ"
        s = b.hicache_stats()
        assert (s.put_ok, s.hits, s.misses, s.bytes_read) == (PAGES, PAGES, 0, PAGES * per_page), scheme
        b.check_integrity()
        assert b.clear() is not None
        b.close()
        host.free(src)
        host.free(dst)


@pytest.mark.parametrize("m, page", CASES)
def test_real_shape_through_hicache_controller(m, page, tmp_path, redis_url, model, controllers):
    """SGLang's HiCacheController with the dynamic backend: its zero-copy v1 page
    functions and its generic (copying) ones read each other's pages, byte-exact."""
    import threading

    from sglang.srt.managers.cache_controller import HiCacheController
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator

    from .conftest import dynamic_config, parallel
    layout = "page_first"  # SGLang's default --hicache-mem-layout
    dev, host = real_pools(m, page, layout, dev_pages=8)
    alloc = PagedTokenToKVPoolAllocator(dev.size, page, dev.dtype, "cpu", dev, False)
    url = redis_url if page > 1 else f"file://{tmp_path}/l3"
    with parallel():
        c = HiCacheController(alloc, host, page, None, threading.Event(), storage_backend="dynamic",
                              model_name=f"{model}-{m.name}", storage_backend_extra_config=dynamic_config(url))
    controllers.append(c)
    assert isinstance(c.storage_backend, HiCacheBackend)
    assert c.page_get_func == c._page_get_zero_copy
    keys = keys_for(page, 4, seed=7)
    src, dst, dst2 = (host.alloc(4 * page) for _ in range(3))
    want = page_bytes(host, src)
    assert c._page_set_zero_copy(keys[:2], src[:2 * page]) is True
    assert c._generic_page_set(keys[2:], src[2 * page:]) is True
    op = PrefetchOperation("r", list(range(4 * page)))
    assert c._page_get_zero_copy(op, keys, dst) == 4
    assert all(torch.equal(g, w) for g, w in zip(page_bytes(host, dst), want))
    assert c._generic_page_get(op, keys, dst2) == 4
    assert all(torch.equal(g, w) for g, w in zip(page_bytes(host, dst2), want))
    c.storage_backend.check_integrity()
    c.storage_backend.clear()
