"""``OutOfPages`` names what pins the pages (issue 17, item 14).

Before the fix the message said "all locked; finish or preempt requests" even
when the only holders were in-flight L2 backups, which no request can release.
"""
from __future__ import annotations

import pytest

from hicache.core.config import HiCacheConfig
from hicache.core.errors import OutOfPages
from hicache.cache.hicache import HiCache
from hicache.core.layout import KVLayout

PS = 4


def test_out_of_pages_blames_in_flight_backups_when_they_hold_the_pages():
    layout = KVLayout(model_id="t", num_layers=1, num_kv_heads=1, head_dim=4, dtype="float32", page_size=PS,
                      host_layout="page_first")
    cfg = HiCacheConfig.load(env={}, overrides={"storage.url": "", "pool.device": "cpu", "pool.device_pages": "4",
                                                "pool.host_pages": "16", "policy.write_policy": "write_through"})
    hc = HiCache(cfg, layout=layout)
    try:
        a = hc.new_request("a", list(range(4 * PS)))
        hc.admit(a).wait()
        a.alloc(4 * PS)
        a.commit()
        a.finish()  # inserts 4 pages; write-through backups now pin them until poll()
        b = hc.new_request("b", list(range(1000, 1000 + 2 * PS)))
        hc.admit(b).wait()
        with pytest.raises(OutOfPages) as e:
            b.alloc(2 * PS)
        msg = str(e.value)
        assert "0 request lock(s)" in msg and "in-flight transfer lock(s)" in msg and "drain()" in msg
        hc.drain()  # the backups finish: their pages become evictable
        b.alloc(2 * PS)
        b.abort()
        hc.check_integrity()
    finally:
        hc.close()
