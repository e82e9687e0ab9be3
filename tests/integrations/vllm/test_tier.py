"""HiCacheTier against vLLM's SecondaryTierManager contract, byte for byte, over
real stores: round trips, lookups (own knowledge, async L3 probe), corruption,
foreign layouts, an unreachable Redis, and check_integrity."""
from __future__ import annotations

import itertools
import socket

import numpy as np
import pytest
from vllm.v1.kv_offload.base import LookupResult, ReqContext

from hicache.core.errors import IntegrityError
from hicache.integrations.vllm import page_hash

from .tiers import ROW, finish, job, keys, primary, resolve, tier

_ids = itertools.count(1)


@pytest.fixture(params=["file", "memory", "redis"])
def url(request, tmp_path, redis_url):
    if request.param == "file":
        return f"file://{tmp_path}/l3"
    if request.param == "memory":
        return "memory://"
    return redis_url


@pytest.fixture(params=["file", "redis"])
def shared_url(request, tmp_path, redis_url):
    """Stores two backend objects can share (memory:// is private to one)."""
    return f"file://{tmp_path}/l3" if request.param == "file" else redis_url


def _prefix(request) -> str:
    return f"hicache-vllm-test:{request.node.name}:{next(_ids)}:"


def _fill(arr: np.ndarray, rows: list[int], seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    arr[rows] = rng.integers(-128, 128, size=(len(rows), ROW), dtype=np.int8)
    return arr[rows].copy()



def test_store_then_load_is_byte_exact(url, request):
    arr, view = primary()
    t = tier(url, view, key_prefix=_prefix(request), probe_l3=False)
    ks = keys(1, 2, 3)
    want = _fill(arr, [0, 1, 2], seed=1)
    t.submit_store(job(1, ks, [0, 1, 2], promotion=False))
    res = finish(t)
    assert res[1].success and res[1].transfer_bytes == 3 * ROW
    assert [t.lookup(k, ReqContext("q")) for k in ks] == [LookupResult.HIT] * 3
    arr[:] = 0
    t.submit_load(job(2, ks, [5, 3, 7], promotion=True))
    res = finish(t)
    assert res[2].success and res[2].successful_keys is None
    assert np.array_equal(arr[[5, 3, 7]], want) and not arr[[0, 1, 2, 4, 6]].any()
    s = t.stats()
    assert (s.stored, s.hits, s.misses, s.bytes_read) == (3, 3, 0, 3 * ROW)
    t.check_integrity()
    t.shutdown()


def test_known_chunks_are_not_rewritten(url, request):
    arr, view = primary()
    t = tier(url, view, key_prefix=_prefix(request), probe_l3=False)
    _fill(arr, [0, 1], seed=2)
    t.submit_store(job(1, keys(1), [0], promotion=False))
    finish(t)
    t.submit_store(job(2, keys(1, 2), [0, 1], promotion=False))
    assert finish(t)[2].success
    s = t.stats()
    assert (s.stored, s.skipped, t.storage.stats().put_ok) == (2, 1, 2)
    t.shutdown()


def test_unknown_chunks_answer_retry_then_the_probe(shared_url, request):
    """A second tier (another vLLM instance, or a restart) finds what the first
    stored: RETRY while vLLM's async lookup runs, then HIT, and the load is exact."""
    url = shared_url
    prefix = _prefix(request)
    arr, view = primary()
    writer = tier(url, view, key_prefix=prefix, probe_l3=False)
    want = _fill(arr, [0, 1], seed=3)
    writer.submit_store(job(1, keys(1, 2), [0, 1], promotion=False))
    assert finish(writer)[1].success
    writer.shutdown()

    arr2, view2 = primary()
    reader = tier(url, view2, key_prefix=prefix)
    ctx = ReqContext("later")
    assert reader.lookup(keys(1)[0], ctx) is LookupResult.RETRY
    assert [resolve(reader, k, ctx) for k in keys(1, 2, 9)] == [LookupResult.HIT, LookupResult.HIT,
                                                                  LookupResult.MISS]
    reader.submit_load(job(2, keys(1, 2), [4, 6], promotion=True))
    assert finish(reader)[2].success
    assert np.array_equal(arr2[[4, 6]], want)
    reader.on_request_finished(ctx)
    reader.check_integrity()
    reader.shutdown()


def test_tampered_object_is_a_miss_never_wrong_bytes(tmp_path, request):
    arr, view = primary()
    t = tier(f"file://{tmp_path}/l3", view, key_prefix=_prefix(request), probe_l3=False)
    ks = keys(1, 2)
    want = _fill(arr, [0, 1], seed=4)
    t.submit_store(job(1, ks, [0, 1], promotion=False))
    finish(t)
    # Flip one payload byte of chunk 2's object on disk.
    path = t.storage._path(t.storage._full(page_hash(ks[1])))[1]
    blob = bytearray(open(path, "rb").read())
    blob[-1] ^= 0xFF
    open(path, "wb").write(bytes(blob))
    with pytest.raises(IntegrityError, match="fail verification"):
        t.check_integrity()

    arr[:] = 0
    t.submit_load(job(2, ks, [3, 4], promotion=True))
    r = finish(t)[2]
    assert not r.success and tuple(r.successful_keys) == (ks[0],)
    # Loads read into the rows and verify there (hicache.storage.into): row 4 held the
    # tampered bytes and was zeroed; vLLM is told chunk 2 did not load.
    assert np.array_equal(arr[3], want[0]) and not np.delete(arr, [3], axis=0).any()
    assert t.storage.stats().corrupt == 1 and t.stats().misses == 1
    assert t.lookup(ks[1], ReqContext("q")) is LookupResult.MISS  # forgotten, recomputed next time
    t.check_integrity()  # the corrupt object was deleted on read
    t.shutdown()


def test_foreign_layout_is_a_miss(shared_url, request):
    """Same key prefix, another model: the fingerprint differs, nothing is loaded."""
    url = shared_url
    prefix = _prefix(request)
    arr, view = primary()
    a = tier(url, view, model="model-a", key_prefix=prefix, probe_l3=False)
    _fill(arr, [0], seed=5)
    a.submit_store(job(1, keys(1), [0], promotion=False))
    assert finish(a)[1].success
    arr2, view2 = primary()
    b = tier(url, view2, model="model-b", key_prefix=prefix)
    assert a.fingerprint != b.fingerprint
    b.submit_load(job(2, keys(1), [1], promotion=True))
    r = finish(b)[2]
    # Only the destination row (1) may have been written; vLLM is told nothing loaded.
    assert not r.success and r.successful_keys is None and not np.delete(arr2, 1, axis=0).any()
    assert b.storage.stats().fingerprint_mismatch == 1
    a.shutdown()
    b.shutdown()


def test_redis_down_means_misses_and_failed_stores(request):
    with socket.socket() as s:  # a loopback port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    arr, view = primary()
    t = tier(f"redis://127.0.0.1:{port}/0", view, key_prefix=_prefix(request), timeout_ms=20, max_retries=0)
    ks = keys(1, 2)
    _fill(arr, [0, 1], seed=6)
    t.submit_store(job(1, ks, [0, 1], promotion=False))
    t.submit_load(job(2, ks, [2, 3], promotion=True))
    res = finish(t)
    assert not res[1].success and res[1].transfer_bytes == 0
    assert not res[2].success and res[2].successful_keys is None and not arr[[2, 3]].any()
    ctx = ReqContext("q")
    assert [resolve(t, k, ctx) for k in ks] == [LookupResult.MISS] * 2
    s = t.stats()
    assert (s.stored, s.dropped, s.misses) == (0, 2, 2)
    t.check_integrity()
    t.shutdown()
