"""``L1Room`` (``hicache/tiers/room.py``): making L1 room is one component that ``HiCache``
owns. Under ``write_back`` it queues the write-back of victims not yet on L2 in the
one in-flight registry instead of waiting, raises a miss (``OutOfPages``) when that
leaves too little room, evicts the victims once written, and its ``check_integrity``
catches each invariant it states. Values are compared bit-exact after the victims
come back from L2, on the toy shape and on real model shapes."""
from __future__ import annotations

import pytest

from hicache.core.config import HiCacheConfig
from hicache.core.errors import IntegrityError, OutOfPages
from hicache.cache.hicache import HiCache
from hicache.core.layout import KVLayout
from hicache.tiers.plans import BackupPlan
from hicache.tiers.room import L1Room
from hicache.core.shapes import model_shapes
from tests.helpers.tiers import LAYOUT, CopyGate
from tests.tiers.test_real_shapes import l1_rows_equal, rows_for, serve

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# (layout, page size): the toy shape and two real ones (GQA and MLA)
LAYOUTS = [pytest.param(LAYOUT, id="toy")] + [
    pytest.param(m.kv_layout(16, host_layout="page_first"), id=m.name)
    for m in model_shapes() if m.name in {"llama-3.1-8b", "deepseek-v3"}]
PAGES = 2  # pages per prompt
L1_PAGES = 8


def _make(layout: KVLayout, policy: str = "write_back") -> HiCache:
    """L1 of 8 pages, L2 of 16; write-back queue only (no cleaning ahead)."""
    o = {"storage.url": "", "pool.device": "cpu", "pool.device_pages": str(L1_PAGES), "pool.host_pages": "16",
         "policy.prefetch_policy": "wait_complete", "policy.write_policy": policy,
         "policy.write_back_clean_fraction": "0"}
    return HiCache(HiCacheConfig.load(env={}, overrides=o), layout=layout)


def _prompt(layout: KVLayout, first: int) -> list[int]:
    return list(range(first, first + PAGES * layout.page_size + 1))


def _breaks(room: L1Room, match: str) -> None:
    with pytest.raises(IntegrityError, match=match):
        room.check_integrity()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_make_room_queues_unwritten_victims_misses_and_evicts_them_once_written(layout, monkeypatch):
    hc = _make(layout)
    a, b = _prompt(layout, 1000), _prompt(layout, 5000)
    rows_a, rows_b = rows_for(hc, len(a), seed=1), rows_for(hc, len(b), seed=2)
    serve(hc, "a", a, rows_a)
    serve(hc, "b", b, rows_b)  # 4 unwritten pages on L1, 4 free
    assert hc.cache.device_allocator.num_free == L1_PAGES - 2 * PAGES
    gate = CopyGate(monkeypatch)  # the victims' copies stay in flight
    with pytest.raises(OutOfPages, match=f"{L1_PAGES} pages needed to load an L2 hit, {L1_PAGES - 2 * PAGES} "
                                         "free; the write-back of 2 victim\\(s\\) is queued"):
        hc._run_room(hc.room.make_room(L1_PAGES))
    assert len(hc._jobs.victim_jobs()) == 2 and hc._jobs.victim_pages() == 2 * PAGES
    assert hc.stats().tiers.write_back_queued_pages == 2 * PAGES
    assert hc.cache.stats().device_pages_cached == 2 * PAGES  # nothing evicted before its copy
    hc.check_integrity()

    room = hc.room
    room.clean_pages = L1_PAGES + 1
    _breaks(room, f"clean watermark {L1_PAGES + 1} pages outside 0..{L1_PAGES}")
    room.clean_pages = 0
    node = next(p.node for _, p in hc._jobs.items() if isinstance(p, BackupPlan))
    hc.tiers.backing_up.discard(node)
    _breaks(room, "has no L2 copy being made")
    hc.tiers.backing_up.add(node)
    room._write_back = False
    _breaks(room, "while the write policy is not write_back")
    room._write_back = True
    room.check_integrity()

    gate.open()
    hc.drain()  # the copies complete; their victims leave L1
    assert hc.cache.stats().device_pages_cached == 0 and not hc._jobs.write_backs()
    hc._run_room(hc.room.make_room(L1_PAGES))  # room now, nothing queued
    for rid, p, rows in (("a2", a, rows_a), ("b2", b, rows_b)):
        adm = serve(hc, rid, p, rows)
        assert (adm.device_tokens, adm.host_tokens) == (0, PAGES * layout.page_size)  # L2 hits
        assert l1_rows_equal(hc, p, rows) == PAGES * layout.page_size
    hc.check_integrity()
    hc.close()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_other_write_policies_leave_room_to_the_index(layout):
    """Only ``write_back`` makes room here: under ``write_through`` every L1 page is on
    L2, so ``make_room`` evicts nothing (the index's own allocation does) and
    ``evict`` drops at once, queueing nothing."""
    hc = _make(layout, "write_through")
    a = _prompt(layout, 1000)
    rows_a = rows_for(hc, len(a), seed=3)
    serve(hc, "a", a, rows_a)
    hc.drain()
    hc._run_room(hc.room.make_room(L1_PAGES))
    assert hc.cache.stats().device_pages_cached == PAGES
    hc._run_room(hc.room.clean_ahead())
    assert hc.evict(100) == PAGES and not hc._jobs.write_backs()
    hc.check_integrity()
    adm = serve(hc, "a2", a, rows_a)
    assert adm.host_tokens == PAGES * layout.page_size and l1_rows_equal(hc, a, rows_a) == PAGES * layout.page_size
    hc.close()


def test_the_room_returns_plans_and_never_calls_its_cache(monkeypatch):
    """``L1Room`` holds no reference to its cache: an operation that needs copies yields
    their backup plans (the driver submits them and replies with the job ids) and the
    jobs to complete, and the driver does what the room asked, in its order."""
    from hicache.tiers.room import CompleteJob, WaitJob

    hc = _make(LAYOUT)
    try:
        assert all(v is not hc for v in vars(hc.room).values())
        a, b = _prompt(LAYOUT, 1000), _prompt(LAYOUT, 5000)
        serve(hc, "a", a, rows_for(hc, len(a), seed=1))
        serve(hc, "b", b, rows_for(hc, len(b), seed=2))  # 4 unwritten pages on L1, 4 free
        gate = CopyGate(monkeypatch)  # the victims' copies stay in flight
        work, reply, steps = hc.room.make_room(L1_PAGES), None, []
        with pytest.raises(OutOfPages):
            while True:
                step = work.send(reply)
                steps.append(type(step).__name__)
                if isinstance(step, BackupPlan):
                    reply = hc._submit(step)
                elif isinstance(step, WaitJob):
                    reply = hc.wait_job(step.job)
                else:
                    assert isinstance(step, CompleteJob)
                    reply = hc.complete_finished(step.job)
        # each victim's backup, then the first queued one, still in flight: the load is a miss
        assert steps == ["BackupPlan", "BackupPlan", "CompleteJob"]
        assert hc._jobs.victim_pages() == 2 * PAGES
        hc.check_integrity()
        gate.open()
        assert hc._run_room(hc.room.evict(2 * PAGES)) == 2 * PAGES  # waits for the copies, then evicts
        hc.check_integrity()
    finally:
        hc.close()
