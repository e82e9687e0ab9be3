"""The service's L3 write-back thread survives a failing listener and keeps
its counters balanced."""
import time

from hicache.service.l2_index import L2Index
from hicache.service.l3_tier import L3Tier
from hicache.layout import KVLayout
from hicache.pools import HostPool
from hicache.storage import open_storage


def test_writer_survives_a_failing_listener():
    lay = KVLayout(model_id="t", num_layers=1, num_kv_heads=1, head_dim=4, dtype="float32", page_size=2,
                   host_layout="page_first")
    pool = HostPool(lay, 8, pin=False)
    index = L2Index(pool.allocator)
    storage = open_storage("memory://", fingerprint=lay.fingerprint())
    calls = []

    def listener(pages):
        calls.append(len(pages))
        if len(calls) == 1:
            raise RuntimeError("listener bug")

    tier = L3Tier(storage, index, pool, max_wait_s=0.1, queue_pages=8, on_l3_stored=listener)
    index.add_owner("engine")
    for i in range(2):  # two batches, one after the other
        h = bytes([i + 1]) * 16
        page = index.reserve("engine", 1)
        index.commit("engine", [h], page)
        tier.pages_stored([(h, None)])
        deadline = time.monotonic() + 10
        while tier.stats().written < i + 1 and time.monotonic() < deadline:
            time.sleep(0.01)
    assert tier.stats().written == 2 and len(calls) == 2  # the second batch still went out
    assert storage.prefix_hits([b"\x01" * 16]) == 1 and storage.prefix_hits([b"\x02" * 16]) == 1
    tier.check_integrity()
