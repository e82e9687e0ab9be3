"""The shared L2 index tracks draft validity (invariant 5) and mirrors its pages in a journal.

A hit asked with ``need_draft`` stops at the first page whose draft rows are
missing, exactly as an embedded cache's ``match(need_draft=True)``; a
complete copy upgrades an incomplete page; ``restore`` rebuilds an index from
its journal (what a server adopting a crashed server's segment does).
"""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hicache.memory.allocator import PageAllocator
from hicache.node.snapshot import EventKind
from hicache.node.l2_index import CommitResult, L2Index
from hicache.index.prefix_cache import PrefixCache
from hicache.core.errors import OutOfPages, ServiceError
from hicache.core.hashing import page_hashes
from hicache.core.layout import KVLayout
from hicache.memory.pools import DevicePool, HostPool


def chain(start: int, n: int, page_size: int = 4) -> list[bytes]:
    return page_hashes(list(range(start, start + n * page_size)), page_size, namespace=str(start))


class Journal:
    """A ``PageJournal`` kept in a dict, recording the order of its calls."""

    def __init__(self):
        self.pages: dict[int, tuple[bytes, bool]] = {}
        self.calls: list[tuple] = []

    def committed(self, page, h, draft):
        assert page not in self.pages, page  # a page is dropped before it is reused
        self.pages[page] = (h, draft)
        self.calls.append(("committed", page, draft))

    def dropped(self, page):
        del self.pages[page]
        self.calls.append(("dropped", page))


def make(cap: int, owners=(1, 2)) -> tuple[L2Index, Journal]:
    j = Journal()
    idx = L2Index(PageAllocator(cap, "L2"), journal=j)
    for o in owners:
        idx.add_owner(o)
    return idx, j


def test_need_draft_stops_at_the_first_incomplete_page():
    idx, j = make(8)
    a = chain(0, 4)
    assert idx.commit(1, a, idx.reserve(1, 4), draft_pages=2) == CommitResult(4, 0)
    assert idx.lookup(a) == [0, 1, 2, 3]
    assert idx.lookup(a, need_draft=True) == [0, 1]
    assert idx.peek(a, need_draft=True) == 2 and idx.peek_pages(a[1:], need_draft=True) == [1]
    assert idx.acquire(2, a, need_draft=True) == [0, 1]
    idx.release(2, a[:2])
    assert idx.counters.draft_cut_pages == 2 + 2  # lookup and acquire; peeks count nothing
    assert j.pages == {0: (a[0], True), 1: (a[1], True), 2: (a[2], False), 3: (a[3], False)}
    idx.check_integrity()
    with pytest.raises(ServiceError, match=r"draft_pages=5 must be an integer in \[0, 4\]"):
        idx.commit(1, chain(50, 4), idx.reserve(1, 4), draft_pages=5)
    idx.check_integrity()


def test_a_complete_copy_upgrades_an_incomplete_page_unless_it_is_acquired():
    idx, j = make(8)
    a = chain(0, 3)
    idx.commit(1, a, idx.reserve(1, 3), draft_pages=0)  # pages 0, 1, 2 without draft rows
    idx.acquire(2, a[2:])  # someone is reading page 2: it cannot move
    new = idx.reserve(1, 3)
    assert new == [3, 4, 5]
    assert idx.commit(1, a, new, draft_pages=3) == CommitResult(0, 3)
    # a[0] and a[1] moved onto the complete copies; their old pages went back to free.
    assert idx.lookup(a, need_draft=True) == [3, 4]
    assert idx.lookup(a) == [3, 4, 2]
    assert idx.counters.draft_upgraded == 2 and idx.allocator.num_free == 8 - 3
    assert idx.generation(0) == idx.generation(1) == 1 and idx.generation(2) == 0
    assert ("dropped", 0) in j.calls and j.pages == {3: (a[0], True), 4: (a[1], True), 2: (a[2], False)}
    idx.release(2, a[2:])
    idx.commit(1, a[2:], idx.reserve(1, 1), draft_pages=1)  # unlocked now: upgraded
    assert idx.lookup(a, need_draft=True) == [3, 4, idx.page_of(a[2])] and idx.page_of(a[2]) != 2
    idx.check_integrity()


def test_upgrades_are_stored_events_so_l3_gets_the_complete_copy():
    idx = L2Index(PageAllocator(4))
    idx.add_owner(1)
    a = chain(0, 2)
    stored = []
    idx.commit(1, a, idx.reserve(1, 2), draft_pages=1)
    stored.append([(e.page_hash, e.parent) for e in idx.take_events().events])
    idx.commit(1, a, idx.reserve(1, 2), draft_pages=2)
    taken = idx.take_events()
    stored.append([(e.page_hash, e.parent) for e in taken.events])
    assert stored == [[(a[0], None), (a[1], a[0])], [(a[1], a[0])]]
    assert {(e.kind, e.tier, e.owner) for e in taken.events} == {(EventKind.STORED, "L2", 1)} and taken.dropped == 0
    assert idx.take_events() == ([], 0)  # taken once
    idx.check_integrity()


def test_embedded_and_shared_index_cut_the_same_hit():
    """The same commits, embedded (PrefixCache) and shared (L2Index): equal draft hits."""
    layout = KVLayout("d", num_layers=1, num_kv_heads=1, head_dim=2, dtype="float32", page_size=4, draft_layers=1)
    cache = PrefixCache(layout, DevicePool(layout, 16, "cpu"), HostPool(layout, 16))
    idx, _ = make(16)
    tokens = list(range(7, 7 + 6 * 4 + 1))
    h = page_hashes(tokens[:24], 4)
    for rid, n_pages, draft in (("a", 2, True), ("b", 4, False), ("c", 6, True)):
        req = cache.new_request(rid, tokens[:n_pages * 4 + 1], draft=draft)
        req.lock(req.match())
        req.alloc(req.num_tokens - req.computed_tokens)
        req.commit(draft_tokens=req.num_tokens - 1 if draft else None)
        req.finish()
        idx.commit(1, h[:n_pages], idx.reserve(1, n_pages), draft_pages=n_pages if draft else 0)
        embedded = cache.match(tokens, need_draft=True).device_tokens // 4
        assert len(idx.lookup(h, need_draft=True)) == embedded, rid
        assert len(idx.lookup(h)) == cache.match(tokens).device_tokens // 4
    assert embedded == 6  # "c" supplied the draft rows "b" lacked: both upgraded
    cache.check_integrity()
    idx.check_integrity()


_op = st.tuples(st.sampled_from(["reserve", "commit", "cancel", "acquire", "release", "lookup", "drop", "flush"]),
                st.integers(1, 3), st.integers(0, 5), st.integers(0, 3), st.booleans())


@settings(max_examples=60, deadline=None)
@given(st.lists(_op, max_size=40))
def test_random_operations_keep_the_journal_exact_and_restorable(ops):
    idx, j = make(6, owners=(1, 2, 3))
    chains = [chain(100 * i, 5) for i in range(4)]
    pending: dict[int, list[int]] = {1: [], 2: [], 3: []}
    for op, owner, n, ci, flag in ops:
        h = chains[ci][:n]
        if owner not in pending:
            idx.add_owner(owner)
            pending[owner] = []
        try:
            if op == "reserve":
                pending[owner] += idx.reserve(owner, n)
            elif op == "commit":
                pages = pending[owner][:len(h)]
                idx.commit(owner, h[:len(pages)], pages, draft_pages=len(pages) if flag else ci % (len(pages) + 1))
                del pending[owner][:len(pages)]
            elif op == "cancel":
                idx.cancel(owner, pending[owner][:n])
                del pending[owner][:n]
            elif op == "acquire":
                idx.acquire(owner, h, need_draft=flag)
            elif op == "release":
                idx.release(owner, h)
            elif op == "lookup":
                full, drafted = idx.lookup(h), idx.lookup(h, need_draft=True)
                assert drafted == full[:len(drafted)]
                assert all(idx.draft_complete(x) for x in h[:len(drafted)])
                assert len(drafted) == len(full) or not idx.draft_complete(h[len(drafted)])
            elif op == "flush":
                idx.flush()
            else:
                idx.drop_owner(owner)
                del pending[owner]
        except (OutOfPages, ServiceError):
            pass
        idx.check_integrity()
        assert j.pages == idx.committed_pages()
    # A fresh index restored from the journal holds the same committed pages.
    again = L2Index(PageAllocator(6))
    assert again.restore([(p, h, d) for p, (h, d) in j.pages.items()]) == len(j.pages)
    assert again.committed_pages() == idx.committed_pages()
    again.check_integrity()


def test_restore_skips_bad_and_repeated_entries_and_clears_them_in_the_journal():
    j = Journal()
    a = chain(0, 3)
    j.pages = {0: (a[0], True), 1: (a[0], True), 2: (b"short", True), 3: (a[2], False)}
    idx = L2Index(PageAllocator(5), journal=j)
    assert idx.restore([(p, h, d) for p, (h, d) in j.pages.items()] + [(9, a[1], True)]) == 2
    assert idx.committed_pages() == {0: (a[0], True), 3: (a[2], False)} == j.pages
    assert idx.allocator.num_free == 3 and idx.lookup(a[2:], need_draft=True) == []
    idx.check_integrity()
