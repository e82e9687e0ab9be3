"""HiCache tier movement: write policies, L2 eviction safety, prefetch policies,
L3 outages. Pages carry recognisable bytes so every move is checked by value."""
import pytest
import torch

from hicache.core.errors import OutOfPages
from tests.helpers.expected import Expected, Movement, assert_expected
from tests.helpers.tiers import TOK, check_l1_values, make, page_value, serve
from tests.helpers.tiers import CopyGate as _Gate


def test_write_through_backs_up_every_inserted_page():
    hc = make()
    before = Movement.start(hc)
    serve(hc, "a", TOK)
    hc.drain()
    assert_expected(before.observe(hc), Expected(backed_up_pages=5))
    assert hc.cache.stats().host_pages_cached == 5
    hc.evict(100)
    before = Movement.start(hc)
    adm, _ = serve(hc, "b", TOK)
    assert_expected(before.observe(hc, adm), Expected(host_tokens=20, loaded_l2_pages=5))
    assert check_l1_values(hc, TOK) == 20
    hc.check_integrity()
    hc.close()


def test_write_through_selective_waits_for_hits():
    hc = make(**{"policy.write_policy": "write_through_selective", "policy.write_through_threshold": 2})
    serve(hc, "a", TOK)
    hc.drain()
    assert hc.cache.stats().host_pages_cached == 0  # inserted, never hit
    serve(hc, "b", TOK)
    serve(hc, "c", TOK)
    hc.drain()
    assert hc.cache.stats().host_pages_cached == 5
    hc.check_integrity()
    hc.close()


def test_write_back_saves_on_eviction_only():
    hc = make(**{"policy.write_policy": "write_back"})
    before = Movement.start(hc)
    serve(hc, "a", TOK)
    hc.drain()
    assert_expected(before.observe(hc), Expected())  # nothing written yet
    hc.evict(100)
    assert_expected(before.observe(hc), Expected(backed_up_pages=5, evicted_l1_pages=5, write_back_queued_pages=5))
    assert hc.cache.stats().host_pages_cached == 5 and hc.cache.stats().device_pages_cached == 0
    before = Movement.start(hc)
    adm, _ = serve(hc, "b", TOK)
    assert_expected(before.observe(hc, adm), Expected(host_tokens=20, loaded_l2_pages=5))
    assert check_l1_values(hc, TOK) == 20
    hc.check_integrity()
    hc.close()


def test_l2_eviction_skips_pages_in_flight_and_locked():
    hc = make(**{"pool.host_pages": "5"})
    serve(hc, "a", TOK)
    hc.drain()
    hc.evict(100)  # TOK now L2-only (5 pages, L2 full)
    req = hc.new_request("b", TOK)
    adm = hc.admit(req)  # load back in flight: its L2 pages are host-locked until observed
    assert adm.loads and hc.evict_host(100) == []
    adm.wait()
    hc.poll()
    freed = hc.evict_host(100)  # observed: now the L2 copies may go
    assert len(freed) == 5
    req.abort()
    hc.check_integrity()
    hc.close()


@pytest.mark.parametrize("policy", ["best_effort", "wait_complete", "timeout"])
def test_prefetch_policies_from_l3(policy, tmp_path):
    url = f"file://{tmp_path}/l3"
    a = make(url)
    serve(a, "a", TOK)
    a.drain()
    assert a.stats().tiers.storage_put_pages == 5
    a.close()
    # A generous budget for "timeout": the test checks that the policy waits for a
    # prefetch that completes within it, not how fast a loaded machine reads 5 pages.
    extra = {"policy.prefetch_timeout_base_ms": 5000.0} if policy == "timeout" else {}
    b = make(url, **{"policy.prefetch_policy": policy}, **extra)  # a new process: empty L1/L2
    adm, req = serve(b, "b", TOK)
    if policy == "best_effort":  # did not wait: served from what L1/L2 had (nothing)
        assert adm.storage_tokens in (0, 20)
    else:
        assert (adm.host_tokens, adm.storage_tokens) == (20, 20)
        assert check_l1_values(b, TOK) == 20
    b.drain()
    m, l3 = b.match(TOK, storage=True)
    assert m.tokens == 20
    b.check_integrity()
    b.close()


def test_l3_down_is_a_miss_and_writes_are_dropped(tmp_path):
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens here
    hc = make(f"redis://127.0.0.1:{port}/0", **{"storage.timeout_ms": 30})
    serve(hc, "a", TOK)
    hc.drain()
    hc.evict(100)
    hc.evict_host(100)
    adm, _ = serve(hc, "b", TOK)  # L3 probe fails fast: recompute
    hc.drain()
    assert adm.storage_tokens == 0
    st = hc.stats()
    assert st.tiers.storage_put_dropped_pages + st.storage.put_dropped >= 5
    assert st.as_dict()["tiers"]["storage_put_dropped_pages"] == st.tiers.storage_put_dropped_pages
    hc.check_integrity()
    hc.close()


def test_redis_round_trip_through_tiers(redis_url):
    a = make(redis_url)
    tok = [t + 7 for t in TOK]  # distinct keys from other tests on the shared server
    serve(a, "a", tok)
    a.drain()
    a.close()
    b = make(redis_url)
    adm, _ = serve(b, "b", tok)
    assert adm.storage_tokens == 20 and check_l1_values(b, tok) == 20
    b.close()


# --------------------------------------------------------------- load-back races
# The copy worker is held at a gate so that the scheduler acts while a load back
# is still in flight (found in review; each failed before the fix).

def _l2_only(hc, tokens):
    serve(hc, "warm", tokens)
    hc.drain()
    hc.evict(100)
    assert hc.cache.match(tokens).host_tokens == 20


def test_abort_during_load_back_keeps_its_l1_pages_pinned(monkeypatch):
    hc = make(**{"pool.device_pages": "6"})
    _l2_only(hc, TOK)
    gate = _Gate(monkeypatch)
    req = hc.new_request("b", TOK)
    adm = hc.admit(req)
    loading = list(adm.match.device_pages)
    req.abort()  # before the load completed
    r2 = hc.new_request("c", [5000 + i for i in range(21)])
    hc.admit(r2)
    with pytest.raises(OutOfPages):  # the only evictable pages are the ones being filled
        r2.alloc(21)
    assert not set(r2.pages) & set(loading)
    gate.open()
    hc.drain()
    r2.alloc(21)  # now the loaded node is unlocked and may be evicted
    r2.abort()
    hc.check_integrity()
    hc.close()


def test_commit_onto_pages_still_loading_waits_for_the_load(monkeypatch):
    hc = make()
    c = hc.new_request("c", TOK)  # computes the prompt itself, concurrently with b's load
    hc.admit(c)
    c.alloc(21)
    _l2_only(hc, TOK)
    gate = _Gate(monkeypatch)
    b = hc.new_request("b", TOK)
    hc.admit(b)
    slots = hc.device_pool.slot_ids(c.pages)
    for i, buf in enumerate(hc.device_pool.buffers):
        for pos in range(21):
            buf[slots[pos]] = page_value(TOK[pos], i)
    import threading
    threading.Timer(0.2, gate.open).start()
    c.commit()  # dedups onto b's loading pages: must wait for the load first
    slots = hc.device_pool.slot_ids(c.pages)
    for i, buf in enumerate(hc.device_pool.buffers):
        for pos in range(20):
            assert torch.all(buf[slots[pos]] == page_value(TOK[pos], i)), (pos, i)
    c.finish()
    b.abort()
    hc.drain()
    hc.check_integrity()
    hc.close()


def test_failed_load_back_stops_the_cache_from_serving(monkeypatch):
    import hicache.transfer.engine as tr
    from hicache.core.errors import TransferError
    hc = make()
    _l2_only(hc, TOK)

    def broken(*a, **k):
        raise RuntimeError("simulated copy failure")
    monkeypatch.setattr(tr, "_copy_pages", broken)
    req = hc.new_request("b", TOK)
    adm = hc.admit(req)
    with pytest.raises(RuntimeError, match="simulated"):
        adm.wait()  # the request itself sees the failure
    hc.transfers.wait_all()  # done, not yet observed: poll() hands the result to complete_load
    with pytest.raises(TransferError, match="unknown bytes"):
        hc.poll()
    with pytest.raises(TransferError):
        hc.admit(hc.new_request("c", TOK))
