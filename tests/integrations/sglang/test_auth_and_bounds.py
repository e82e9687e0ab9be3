"""The L3 MAC key reaches the SGLang backend (extra config, key file, environment):
its objects carry the MAC and a forged one is a counted miss that never lands in
the host pool. Per-call state the backend keeps is bounded (10x the cap)."""
from __future__ import annotations

import pytest
import torch
from sglang.srt.managers.cache_controller import PrefetchOperation
from sglang.srt.mem_cache.storage import StorageBackendFactory

from hicache.core.errors import ConfigError
from hicache.integrations.sglang import HiCacheBackend
from hicache.integrations.sglang_keys import AUTH_ENV, page_key

from .conftest import PAGE, controller, host_pool, storage_config
from .test_backend import keys_for, pages_of

KEY = "k" * 24  # 24 bytes: above the 16-byte floor


def backend(url, model, pool, **extra) -> HiCacheBackend:
    b = StorageBackendFactory.create_backend("dynamic", storage_config("mha", "page_first", url, model=model, **extra),
                                             pool)
    b.register_mem_pool_host(pool)
    return b


@pytest.mark.parametrize("source", ["extra", "file", "env", "env_file"])
def test_keyed_objects_round_trip_and_a_forgery_is_a_counted_miss(source, l3_url, model, tmp_path, monkeypatch):
    for name in AUTH_ENV:
        monkeypatch.delenv(name, raising=False)
    secret = tmp_path / "secret"
    secret.write_text(KEY + "\n")
    extra = {"extra": {"auth_key": KEY}, "file": {"auth_key_file": str(secret)}}.get(source, {})
    if source == "env":
        monkeypatch.setenv(AUTH_ENV[0], KEY)
    if source == "env_file":
        monkeypatch.setenv(AUTH_ENV[1], str(secret))
    pool = host_pool("mha", "page_first")
    keyed = backend(l3_url, model, pool, **extra)
    assert keyed.store.options.auth_key  # the MAC is on
    keys = keys_for(3, seed=11)
    src, dst = pool.alloc(3 * PAGE), pool.alloc(3 * PAGE)
    want = pages_of(pool, src)
    assert keyed.batch_set_v1(keys, src) == [True] * 3
    assert keyed.batch_get_v1(keys, dst) == [True] * 3
    assert all(torch.equal(a, w) for a, w in zip(pages_of(pool, dst), want))
    # A writer without the key (same layout, so same keys) overwrites page 1: a forgery.
    for name in AUTH_ENV:
        monkeypatch.delenv(name, raising=False)
    forger = backend(l3_url, model, pool)
    assert not forger.store.options.auth_key
    assert forger.store.delete([page_key(keys[1])]) == 1  # batch_set_v1 skips pages L3 holds
    other = pool.alloc(PAGE)
    forged = pages_of(pool, other)[0]
    assert forger.batch_set_v1(keys[1:2], other) == [True]
    dst2 = pool.alloc(3 * PAGE)
    assert keyed.batch_get_v1(keys, dst2) == [True, False, False]
    got = pages_of(pool, dst2)
    assert torch.equal(got[0], want[0])
    # Pages from the miss on are reported not loaded, and the forger's bytes are not left
    # in the host pool (issue 36, row 11): file:// reads into the pool and verifies there
    # (hicache.storage.into), then zeroes the refused page; Redis copies verified pages only.
    assert forged.any() and not torch.equal(got[1], forged)
    assert not got[1].any() or not keyed.store.DIRECT_IO
    assert torch.equal(got[2], want[2])
    s = keyed.hicache_stats()
    assert s.corrupt == 1 and s.misses == 1
    assert keyed.adapter_stats().corrupt == 1
    keyed.check_integrity()
    keyed.close()
    forger.close()


def test_a_short_key_or_an_unreadable_key_file_fails_at_start(tmp_path, model, monkeypatch):
    for name in AUTH_ENV:
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(ConfigError, match="at least 16 bytes"):
        backend(f"file://{tmp_path}/l3", model, host_pool("mha", "page_first"), auth_key="short")
    with pytest.raises(ConfigError, match="auth_key_file"):
        HiCacheBackend(storage_config("mha", "page_first", f"file://{tmp_path}", model=model,
                                      auth_key_file=str(tmp_path / "missing")), {})
    with pytest.raises(ConfigError, match="auth_key must be a string"):
        HiCacheBackend(storage_config("mha", "page_first", f"file://{tmp_path}", model=model, auth_key=123), {})


def test_per_call_figures_stay_bounded_at_ten_times_the_cap(tmp_path, model, controllers):
    """SGLang drains get_stats() only with its storage metrics on; without, the
    figures of each call are kept up to stats_window (the latest ones)."""
    window = 8
    c = controller("mla", "page_first", "memory://", model, extra={"stats_window": window})
    controllers.append(c)
    b, pool = c.storage_backend, c.mem_pool_host
    assert b.stats_window == window
    src, dst = pool.alloc(PAGE), pool.alloc(PAGE)
    for i in range(10 * window):
        keys = keys_for(1, seed=100 + i)
        assert c._page_set_zero_copy(keys, src)
        assert c._page_get_zero_copy(PrefetchOperation("r", []), keys, dst) == 1
    assert len(b._transfers.backup_pgs) == len(b._transfers.prefetch_bandwidth) == window
    b.check_integrity()
    m = b.get_stats()
    assert m.backup_pgs == [1] * window and m.prefetch_pgs == [1] * window
    assert b.get_stats().backup_pgs == []
    assert b.adapter_stats().stored == b.adapter_stats().hits == 10 * window  # counters are not capped
    with pytest.raises(ConfigError, match="stats_window"):
        HiCacheBackend(storage_config("mha", "page_first", "memory://", model=model, stats_window=0), {})
