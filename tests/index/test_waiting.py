"""Waiting requests (arrived, not admitted): their cached prefix is evicted only after
every other page, the protection follows splits and survives its node's eviction,
and admission, finish and abort end it."""
from __future__ import annotations

import pytest

from hicache.core.errors import IntegrityError
from tests.index.conftest import PS, make_cache, run

A = list(range(100, 100 + 2 * PS))  # 2 pages
B = list(range(200, 200 + 2 * PS))


def cached(c, tokens) -> int:
    m = c.match(tokens)
    return m.device_tokens + m.host_tokens


def test_a_waiting_requests_prefix_goes_after_every_other_page():
    c = make_cache(pages=4)
    run(c, "a", A)  # A is the least recently used
    run(c, "b", B)
    assert c.note_waiting("w", A + [7]) == 2 * PS
    assert c.evict(2) == 2
    assert cached(c, A) == 2 * PS and cached(c, B) == 0  # LRU alone would have taken A
    c.check_integrity()
    assert c.evict(2) == 2 and cached(c, A) == 0  # a preference, not a pin: nothing else was left
    c.check_integrity()  # the waiting entry outlives its node
    c.forget_waiting("w")
    c.check_integrity()


def test_without_a_waiting_request_lru_is_unchanged():
    c = make_cache(pages=4)
    run(c, "a", A)
    run(c, "b", B)
    c.note_waiting("w", A + [7])
    c.forget_waiting("w")
    assert c.evict(2) == 2 and cached(c, A) == 0 and cached(c, B) == 2 * PS


def test_the_protection_covers_the_cached_prefix_only_and_follows_splits():
    c = make_cache(pages=8)
    run(c, "a", A + B)  # one node of 4 pages
    assert c.note_waiting("w", A + [1, 2, 3, 4, 5]) == 2 * PS  # the node is split after A
    run(c, "x", list(range(300, 300 + 3 * PS)))
    assert c.evict(2) == 2  # B's pages (unprotected, older than x) go first
    assert cached(c, A) == 2 * PS and cached(c, A + B) == 2 * PS
    c.check_integrity()


def test_admission_and_abort_end_the_wait():
    c = make_cache(pages=4)
    run(c, "a", A)
    req = c.new_request("w", A + [7])
    c.note_waiting("w", req.key)
    req.lock(req.match())  # admitted: the lock protects its hit from here
    assert "w" not in c.waiting and all(n.wait_ref == 0 for n in c.nodes())
    req.abort()
    r2 = c.new_request("v", A + [8])
    c.note_waiting("v", r2.key, priority=1)
    c.note_waiting("u", B)
    assert c.waiting_order() == ["v", "u"]  # higher priority first, then arrival
    r2.abort()
    assert list(c.waiting) == ["u"]
    c.check_integrity()


def test_the_check_catches_a_wrong_count():
    c = make_cache(pages=4)
    run(c, "a", A)
    c.note_waiting("w", A + [7])
    next(iter(c.nodes())).wait_ref += 1
    with pytest.raises(IntegrityError, match="wait_ref"):
        c.check_integrity()
