"""KV events are pulled: the L2 index and the L3 writer record them in bounded
logs, their owner takes them (returned once, then cleared), drops are counted."""
from __future__ import annotations

import pytest

from hicache.memory.allocator import PageAllocator
from hicache.core.errors import ConfigError, IntegrityError
from hicache.core.hashing import page_hashes
from hicache.node.snapshot import EventKind, EventLog, KVEvent, Taken, merge
from hicache.node.l2_index import L2Index

STORED, REMOVED = EventKind.STORED, EventKind.REMOVED


def test_log_returns_once_in_order_and_counts_what_a_full_log_drops():
    h = page_hashes(list(range(5 * 4)), 4)
    log = EventLog(3)
    log.record(STORED, "L2", [(h[0], None), (h[1], h[0])], owner=7)
    log.record(REMOVED, "L2", [(x, None) for x in h[2:5]])  # one fits, two are dropped
    t = log.take()
    assert [(e.kind, e.page_hash, e.parent, e.owner) for e in t.events] == [
        (STORED, h[0], None, 7), (STORED, h[1], h[0], 7), (REMOVED, h[2], None, None)]
    assert t.dropped == 2 and log.take() == Taken([], 0)
    assert (log.recorded, log.taken, log.dropped) == (5, 3, 2)
    log.check_integrity()
    log.extend(t.events[:1], dropped=4)  # forwarding keeps the upstream drops
    assert log.take() == Taken(t.events[:1], 4)
    log.check_integrity()
    log.recorded += 1  # a lost event: the balance check fails
    with pytest.raises(IntegrityError, match="recorded 11 != taken 4"):
        log.check_integrity()
    with pytest.raises(ConfigError, match="max_events=0"):
        EventLog(0)


def test_merge_orders_several_logs_by_when_they_were_recorded():
    h = page_hashes(list(range(3 * 4)), 4)
    a, b = EventLog(8), EventLog(8)
    a.record(STORED, "L2", [(h[0], None)])
    b.record(STORED, "L3", [(h[0], None)])
    a.record(REMOVED, "L2", [(h[0], None)])
    m = merge(a.take(), b.take(), Taken([], 2))
    assert [(e.kind, e.tier) for e in m.events] == [(STORED, "L2"), (STORED, "L3"), (REMOVED, "L2")]
    assert m.dropped == 2 and all(isinstance(e, KVEvent) for e in m.events)


def test_index_records_commits_evictions_and_flushes_for_its_owner_to_take():
    idx = L2Index(PageAllocator(3))
    idx.add_owner(1)
    h = page_hashes(list(range(5 * 4)), 4)
    idx.commit(1, h[:3], idx.reserve(1, 3))
    t = idx.take_events()
    assert [(e.kind, e.tier, e.page_hash, e.parent, e.owner) for e in t.events] == [
        (STORED, "L2", h[0], None, 1), (STORED, "L2", h[1], h[0], 1), (STORED, "L2", h[2], h[1], 1)]
    pages = idx.reserve(1, 2)  # evicts two, deepest first (LRU)
    assert [(e.kind, e.page_hash) for e in idx.take_events().events] == [(REMOVED, h[2]), (REMOVED, h[1])]
    idx.commit(1, h[3:5], pages)
    idx.take_events()
    assert idx.flush() == 3
    t = idx.take_events()
    assert sorted((e.kind, e.page_hash) for e in t.events) == sorted((REMOVED, x) for x in (h[0], h[3], h[4]))
    assert idx.take_events() == Taken([], 0)
    idx.check_integrity()


def test_index_events_nobody_takes_stay_bounded():
    idx = L2Index(PageAllocator(2), max_events=2)
    idx.add_owner(1)
    h = page_hashes(list(range(6 * 4)), 4)
    for i in range(0, 6, 2):
        idx.commit(1, h[i:i + 2], idx.reserve(1, 2))  # 6 stored + 4 removed, nobody takes
    idx.check_integrity()
    t = idx.take_events()
    assert len(t.events) == 2 and t.dropped == 8
    assert [e.page_hash for e in t.events] == h[:2]  # the oldest are kept
