"""HiCacheTier's bounded state and trust: the known-chunk LRU driven to 10x its
cap (size stays at the cap, answers stay right, loads correct it), and the auth
key (objects carry a MAC; a forged object is a counted miss, never bytes)."""
from __future__ import annotations

import itertools

import numpy as np
import pytest
from vllm.v1.kv_offload.base import LookupResult, ReqContext

from hicache.core.errors import ConfigError
from hicache.integrations.vllm import page_hash
from hicache.storage import codec

from .tiers import ROW, finish, job, keys, primary, resolve, tier

_ids = itertools.count(1)
CAP = 8
KEY = "k" * 32


def _prefix(request) -> str:
    return f"hicache-vllm-state:{request.node.name}:{next(_ids)}:"



@pytest.mark.parametrize("probe", [False, True])
def test_known_chunks_stay_at_the_cap_at_ten_times_it(redis_url, request, probe):
    arr, view = primary()
    t = tier(redis_url, view, key_prefix=_prefix(request), probe_l3=probe, max_known_chunks=CAP)
    arr[:] = np.arange(ROW, dtype=np.int8)
    n = 10 * CAP
    for j in range(n // 4):  # 20 jobs of 4 chunks
        t.submit_store(job(j + 1, keys(*range(4 * j, 4 * j + 4)), [0, 1, 2, 3], promotion=False))
        assert finish(t)[j + 1].success
        assert t.known_chunks() == min(CAP, 4 * (j + 1))
        t.check_integrity()
    ctx = ReqContext("q")
    assert [t.lookup(k, ctx) for k in keys(*range(n - CAP, n))] == [LookupResult.HIT] * CAP  # the newest
    old = keys(*range(n - CAP))
    if probe:  # forgotten, not lost: L3 is asked and answers
        assert [resolve(t, k, ctx) for k in old] == [LookupResult.HIT] * len(old)
    else:
        assert [t.lookup(k, ctx) for k in old] == [LookupResult.MISS] * len(old)
    assert t.known_chunks() == CAP
    s = t.stats()
    assert (s.stored, s.dropped) == (n, 0)
    assert s.lookups == s.lookup_hits + s.lookup_misses + s.lookup_retries
    t.on_request_finished(ctx)
    t.check_integrity()
    t.shutdown()


def test_a_load_that_misses_forgets_the_chunk(redis_url, request):
    """Redis evicted a chunk the tier knows (or restarted): the load misses and
    the tier stops answering HIT for it."""
    arr, view = primary()
    t = tier(redis_url, view, key_prefix=_prefix(request), probe_l3=False, max_known_chunks=CAP)
    ks = keys(1, 2)
    t.submit_store(job(1, ks, [0, 1], promotion=False))
    finish(t)
    assert t.storage.delete([page_hash(ks[1])]) == 1
    t.submit_load(job(2, ks, [2, 3], promotion=True))
    r = finish(t)[2]
    assert not r.success and tuple(r.successful_keys) == (ks[0],)
    ctx = ReqContext("q")
    assert [t.lookup(k, ctx) for k in ks] == [LookupResult.HIT, LookupResult.MISS]
    assert t.known_chunks() == 1 and t.stats().misses == 1
    t.check_integrity()
    t.shutdown()


def test_cap_must_be_positive(tmp_path):
    _, view = primary()
    with pytest.raises(ConfigError, match="known-chunk cap 0"):
        tier(f"file://{tmp_path}/l3", view, max_known_chunks=0)


@pytest.mark.parametrize("how", ["extra_config", "env"])
def test_auth_key_signs_and_a_forged_object_is_a_counted_miss(tmp_path, request, monkeypatch, how):
    url, prefix = f"file://{tmp_path}/l3", _prefix(request)
    opts = {"auth_key": KEY} if how == "extra_config" else {}
    if how == "env":
        monkeypatch.setenv("HICACHE_STORAGE__AUTH_KEY", KEY)
    arr, view = primary()
    t = tier(url, view, key_prefix=prefix, probe_l3=False, **opts)
    ks = keys(1, 2)
    arr[:2] = 7
    t.submit_store(job(1, ks[:1], [0], promotion=False))
    assert finish(t)[1].success
    # What a party that can write the store but lacks the key writes: a well-formed
    # object of this layout (right fingerprint, checksum), with no valid MAC.
    forged = codec.encode(t.fingerprint, page_hash(ks[1]), [ROW], bytes([0x66]) * ROW)
    path = t.storage.path_of(page_hash(ks[1]))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(forged)
    signed = t.storage.path_of(page_hash(ks[0])).read_bytes()
    assert codec.decode(signed, page_hash(ks[0]), t.fingerprint, [ROW], codec.mac_key(KEY.encode())).status \
        is codec.ReadStatus.OK  # the tier's own object carries the MAC
    arr[:] = 0
    t.submit_load(job(2, ks, [2, 3], promotion=True))
    r = finish(t)[2]
    assert not r.success and tuple(r.successful_keys) == (ks[0],)
    # Row 3 was read and verified in place (hicache.storage.into), then zeroed: the
    # forged bytes are not left in vLLM's rows (issue 36, row 11), and vLLM is told
    # chunk 2 did not load.
    assert (arr[2] == 7).all() and not np.delete(arr, [2], axis=0).any()
    s = t.stats()
    assert (s.hits, s.misses, s.corrupt) == (1, 1, 1)
    t.check_integrity()
    t.shutdown()


def test_auth_key_too_short_names_the_setting(tmp_path):
    _, view = primary()
    with pytest.raises(ConfigError, match="auth_key"):
        tier(f"file://{tmp_path}/l3", view, auth_key="short")
