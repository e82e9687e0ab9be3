"""L2Index: exact eviction order, ownership, all-or-nothing refusals, random op sequences."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hicache.memory.allocator import PageAllocator
from hicache.node.l2_index import CommitResult, L2Index, Reclaimed
from hicache.core.errors import ForeignPage, OutOfPages, ServiceError
from hicache.core.hashing import page_hashes


def chain(start: int, n: int, page_size: int = 4) -> list[bytes]:
    return page_hashes(list(range(start, start + n * page_size)), page_size, namespace=str(start))


def make(cap: int, owners=(1, 2)) -> L2Index:
    idx = L2Index(PageAllocator(cap, "L2"))
    for o in owners:
        idx.add_owner(o)
    return idx


def test_lookup_is_leading_prefix_and_counts_hits_and_misses():
    idx = make(8)
    a = chain(0, 4)
    pages = idx.reserve(1, 3)
    assert pages == [0, 1, 2]
    assert idx.commit(1, a[:3], pages) == CommitResult(3, 0)
    assert idx.lookup(a) == [0, 1, 2]
    assert idx.lookup([a[1], a[0]]) == [1, 0]
    assert idx.lookup(chain(100, 2)) == []
    c = idx.counters
    assert (c.lookups, c.hits, c.misses) == (3, 5, 3)
    idx.check_integrity()


def test_eviction_is_lru_and_deepest_first_within_a_chain():
    idx = make(4)
    a, b = chain(0, 2), chain(50, 2)
    idx.commit(1, a, idx.reserve(1, 2))  # pages 0, 1
    idx.commit(1, b, idx.reserve(1, 2))  # pages 2, 3
    idx.lookup(a)  # a is now more recent than b
    assert idx.reserve(2, 1) == [3]  # b's tail goes first
    assert idx.reserve(2, 1) == [2]  # then b's head; a untouched
    assert idx.lookup(a) == [0, 1] and idx.lookup(b) == []
    assert idx.counters.evictions == 2
    idx.check_integrity()


def test_lookup_refreshes_recency():
    idx = make(4)
    a, b = chain(0, 2), chain(50, 2)
    idx.commit(1, a, idx.reserve(1, 2))  # pages 0, 1
    idx.commit(1, b, idx.reserve(1, 2))  # pages 2, 3
    assert idx.reserve(2, 1) == [1]  # a is older: its tail goes
    assert idx.lookup(a + b) == [0]  # the gap ends the prefix; refreshes a's head only
    assert idx.reserve(2, 1) == [3]
    assert idx.reserve(2, 1) == [2]
    assert idx.lookup(a) == [0]
    idx.check_integrity()


def test_acquired_pages_are_never_evicted_and_out_of_pages_reserves_nothing():
    idx = make(4)
    a = chain(0, 4)
    idx.commit(1, a, idx.reserve(1, 4))
    assert idx.acquire(2, a[:2]) == [0, 1]
    assert idx.num_locked == 2
    assert idx.reserve(1, 2) == [2, 3]
    with pytest.raises(OutOfPages, match="0 free and 0 evictable"):
        idx.reserve(1, 1)
    assert idx.num_reserved == 2 and idx.lookup(a) == [0, 1]
    idx.release(2, a[:2])
    assert idx.reserve(1, 1) == [1]  # released pages are evictable again, tail first
    assert idx.lookup(a) == [0]
    idx.check_integrity()


def test_commit_duplicates_free_the_new_page():
    idx = make(6)
    a = chain(0, 3)
    idx.commit(1, a[:2], idx.reserve(1, 2))  # pages 0, 1
    pages = idx.reserve(2, 3)  # 2, 3, 4
    assert idx.commit(2, a, pages) == CommitResult(1, 2)
    assert idx.lookup(a) == [0, 1, 4]
    assert idx.allocator.num_used == 3
    # A hash repeated within one commit is a duplicate too.
    b = chain(200, 1)
    p = idx.reserve(1, 2)
    assert idx.commit(1, [b[0], b[0]], p) == CommitResult(1, 1)
    idx.check_integrity()


def test_refusals_change_nothing():
    idx = make(4)
    a = chain(0, 2)
    mine = idx.reserve(1, 2)
    with pytest.raises(ServiceError) as e:
        idx.commit(2, a, mine)  # owner 2 did not reserve them
    assert e.value.kind == "not_reserved"
    with pytest.raises(ForeignPage, match=r"page id 9 is not in \[0, 4\)"):
        idx.commit(1, a, [mine[0], 9])
    with pytest.raises(ServiceError) as e:
        idx.commit(1, a, [mine[0], mine[0]])
    assert e.value.kind == "not_reserved"
    with pytest.raises(ServiceError) as e:
        idx.commit(1, a[:1], mine)
    assert e.value.kind == "bad_args"
    with pytest.raises(ServiceError) as e:
        idx.commit(1, [b"short", a[1]], mine)
    assert e.value.kind == "bad_args"
    with pytest.raises(ServiceError) as e:
        idx.release(1, a[:1])
    assert e.value.kind == "not_acquired"
    for bad in (-1, True, "3", 2.0):
        with pytest.raises(ServiceError):
            idx.reserve(1, bad)
    assert idx.num_committed == 0 and idx.num_reserved == 2 and idx.lookup(a) == []
    idx.check_integrity()


def test_drop_owner_reclaims_reservations_and_acquisitions():
    idx = make(6)
    a = chain(0, 3)
    idx.commit(1, a, idx.reserve(1, 3))
    idx.reserve(2, 2)
    idx.acquire(2, a)
    idx.acquire(2, a[:1])
    idx.acquire(1, a[:1])
    assert idx.drop_owner(2) == Reclaimed(reserved=2, acquired=4)
    assert idx.num_reserved == 0 and idx.num_locked == 1 and idx.allocator.num_free == 3
    assert idx.counters.reclaimed == 6
    idx.check_integrity()
    assert idx.drop_owner(1) == Reclaimed(0, 1)
    assert idx.num_locked == 0
    idx.check_integrity()


def test_cancel_returns_reserved_pages():
    idx = make(3)
    p = idx.reserve(1, 3)
    idx.cancel(1, p[1:])
    assert idx.allocator.num_free == 2 and idx.num_reserved == 1
    with pytest.raises(ServiceError):
        idx.cancel(1, p[1:])
    idx.check_integrity()


_op = st.tuples(st.sampled_from(["reserve", "commit", "cancel", "acquire", "release", "lookup", "drop"]),
                st.integers(1, 3), st.integers(0, 5), st.integers(0, 3))


@settings(max_examples=60, deadline=None)
@given(st.lists(_op, max_size=40))
def test_random_operations_keep_integrity(ops):
    idx = make(6, owners=(1, 2, 3))
    chains = [chain(100 * i, 5) for i in range(4)]
    pending: dict[int, list[int]] = {1: [], 2: [], 3: []}
    for op, owner, n, ci in ops:
        h = chains[ci][:n]
        if owner not in pending:
            idx.add_owner(owner)
            pending[owner] = []
        try:
            if op == "reserve":
                pending[owner] += idx.reserve(owner, n)
            elif op == "commit":
                pages = pending[owner][:len(h)]
                idx.commit(owner, h[:len(pages)], pages)
                del pending[owner][:len(pages)]
            elif op == "cancel":
                idx.cancel(owner, pending[owner][:n])
                del pending[owner][:n]
            elif op == "acquire":
                idx.acquire(owner, h)
            elif op == "release":
                idx.release(owner, h)
            elif op == "lookup":
                got = idx.lookup(h)
                assert len(got) <= len(h) and len(set(got)) == len(got)
            else:
                idx.drop_owner(owner)
                del pending[owner]
        except (OutOfPages, ServiceError):
            pass
        idx.check_integrity()
