"""L3 used bytes / objects / cap / evictions in /v1/stats and /metrics (issue 25, item 6)."""
from __future__ import annotations

from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from hicache.core.hashing import page_hashes
from hicache.storage.file_cap import scan


def _metrics(text: str) -> dict[tuple[str, tuple], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def test_file_l3_usage_in_stats_and_metrics(make_state, app_of, tmp_path):
    cap = 3000
    st = make_state({"storage.url": f"file://{tmp_path}", "storage.max_bytes": str(cap),
                     "storage.eviction": "fifo"})
    pb = st.layout.page_bytes
    sizes = [p.page_bytes for p in st.layout.planes]
    keys = page_hashes(list(range(4 * 20)), 4)
    for k in keys:  # 20 pages of 64 payload bytes (plus headers): several times the cap
        st.storage.put([(k, bytes(pb), sizes)])
    on_disk = scan(tmp_path)[0]
    with TestClient(app_of(st)) as c:
        l3 = c.get("/v1/stats").json()["tiers"]["L3"]
        m = _metrics(c.get("/metrics").text)
    assert sum(f.size for f in on_disk) <= l3["used_bytes"] <= cap
    assert (l3["used_pages"], l3["capacity_bytes"], l3["evictions"]) == (len(on_disk), cap, 20 - len(on_disk))
    assert (l3["usage_scope"], l3["usage_exact"], l3["eviction_policy"]) == ("store", False, "fifo")
    t = (("tier", "L3"),)
    assert m[("hicache_used_bytes", t)] == l3["used_bytes"]
    assert m[("hicache_used_pages", t)] == l3["used_pages"]
    assert m[("hicache_capacity_bytes", t)] == cap
    assert m[("hicache_evictions_total", t)] == l3["evictions"] > 0


def test_memory_l3_usage_is_exact(make_state, app_of):
    st = make_state({"storage.url": "memory://", "storage.max_bytes": "0"})
    sizes = [p.page_bytes for p in st.layout.planes]
    st.storage.put([(k, bytes(st.layout.page_bytes), sizes) for k in page_hashes(list(range(12)), 4)])
    with TestClient(app_of(st)) as c:
        l3 = c.get("/v1/stats").json()["tiers"]["L3"]
    assert (l3["used_pages"], l3["capacity_bytes"], l3["usage_exact"], l3["evictions"]) == (3, None, True, 0)
    assert l3["used_bytes"] == st.storage.usage().used_bytes > 3 * st.layout.page_bytes
