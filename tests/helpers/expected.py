"""An expected-output record for one admission or tier movement, as vLLM's
``ExpectedPrepareStoreOutput`` is for its offloading tests: say what should
have happened in one record, compare it with what did, and read one diff.

    before = Movement.start(hc)
    adm = hc.admit(req)
    assert_expected(before.observe(hc, adm), Expected(host_tokens=20, loaded_l2_pages=5))

Fields left ``None`` in the expected record are not compared.
"""
from __future__ import annotations

import dataclasses
from typing import NamedTuple

from hicache.cache.hicache import Admission, HiCache


class Expected(NamedTuple):
    """What one admission (or a step of tier movements) did. Tokens are page-floored."""

    device_tokens: int | None = 0  # hit already on L1 when admitted
    host_tokens: int | None = 0  # hit loaded back into L1 (from L2, or L3 through L2)
    storage_tokens: int | None = 0  # part of host_tokens that came from L3 in this admission
    loaded_l2_pages: int | None = 0  # L1 pages filled from L2 (load backs started)
    loaded_l3_pages: int | None = 0  # L2 pages filled from L3 (prefetches landed)
    backed_up_pages: int | None = 0  # L1 -> L2 copies completed
    stored_pages: int | None = 0  # L2 -> L3 puts completed
    evicted_l1_pages: int | None = 0  # logical pages taken off L1
    evicted_l2_pages: int | None = 0  # logical pages taken off L2
    no_room_pages: int | None = 0  # L2 hits not loaded: no L1 room
    write_back_queued_pages: int | None = 0  # write_back: victims' L1 pages queued for L2, not waited for
    lookups: int | None = None  # index lookups (``RadixTree.match`` calls), when counted
    waits: int | None = None  # synchronous transfer waits, when counted


@dataclasses.dataclass(frozen=True)
class Movement:
    """The counters before a step; ``observe`` turns their change into an ``Expected``."""

    tiers: dict
    cache: dict
    lookups: int
    waits: int

    @classmethod
    def start(cls, hc: HiCache, lookups: list[int] | None = None, waits: list[int] | None = None) -> Movement:
        """``lookups`` / ``waits``: one-element counters a fixture increments (optional)."""
        st = hc.stats()
        return cls(st.tiers.as_dict(), st.index.as_dict(), lookups[0] if lookups else 0,
                   waits[0] if waits else 0)

    def observe(self, hc: HiCache, adm: Admission | None = None, lookups: list[int] | None = None,
                waits: list[int] | None = None) -> Expected:
        st = hc.stats()
        t, c = st.tiers.as_dict(), st.index.as_dict()

        def dt(k: str) -> int:
            return int(t[k] - self.tiers[k])

        def dc(k: str) -> int:
            return int(c[k] - self.cache[k])
        return Expected(
            adm.device_tokens if adm else 0, adm.host_tokens if adm else 0, adm.storage_tokens if adm else 0,
            dt("load_back_pages"), dt("prefetch_pages"), dt("backup_pages"), dt("storage_put_pages"),
            dc("device_evicted_pages"), dc("host_evicted_pages"), dt("load_back_no_room_pages"),
            dt("write_back_queued_pages"),
            None if lookups is None else lookups[0] - self.lookups, None if waits is None else waits[0] - self.waits)


def expected_diff(got: Expected, want: Expected) -> list[str]:
    """One line per field that differs (fields ``None`` in ``want`` are not compared)."""
    return [f"{name}: expected {w}, got {g}" for name, w, g in zip(Expected._fields, want, got)
            if w is not None and w != g]


def assert_expected(got: Expected, want: Expected) -> None:
    """Fail with the fields that differ, one a line, expected beside actual."""
    diff = expected_diff(got, want)
    assert not diff, "movement differs from the expected one:\n  " + "\n  ".join(diff)
