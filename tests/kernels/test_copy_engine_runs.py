"""Which load backs go through the copy engines: runs of adjacent pages on both sides
(``hicache.copy_engine.runs``). The copies themselves need a GPU (tests/e2e)."""
from __future__ import annotations

from hicache.copy_engine import runs


def test_ascending_and_descending_runs_are_found_and_returned_ascending():
    h = list(range(10, 20)) + list(range(49, 39, -1))
    d = list(range(100, 110)) + list(range(209, 199, -1))
    assert runs(h, d, min_run=10) == [(10, 100, 10), (40, 200, 10)]


def test_a_change_of_direction_or_a_gap_starts_a_new_run():
    assert runs([1, 2, 3, 2, 1], [5, 6, 7, 6, 5], min_run=1) == [(1, 5, 3), (1, 5, 2)]
    assert runs([1, 2, 4, 5], [1, 2, 3, 4], min_run=1) == [(1, 1, 2), (4, 3, 2)]
    assert runs([1, 2, 3], [3, 2, 1], min_run=1) == [(1, 3, 1), (2, 2, 1), (3, 1, 1)]  # opposite steps


def test_short_runs_or_few_pages_stay_on_the_kernel():
    assert runs(list(range(300)), list(range(300))) == [(0, 0, 300)]
    assert runs(list(range(200)), list(range(200))) is None  # below MIN_RUN_PAGES
    h = list(range(300)) + [1000] + list(range(2000, 2300))
    assert runs(h, list(range(601))) is None  # one page breaks the pattern: a run of 1
    assert runs([], []) is None
