"""``HiCache.new_request`` before ``admit``: the waiting request's L2 pages outlive
older ones, and ``poll`` prefetches its L3 pages into L2 while it waits, so its
admission loads from L2 and fetches nothing from L3; values stay exact."""
from __future__ import annotations

import pytest

from tests.helpers.tiers import TOK, check_l1_values, make, serve

OTHER = [list(range(500 + 100 * i, 500 + 100 * i + len(TOK))) for i in range(3)]


def _l2_pressure(protect: bool) -> int:
    hc = make(**{"pool.host_pages": "12", "policy.protect_waiting": str(protect).lower(),
                 "policy.device_eviction": "lru", "policy.host_eviction": "lru"})
    try:
        serve(hc, "a", TOK)
        serve(hc, "b", OTHER[0])
        hc.drain()
        hc.evict(100)  # both on L2 only; TOK the older
        w = hc.new_request("w", TOK)  # arrived, not admitted yet
        serve(hc, "c", OTHER[1])  # backing c up needs 3 L2 pages: TOK's or b's
        hc.drain()
        adm = hc.admit(w)
        adm.wait()
        w.finish()
        hc.check_integrity()
        if adm.host_tokens:
            assert check_l1_values(hc, TOK) == adm.host_tokens
        return adm.host_tokens
    finally:
        hc.close()


def test_a_waiting_requests_l2_pages_outlive_older_ones():
    assert _l2_pressure(protect=True) == 20
    assert _l2_pressure(protect=False) < 20  # LRU alone takes the older prefix: the one about to be used


@pytest.mark.parametrize("protect", [True, False])
def test_poll_prefetches_a_waiting_requests_l3_pages(tmp_path, protect):
    url = f"file://{tmp_path}/l3"
    a = make(url)
    serve(a, "a", TOK)
    a.drain()
    a.close()
    b = make(url, **{"policy.protect_waiting": str(protect).lower()})
    try:
        w = b.new_request("w", TOK)
        b.poll()
        b.drain()
        want = 5 if protect else 0  # only noted (waiting) requests are prefetched ahead
        assert b.tier_stats.prefetch_pages == want
        adm = b.admit(w)
        adm.wait()
        assert adm.host_tokens == 20 and adm.storage_tokens == (0 if protect else 20)
        assert b.tier_stats.prefetch_pages == 5  # fetched once either way
        w.finish()
        assert check_l1_values(b, TOK) == 20
        b.check_integrity()
    finally:
        b.close()
