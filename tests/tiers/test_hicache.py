"""HiCache tier movement: write policies, L2 eviction safety, prefetch policies,
L3 outages. Pages carry recognisable bytes so every move is checked by value."""
import pytest
import torch

from hicache.config import HiCacheConfig
from hicache.errors import OutOfPages
from hicache.hicache import HiCache
from hicache.layout import KVLayout

PS = 4


def make(url="", **over):
    layout = KVLayout(model_id="t", num_layers=2, num_kv_heads=1, head_dim=4, dtype="float32",
                      page_size=PS, host_layout="page_first")
    o = {"storage.url": url, "pool.device": "cpu", "pool.device_pages": "16", "pool.host_pages": "32",
         "policy.prefetch_policy": "wait_complete"}
    o.update({k: str(v) for k, v in over.items()})
    return HiCache(HiCacheConfig.load(env={}, overrides=o), layout=layout)


def page_value(token: int, plane: int) -> float:
    return float(token * 10 + plane)


def serve(hc, rid, tokens, finish=True):
    """Admit, 'compute' the missing tokens by writing token-derived values, commit."""
    req = hc.new_request(rid, tokens)
    adm = hc.admit(req)
    adm.wait()
    start = req.computed_tokens
    req.alloc(len(tokens) - start)
    slots = hc.device_pool.slot_ids(req.pages)[:len(tokens)]
    for i, buf in enumerate(hc.device_pool.buffers):
        for pos in range(start, len(tokens)):
            buf[slots[pos]] = page_value(tokens[pos], i)
    req.commit()
    if finish:
        req.finish()
    hc.poll()
    return adm, req


def check_l1_values(hc, tokens):
    m = hc.cache.match(tokens)
    slots = hc.device_pool.slot_ids(m.device_pages)
    for i, buf in enumerate(hc.device_pool.buffers):
        for pos in range(m.device_tokens):
            assert torch.all(buf[slots[pos]] == page_value(tokens[pos], i)), (pos, i)
    return m.device_tokens


TOK = list(range(100, 121))  # 5 pages + 1 token


def test_write_through_backs_up_every_inserted_page():
    hc = make()
    serve(hc, "a", TOK)
    hc.drain()
    assert hc.cache.stats().host_pages_cached == 5
    hc.evict(100)
    adm, _ = serve(hc, "b", TOK)
    assert (adm.device_tokens, adm.host_tokens) == (0, 20)
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
    serve(hc, "a", TOK)
    hc.drain()
    assert hc.cache.stats().host_pages_cached == 0
    hc.evict(100)
    assert hc.cache.stats().host_pages_cached == 5 and hc.cache.stats().device_pages_cached == 0
    adm, _ = serve(hc, "b", TOK)
    assert adm.host_tokens == 20 and check_l1_values(hc, TOK) == 20
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

class _Gate:
    def __init__(self, monkeypatch):
        import threading
        import hicache.transfer as tr
        self.event = threading.Event()
        orig = tr._copy_pages

        def held(*a, **k):
            self.event.wait()
            orig(*a, **k)
        monkeypatch.setattr(tr, "_copy_pages", held)

    def open(self):
        self.event.set()


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
    import hicache.transfer as tr
    from hicache.errors import TransferError
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
