"""The service's L3 write-back thread: it writes the pages of the L2 STORED events
it is handed (never those a fetch brought from L3), records what it stored as L3
events for its owner to take, and keeps its counters balanced."""
import time

from hicache.node.snapshot import EventKind
from hicache.node.l2_index import L2Index
from hicache.node.l3_tier import L3_OWNER, L3Tier
from hicache.core.layout import KVLayout
from hicache.memory.pools import HostPool
from hicache.storage import open_storage


def _written(tier: L3Tier, n: int) -> None:
    deadline = time.monotonic() + 10
    while tier.stats().written < n and time.monotonic() < deadline:
        time.sleep(0.01)


def test_writer_stores_taken_l2_events_and_records_l3_events():
    lay = KVLayout(model_id="t", num_layers=1, num_kv_heads=1, head_dim=4, dtype="float32", page_size=2,
                   host_layout="page_first")
    pool = HostPool(lay, 8, pin=False)
    index = L2Index(pool.allocator)
    storage = open_storage("memory://", fingerprint=lay.fingerprint())
    tier = L3Tier(storage, index, pool, max_wait_s=0.1, queue_pages=8)
    index.add_owner(1)
    hs = [bytes([i + 1]) * 16 for i in range(3)]
    for i in range(2):  # two batches, one after the other
        index.commit(1, hs[i:i + 1], index.reserve(1, 1))
        taken = index.take_events()
        assert [(e.kind, e.tier, e.page_hash, e.owner) for e in taken.events] == [
            (EventKind.STORED, "L2", hs[i], 1)]
        tier.queue_writes(taken.events)
        _written(tier, i + 1)
    # A page a fetch committed (owner L3_OWNER) came from L3: it is not written back.
    index.commit(L3_OWNER, hs[2:], index.reserve(L3_OWNER, 1))
    tier.queue_writes(index.take_events().events)
    s = tier.stats()
    assert (s.queued, s.written) == (2, 2)
    assert storage.prefix_hits(hs[:1]) == 1 and storage.exists(hs) == [True, True, False]
    l3 = tier.take_events()
    assert [(e.kind, e.tier, e.page_hash, e.parent) for e in l3.events] == [
        (EventKind.STORED, "L3", h, None) for h in hs[:2]] and l3.dropped == 0
    assert tier.take_events() == ([], 0)
    tier.check_integrity()
    index.check_integrity()
