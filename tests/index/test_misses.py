"""hicache.index.misses: one reason per missed page, a bounded window, and the L3 outcomes."""
from __future__ import annotations

import pytest

from hicache.core.errors import IntegrityError
from hicache.index.misses import L1, L2, L3, REASONS, L3Outcome, MissTracker

H = [bytes([i]) * 16 for i in range(8)]  # page hashes; a request passes those of its full pages


def got(stats) -> dict[str, int]:
    return {k: v for k, v in stats.as_dict().items() if v and k in REASONS}


def test_each_tier_gives_its_reason_and_they_sum_to_the_misses():
    t = MissTracker(window=100)
    t.reached(H[1:2], L1)
    t.reached(H[2:3], L2)
    t.reached(H[3:4], L3)
    # 6 pages (the last partial), hit 0, may hit 5: H0 new, H1 L1, H2 L2, H3 L3 (no lookup), H4 new
    r = t.account(H[:5], 6, 0, 5)
    assert got(r) == {"first_use": 2, "l1_evicted": 1, "l2_evicted": 1, "l3_evicted": 1, "partial_page": 1}
    assert r.total == 6 and t.stats.total == 6
    # computed now: every missed full page is back on L1 (H3's L3 copy was lost)
    assert dict(t._tier) == dict.fromkeys(H[:5], L1)
    t.check_integrity()


@pytest.mark.parametrize("outcome, reason", [
    (L3Outcome(1, 3, 1, True, 0, 0), "prefetch_expired"),  # L3 held 3 pages, the fetch was still running
    (L3Outcome(1, 3, 1, False, 2, 0), "l3_error"),  # held, but the read failed
    (L3Outcome(1, 3, 1, False, 0, 0), "l3_evicted"),  # held at the probe, gone at the read
    (L3Outcome(1, 3, 1, False, 0, 0, True), "no_l2_room"),  # held, but L2 could not place it
])
def test_l3_pages_the_prefetch_did_not_bring(outcome, reason):
    t = MissTracker(window=100)
    t.reached(H[:5], L3)
    # hit 2 pages (1 from L1/L2 + 1 delivered by L3), may hit 4: pages 2 and 3 missed
    r = t.account(H[:4], 5, 2, 4, outcome)
    assert got(r) == {reason: 2, "partial_page": 1}


def test_a_read_error_beyond_the_probe_and_a_foreign_fingerprint():
    t = MissTracker(window=100)
    t.reached(H[:2], L3)
    r = t.account(H[:3], 4, 0, 3, L3Outcome(0, 0, 0, False, 1, 0))  # the probe itself failed
    assert got(r) == {"l3_error": 2, "first_use": 1, "partial_page": 1}
    t2 = MissTracker(window=100)  # L3 holds pages 0-1 written by another layout
    r = t2.account(H[:3], 4, 0, 3, L3Outcome(0, 2, 0, False, 0, 1))
    assert got(r) == {"fingerprint_mismatch": 2, "first_use": 1, "partial_page": 1}


def test_other_namespace_only_for_pages_never_seen_here():
    t = MissTracker(window=100)
    t.reached(H[:1], L2)
    r = t.account(H[:4], 5, 0, 4, other_ns_pages=3)
    assert got(r) == {"l2_evicted": 1, "other_namespace": 2, "first_use": 1, "partial_page": 1}


def test_the_window_is_bounded_and_counts_what_it_forgot():
    t = MissTracker(window=3)
    t.account(H[:5], 6, 0, 5)  # 5 full pages tracked through a window of 3
    assert len(t._tier) == 3 and t.stats.forgotten == 2
    r = t.account(H[:5], 6, 0, 5)  # H0, H1 forgotten: first use again; H2..H4 remembered
    assert got(r) == {"first_use": 2, "l1_evicted": 3, "partial_page": 1}
    t.check_integrity()
    t._tier[H[2]] = 9
    with pytest.raises(IntegrityError, match="unknown tiers"):
        t.check_integrity()


def test_a_hit_beyond_what_the_request_may_hit_is_refused():
    from hicache.index.misses import admission_misses
    from hicache.index.prefix_cache import PrefixCache
    from hicache.core.layout import KVLayout
    from hicache.memory.allocator import PageAllocator
    lay = KVLayout(model_id="m", num_layers=1, num_kv_heads=1, head_dim=1, dtype="uint8", page_size=4)
    cache = PrefixCache(lay, PageAllocator(4, "L1"), None)
    with pytest.raises(IntegrityError, match="exceeds the 1 pages"):
        admission_misses(MissTracker(10), cache, bytes(4 * 8), "", 8, None, None)


def test_hicache_stats_carry_the_reasons_with_inline_transfers():
    from hicache.core.config import HiCacheConfig
    from hicache.cache.hicache import HiCache
    cfg = HiCacheConfig.load(None, {"pool.device": "cpu", "pool.device_pages": "8", "pool.host_pages": "16",
                                    "storage.url": "memory://"}, env={})
    hc = HiCache(cfg, inline_transfers=True)
    assert hc.transfers._threads == []  # every job runs at submit, in this thread
    toks = list(range(40))  # pages of 16: two full pages and 8 tokens
    for rid in ("a", "b"):
        req = hc.new_request(rid, toks)
        adm = hc.admit(req)
        req.alloc(len(toks) - adm.hit_tokens)
        req.commit()
        req.finish()
        hc.poll()
    st = hc.stats()
    assert adm.hit_tokens == 32 and st.tiers.storage_put_pages == 2  # b hit both full pages; both stored
    assert got(st.misses) == {"first_use": 2, "partial_page": 2}
    assert st.as_dict()["misses"]["first_use"] == 2
    hc.check_integrity()
    hc.close()
