"""Under ``write_back`` admission never waits for L1 -> L2 copies: an
eviction victim whose pages are not yet on L2 is skipped and its write-back
queued; ``poll()`` completes it and evicts the victim then. A load back that
finds no room is a miss, counted (``no_l1_room``). Values stay exactly what
recomputing the pages writes, on the toy shape and on real model shapes.

L1 eviction is page-granular: with 1 page free, room for 5 takes the 4-page tail
of the victim prompt, whose first page stays on L1."""
from __future__ import annotations

import pytest

from hicache.core.config import HiCacheConfig
from hicache.core.errors import IntegrityError
from hicache.cache.hicache import HiCache
from hicache.core.shapes import model_shapes
from hicache.transfer.engine import TransferController
from tests.helpers.expected import Expected, Movement, assert_expected, expected_diff
from tests.helpers.tiers import LAYOUT, PS, TOK, CopyGate, check_l1_values, make, serve
from tests.tiers.test_real_shapes import l1_rows_equal, rows_for
from tests.tiers.test_real_shapes import serve as serve_real

WB = {"policy.write_policy": "write_back"}
# The queue alone, without cleaning ahead (``L1Room.clean_ahead``): admission then meets dirty victims.
WB_QUEUE_ONLY = {**WB, "policy.write_back_clean_fraction": "0"}


@pytest.fixture
def waits(monkeypatch) -> list[int]:
    """Counts synchronous transfer waits (``TransferController.wait``)."""
    n = [0]
    orig = TransferController.wait

    def counted(self, *a, **k):
        n[0] += 1
        return orig(self, *a, **k)
    monkeypatch.setattr(TransferController, "wait", counted)
    return n


def _fill(hc, first: int, n: int) -> list[list[int]]:
    """Serve ``n`` distinct 5-page prompts (their pages stay on L1, unwritten)."""
    prompts = [list(range(first + 100 * i, first + 100 * i + len(TOK))) for i in range(n)]
    for i, p in enumerate(prompts):
        serve(hc, f"fill{first}-{i}", p)
    return prompts


def test_admission_skips_unwritten_victims_queues_them_and_loads_once_poll_evicted_them(waits, monkeypatch):
    hc = make(**WB_QUEUE_ONLY)
    serve(hc, "a", TOK)
    hc.evict(100)  # an explicit eviction waits for the write-back: TOK is on L2 only now
    assert hc.cache.stats().host_pages_cached == 5 and hc.cache.stats().device_pages_cached == 0
    x = _fill(hc, 300, 3)  # 15 unwritten pages on L1, 1 free
    hc.drain()
    hc.check_integrity()

    gate = CopyGate(monkeypatch)  # the victims' copies stay in flight however fast the machine is
    before = Movement.start(hc, waits=waits)
    req = hc.new_request("b", TOK)
    adm = hc.admit(req)  # needs 5 L1 pages: the victim x[0] is queued, not waited for
    assert_expected(before.observe(hc, adm, waits=waits),
                    Expected(no_room_pages=5, write_back_queued_pages=4, waits=0))
    assert hc.stats().misses.no_l1_room == 5  # the miss has its reason
    hc.check_integrity()
    (job,) = hc._jobs.victim_jobs()
    hc._jobs._write_backs[job + 1000] = True  # a victim waiting for a job not in flight: caught
    with pytest.raises(IntegrityError, match="is not a backup in flight"):
        hc.check_integrity()
    del hc._jobs._write_backs[job + 1000]
    req.abort()

    gate.open()
    hc.transfers.wait_all()  # (the test waits; the admission did not)
    before = Movement.start(hc, waits=waits)
    hc.poll()  # the queued write-back completes: x[0] goes to L2 and leaves L1
    # x[0]'s path is written top-down (its head too, 5 pages); its 4-page tail leaves L1
    assert_expected(before.observe(hc, waits=waits), Expected(backed_up_pages=5, evicted_l1_pages=4, waits=0))
    hc.check_integrity()

    before = Movement.start(hc, waits=waits)
    adm, _ = serve(hc, "b2", TOK)  # room now: loaded back, bit-exact
    assert_expected(before.observe(hc, adm, waits=waits),
                    Expected(host_tokens=20, loaded_l2_pages=5, evicted_l1_pages=None, waits=None))
    assert check_l1_values(hc, TOK) == 20
    hc.evict(100)
    adm, _ = serve(hc, "x0", x[0])  # the victim written back in poll() comes back by value
    assert adm.host_tokens == 20 and check_l1_values(hc, x[0]) == 20
    hc.check_integrity()
    hc.close()


def test_clean_victims_go_at_once_and_only_as_many_unwritten_ones_as_needed_are_queued(waits):
    hc = make(**WB, **{"policy.device_eviction": "lru"})  # (qd_lru would keep the re-hit prompt)
    serve(hc, "a", TOK)
    hc.evict(100)
    clean = _fill(hc, 300, 1)[0]
    hc.evict(100)  # clean's pages are on L2 now...
    adm, _ = serve(hc, "c", clean)  # ...and back on L1, with their L2 copy: a clean victim
    assert adm.host_tokens == 20
    _fill(hc, 600, 2)  # 10 unwritten pages; L1: 15 used
    before = Movement.start(hc, waits=waits)
    req = hc.new_request("b", TOK)
    adm = hc.admit(req)  # LRU: the clean prompt is the first victim, its tail evicted at once: room
    assert_expected(before.observe(hc, adm, waits=waits),
                    Expected(host_tokens=20, loaded_l2_pages=5, evicted_l1_pages=4, waits=0))
    adm.wait()
    req.abort()
    hc.drain()
    assert check_l1_values(hc, TOK) == 20
    hc.check_integrity()
    hc.close()


def test_a_request_computing_its_tokens_still_gets_its_pages(waits):
    """``alloc`` (not admission) must get its pages: it waits for the write-back."""
    hc = make(**WB, **{"pool.device_pages": "8"})
    serve(hc, "a", TOK)
    before = Movement.start(hc, waits=waits)
    adm, _ = serve(hc, "b", list(range(700, 700 + 6 * PS + 1)))  # 7 pages: evicts 4 of a's, written first
    got = before.observe(hc, adm, waits=waits)
    assert (got.backed_up_pages, got.evicted_l1_pages, got.write_back_queued_pages) == (5, 4, 4) and got.waits >= 1
    hc.evict(100)  # (b's pages would be queued by a2's admission: a miss; see the tests above)
    adm, _ = serve(hc, "a2", TOK)  # a was written back before its L1 pages went: by value
    assert adm.host_tokens == 20 and check_l1_values(hc, TOK) == 20
    hc.check_integrity()
    hc.close()


def test_write_backs_already_done_complete_inside_admission_without_waiting(waits):
    """Inline CPU copies (``--simulate``, replay) are done at submit: the admission
    completes its own victims' write-backs, evicts them and loads (no miss)."""
    o = {"storage.url": "", "pool.device": "cpu", "pool.device_pages": "16", "pool.host_pages": "32", **WB_QUEUE_ONLY}
    hc = HiCache(HiCacheConfig.load(env={}, overrides=o), layout=LAYOUT, inline_transfers=True)
    serve(hc, "a", TOK)
    hc.evict(100)
    x = _fill(hc, 300, 3)
    before = Movement.start(hc, waits=waits)
    adm, _ = serve(hc, "b", TOK)
    assert_expected(before.observe(hc, adm, waits=waits),
                    # x[0]'s 4-page tail for the load, then its head for the page b computes
                    Expected(host_tokens=20, loaded_l2_pages=5, backed_up_pages=5, evicted_l1_pages=5,
                             write_back_queued_pages=4, waits=0))
    assert check_l1_values(hc, TOK) == 20 and not hc._jobs.write_backs()
    hc.evict(100)
    adm, _ = serve(hc, "x0", x[0])
    assert adm.host_tokens == 20 and check_l1_values(hc, x[0]) == 20
    hc.check_integrity()
    hc.close()


def test_cleaning_ahead_in_poll_keeps_the_l2_hit_and_admission_never_waits(waits, monkeypatch):
    """L1 full of unwritten pages: ``poll()`` writes the ones next in eviction order back
    ahead of time (watermark 6 of 16 pages), so the admission that needs 5 pages of
    room evicts clean victims at once and loads its L2 hit, with every copy held
    in flight (nothing waited for, no miss); all of it bit-exact."""
    hc = make(**WB, **{"policy.write_back_clean_fraction": "0.375", "policy.device_eviction": "lru"})
    serve(hc, "a", TOK)
    hc.evict(100)  # TOK on L2 only
    before = Movement.start(hc, waits=waits)
    x = _fill(hc, 300, 3)  # 15 pages on L1, 1 free: below the watermark, poll() cleans the LRU end
    got = before.observe(hc, waits=waits)
    assert (got.write_back_queued_pages, got.evicted_l1_pages, got.waits) == (0, 0, 0)
    assert hc.tiers.backing_up or got.backed_up_pages >= 5  # started in poll, not waited for
    hc.transfers.wait_all()  # (the test lets the copies land, as the next engine steps would)
    hc.poll()
    assert not hc.l2.unbacked(hc.cache.match(x[0]).device_node) and hc.cache.device_allocator.num_free == 1
    hc.check_integrity()

    gate = CopyGate(monkeypatch)  # from here every copy stays in flight: admission cannot lean on one
    before = Movement.start(hc, waits=waits)
    req = hc.new_request("b", TOK)
    adm = hc.admit(req)  # needs 4 more L1 pages: x[0] is clean, its tail evicted now; the hit is kept
    assert_expected(before.observe(hc, adm, waits=waits),
                    Expected(host_tokens=20, loaded_l2_pages=5, evicted_l1_pages=4, waits=0))
    assert hc.stats().misses.no_l1_room == 0
    hc.check_integrity()
    gate.open()
    adm.wait()
    req.finish()
    hc.drain()
    assert check_l1_values(hc, TOK) == 20  # loaded back bit-exact
    hc.evict(100)
    adm, _ = serve(hc, "x0", x[0])  # x[0] was cleaned before it left L1: it comes back by value
    assert adm.host_tokens == 20 and check_l1_values(hc, x[0]) == 20
    hc.check_integrity()
    hc.close()


def test_cleaning_ahead_writes_nothing_while_l1_has_room(waits):
    hc = make(**WB, **{"policy.write_back_clean_fraction": "0.375"})
    before = Movement.start(hc, waits=waits)
    _fill(hc, 300, 2)  # 10 of 16 pages used: 6 free reach the watermark
    hc.drain()
    assert_expected(before.observe(hc, waits=waits), Expected(waits=None))
    _fill(hc, 600, 1)  # 15 used, 1 free: now the LRU end is written ahead
    hc.drain()
    assert before.observe(hc).backed_up_pages >= 5 and before.observe(hc).evicted_l1_pages == 0
    hc.check_integrity()
    hc.close()


def test_the_expected_record_reads_as_a_diff():
    diff = expected_diff(Expected(host_tokens=20, waits=1), Expected(host_tokens=16, waits=None))
    assert diff == ["host_tokens: expected 16, got 20"]
    with pytest.raises(AssertionError, match="host_tokens: expected 16, got 20"):
        assert_expected(Expected(host_tokens=20), Expected(host_tokens=16))


SHAPES = [s for s in model_shapes() if s.name in {"llama-3.1-8b", "deepseek-v3"}]


@pytest.mark.usefixtures("one_torch_thread")
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: s.name)
def test_real_shapes_stay_bit_exact_when_admission_skips_unwritten_victims(shape, waits, monkeypatch):
    ps, pages = 16, 2
    o = {"storage.url": "", "pool.device": "cpu", "pool.device_pages": "4", "pool.host_pages": "8",
         "policy.prefetch_policy": "wait_complete", **WB}
    hc = HiCache(HiCacheConfig.load(env={}, overrides=o), layout=shape.kv_layout(ps, host_layout="page_first"))
    a = list(range(1000, 1000 + pages * ps + 1))
    b = list(range(5000, 5000 + pages * ps + 1))
    rows_a, rows_b = rows_for(hc, len(a), seed=1), rows_for(hc, len(b), seed=2)
    serve_real(hc, "a", a, rows_a)
    hc.evict(100)  # a on L2 only
    serve_real(hc, "b", b, rows_b)  # 2 unwritten pages on L1
    serve_real(hc, "b'", b[:ps] + [9] * (ps + 1), rows_b)  # one more unwritten page: 3 of 4 used
    gate = CopyGate(monkeypatch)
    before = Movement.start(hc, waits=waits)
    req = hc.new_request("a2", a)
    adm = hc.admit(req)  # 1 free, no clean victim: one unwritten leaf is queued, nothing waited for
    assert_expected(before.observe(hc, adm, waits=waits),
                    Expected(no_room_pages=pages, write_back_queued_pages=1, waits=0))
    hc.check_integrity()
    req.abort()
    gate.open()
    hc.drain()  # the queued write-back completes; its victim leaves L1
    adm = serve_real(hc, "a3", a, rows_a)
    assert (adm.device_tokens, adm.host_tokens) == (0, pages * ps)
    assert l1_rows_equal(hc, a, rows_a) == pages * ps
    hc.evict(100)
    adm = serve_real(hc, "b2", b, rows_b)  # every page of b was written back before it left L1
    assert adm.host_tokens == pages * ps and l1_rows_equal(hc, b, rows_b) == pages * ps
    hc.check_integrity()
    hc.close()


@pytest.mark.usefixtures("one_torch_thread")
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: s.name)
def test_real_shapes_keep_the_l2_hit_when_poll_cleaned_ahead(shape, waits, monkeypatch):
    """As the toy test above at real shapes: L1 of 4 pages, watermark 2 pages; the page
    ``poll()`` cleaned is the admission's clean victim; bit-exact on both sides."""
    ps, pages = 16, 2
    o = {"storage.url": "", "pool.device": "cpu", "pool.device_pages": "4", "pool.host_pages": "8",
         "policy.prefetch_policy": "wait_complete", "policy.device_eviction": "lru",
         "policy.write_back_clean_fraction": "0.5", **WB}
    hc = HiCache(HiCacheConfig.load(env={}, overrides=o), layout=shape.kv_layout(ps, host_layout="page_first"))
    a = list(range(1000, 1000 + pages * ps + 1))
    b = list(range(5000, 5000 + pages * ps + 1))
    b2 = b[:ps] + [9] * (ps + 1)
    rows_a, rows_b = rows_for(hc, len(a), seed=1), rows_for(hc, len(b), seed=2)
    serve_real(hc, "a", a, rows_a)
    hc.evict(100)  # a on L2 only
    serve_real(hc, "b", b, rows_b)
    serve_real(hc, "b'", b2, rows_b)  # 3 of 4 L1 pages used, none on L2: poll() cleaned b's LRU leaf
    hc.drain()  # (its copy lands, as the next engine steps would let it)
    assert hc.cache.device_allocator.num_free == 1 and not hc.l2.unbacked(hc.cache.match(b).device_node)
    assert hc.tier_stats.backup_pages == 2 * pages  # a's pages (evict), then b's path, ahead of eviction
    gate = CopyGate(monkeypatch)
    before = Movement.start(hc, waits=waits)
    req = hc.new_request("a2", a)
    adm = hc.admit(req)  # needs 2 pages: 1 free + the clean leaf, evicted now; nothing waited for
    assert_expected(before.observe(hc, adm, waits=waits),
                    Expected(host_tokens=pages * ps, loaded_l2_pages=pages, evicted_l1_pages=1, waits=0))
    hc.check_integrity()
    gate.open()
    adm.wait()
    req.finish()
    hc.drain()
    assert l1_rows_equal(hc, a, rows_a) == pages * ps
    hc.evict(100)
    adm = serve_real(hc, "b3", b, rows_b)  # b's pages were written back before they left L1
    assert adm.host_tokens == pages * ps and l1_rows_equal(hc, b, rows_b) == pages * ps
    hc.check_integrity()
    hc.close()


def test_service_mode_cleans_ahead_into_the_shared_segment_and_admission_keeps_the_hit(waits, monkeypatch):
    """The same with L2 = the node service's segment (``SharedL2``): the pages cleaned
    ahead are committed to the segment, the admission evicts them at once and loads
    its shared hit without waiting, and another engine of the node reads them back
    bit-exact."""
    from tests.tiers.service_node import running_service, socket_url
    with running_service(LAYOUT) as srv:
        url = socket_url(srv)
        over = {**WB, "policy.write_back_clean_fraction": "0.375", "policy.device_eviction": "lru"}
        hc, other = make(url, **over), make(url)
        serve(hc, "a", TOK)
        hc.evict(100)  # TOK committed to the segment, off L1
        x = _fill(hc, 300, 3)  # 1 L1 page free: poll() commits x[0] ahead of eviction
        hc.drain()
        assert hc.cache.match(x[0]).device_node.in_storage and hc.cache.device_allocator.num_free == 1
        gate = CopyGate(monkeypatch)
        before = Movement.start(hc, waits=waits)
        req = hc.new_request("b", TOK)
        adm = hc.admit(req)  # 1 page free: x[0]'s 4-page tail makes the room
        assert_expected(before.observe(hc, adm, waits=waits),
                        Expected(host_tokens=20, loaded_l2_pages=5, evicted_l1_pages=4, waits=0))
        hc.check_integrity()
        gate.open()
        adm.wait()
        req.finish()
        hc.drain()
        assert check_l1_values(hc, TOK) == 20
        adm, _ = serve(other, "x0", x[0])  # x[0] left hc's L1 only after its commit: by value
        assert adm.host_tokens == 20 and check_l1_values(other, x[0]) == 20
        for h in (hc, other):
            h.drain()
            h.check_integrity()
            h.close()
