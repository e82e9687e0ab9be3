"""``HiCache.admit`` as one pass (issue 26): it looks the request up once on the
common paths (miss, L1 hit, L2 hit, also when room must be made in L1), locks
exactly what a fresh lookup would have found, and completes no transfer but its
own prefetch (the rest complete in ``poll``)."""
from __future__ import annotations

import pytest

from hicache.cache.hicache import HiCache
from hicache.index.radix import RadixTree
from tests.helpers.expected import Expected, Movement, assert_expected
from tests.helpers.tiers import LAYOUT, PS, TOK, make


@pytest.fixture
def lookups(monkeypatch) -> list[int]:
    """Counts ``RadixTree.match`` calls (every index lookup goes through it)."""
    n = [0]
    orig = RadixTree.match

    def counted(self, *a, **k):
        n[0] += 1
        return orig(self, *a, **k)
    monkeypatch.setattr(RadixTree, "match", counted)
    return n


def admit_counted(hc: HiCache, rid: str, tokens, lookups: list[int]) -> Expected:
    """Admit ``tokens`` and report what the admission did (``Expected``), checking that
    it locked what a fresh lookup finds; then compute the rest, commit, finish, poll."""
    req = hc.new_request(rid, tokens)
    before = Movement.start(hc, lookups)
    adm = hc.admit(req)
    got = before.observe(hc, adm, lookups)
    fresh = req.match()  # what a second lookup would have locked: the same hit, all on L1 now
    assert (adm.match.device_tokens, adm.match.host_tokens, adm.match.exact_tokens, adm.match.device_pages) == \
        (fresh.device_tokens, fresh.host_tokens, fresh.exact_tokens, fresh.device_pages)
    assert req.computed_tokens == adm.hit_tokens and req.pages[:len(fresh.device_pages)] == fresh.device_pages
    adm.wait()
    req.alloc(len(tokens) - req.computed_tokens)
    req.commit()
    req.finish()
    hc.poll()
    return got


def test_a_miss_and_an_l1_hit_look_up_once(lookups):
    hc = make()
    assert_expected(admit_counted(hc, "a", TOK, lookups), Expected(lookups=1))
    hc.drain()
    assert_expected(admit_counted(hc, "b", TOK, lookups), Expected(device_tokens=20, lookups=1))
    hc.check_integrity()
    hc.close()


def test_an_l2_hit_is_loaded_back_and_locked_without_a_second_lookup(lookups):
    hc = make()
    admit_counted(hc, "a", TOK, lookups)
    hc.drain()
    hc.evict(100)  # L2 only now
    assert_expected(admit_counted(hc, "b", TOK, lookups), Expected(host_tokens=20, loaded_l2_pages=5, lookups=1))
    hc.check_integrity()
    hc.close()


def test_room_made_in_l1_for_a_load_back_does_not_cost_a_lookup(lookups):
    hc = make(**{"pool.device_pages": "8"})
    admit_counted(hc, "a", TOK, lookups)
    hc.drain()
    hc.evict(100)
    admit_counted(hc, "x", list(range(300, 329)), lookups)  # 7 pages fill L1 (unlocked once finished)
    hc.drain()
    epoch = hc.cache.epoch
    got = admit_counted(hc, "b", TOK, lookups)
    assert hc.cache.epoch > epoch  # the load back's allocation evicted x's pages
    # page-granular eviction: 4 of x's 7 pages make room for the 5 loaded (1 was free)
    assert_expected(got, Expected(host_tokens=20, loaded_l2_pages=5, evicted_l1_pages=4, lookups=1))
    hc.check_integrity()
    hc.close()


def test_a_preempted_request_keeps_its_tail_over_a_loaded_back_prefix(lookups):
    hc = make()
    admit_counted(hc, "a", TOK, lookups)
    hc.drain()
    long = TOK[:20] + [7, 8, 9, 10, 11, 12]  # the cached 5 pages + 1 full page + 2 tokens
    req = hc.new_request("p", long)
    hc.admit(req).wait()
    req.alloc(len(long) - req.computed_tokens)
    req.commit(len(long) - 20 - 2)  # page 6 full (shared), 0 tokens of the partial page yet...
    req.commit(1)  # ...then 1 token of it: the private tail
    req.preempt()
    hc.drain()
    hc.evict(100)  # the prefix goes to L2 only; the tail survives privately
    before = lookups[0]
    adm = hc.admit(req)
    assert lookups[0] - before == 1 and adm.host_tokens == 24 and req.computed_tokens == 25
    fresh = req.match()
    assert (adm.match.device_tokens, adm.match.exact_tokens) == (fresh.device_tokens, fresh.exact_tokens) == (24, 25)
    adm.wait()
    req.finish()
    hc.check_integrity()
    hc.close()


def test_an_l3_hit_looks_up_again_only_for_the_pages_the_prefetch_added(tmp_path, lookups):
    url = f"file://{tmp_path}/l3"
    a = make(url)
    admit_counted(a, "a", TOK, lookups)
    a.drain()
    a.close()
    b = make(url)
    assert_expected(admit_counted(b, "b", TOK, lookups),
                    Expected(host_tokens=20, storage_tokens=20, loaded_l2_pages=5, loaded_l3_pages=5, lookups=2))
    b.check_integrity()
    b.close()


def test_admission_completes_its_own_prefetch_and_leaves_other_jobs_to_poll(tmp_path):
    url = f"file://{tmp_path}/l3"
    a = make(url)
    admit_counted(a, "a", TOK, [0])
    a.drain()
    a.close()
    b = make(url)
    other = list(range(500, 521))
    req = b.new_request("o", other)
    b.admit(req)
    req.alloc(len(other))
    req.commit()  # write_through: backs the new pages up to L2 (a job)
    req.finish()
    assert b.tiers.backing_up
    b.transfers.wait_all()  # done, but not observed
    adm = b.admit(b.new_request("b", TOK))
    assert adm.storage_tokens == 20  # its own prefetch was completed inside admission...
    assert b.tiers.backing_up  # ...the unrelated backup was not
    assert b.poll() >= 1 and not b.tiers.backing_up
    adm.wait()
    b.drain()
    b.check_integrity()
    b.close()


def test_the_in_flight_registry_is_checked_while_a_load_runs(monkeypatch):
    from hicache.core.errors import IntegrityError
    hc = make()
    admit_counted(hc, "a", TOK, [0])
    hc.drain()
    hc.evict(100)
    req = hc.new_request("b", TOK)
    adm = hc.admit(req)  # load back in flight until observed
    ((job, plan),) = hc._jobs.items()
    assert all(hc._jobs.load_job(n) == job for n in plan.path) and hc.transfers.load_handle(job) in adm.loads
    hc.check_integrity()
    monkeypatch.setitem(hc._jobs._filling, plan.last, job + 1000)  # a node still filling, led to a job not in flight
    with pytest.raises(IntegrityError, match="is not a load in flight"):
        hc.check_integrity()
    monkeypatch.undo()
    monkeypatch.setattr(plan.last, "lock_ref", 0)  # the load no longer pins what it fills
    with pytest.raises(IntegrityError, match="not pinned on L1"):
        hc._jobs.check_integrity()  # (the cache's own check finds the lock count off too)
    monkeypatch.undo()
    adm.wait()
    hc.poll()
    assert not len(hc._jobs) and all(hc._jobs.load_job(n) is None for n in plan.path)
    req.abort()
    hc.check_integrity()
    hc.close()


def test_an_l2_page_is_held_by_one_plan_at_a_time():
    from hicache.core.errors import CacheStateError
    hc = make()
    admit_counted(hc, "a", TOK, [0])  # write_through: a backup plan held L2 pages until observed
    plan = hc.tiers.prepare_prefetch(b"\0" * 4 * PS * 2, "", 0, [b"x" * 16, b"y" * 16])
    assert set(plan.host) <= set(hc.tiers.host_in_flight)
    with pytest.raises(CacheStateError, match="second plan"):
        hc.tiers._hold_host(plan.host[:1])
    hc.tiers.complete_prefetch(plan, 0)  # nothing landed: the ids go back
    assert not set(plan.host) & set(hc.tiers.host_in_flight)
    hc.drain()
    hc.check_integrity()
    hc.close()


# ---------------------------------------------------------------- service mode
# The same single lookup when L2 is the node service's shared segment
# (``hicache.tiers.l2.shared``): the shared hit is acquired at the service, not
# looked up in this engine's index, and the load back's hit is known without
# a second lookup.
@pytest.fixture
def service_url():
    from tests.tiers.service_node import running_service, socket_url
    with running_service(LAYOUT) as srv:
        yield socket_url(srv)


def test_service_mode_a_miss_and_an_l1_hit_look_up_once(service_url, lookups):
    hc = make(service_url)
    assert hc.shared is not None and hc.private_host_bytes == 0
    assert_expected(admit_counted(hc, "a", TOK, lookups), Expected(lookups=1))
    hc.drain()
    assert_expected(admit_counted(hc, "b", TOK, lookups), Expected(device_tokens=20, lookups=1))
    hc.check_integrity()
    hc.close()


def test_service_mode_a_shared_hit_is_loaded_back_without_a_second_lookup(service_url, lookups):
    a, b = make(service_url), make(service_url)  # two engines of one node
    admit_counted(a, "a", TOK, lookups)
    a.drain()  # write_through: a's pages are committed to the segment
    assert_expected(admit_counted(b, "b", TOK, lookups), Expected(host_tokens=20, loaded_l2_pages=5, lookups=1))
    b.drain()
    hc = make(service_url, **{"pool.device_pages": "8"})
    admit_counted(hc, "x", list(range(300, 329)), lookups)  # 7 pages fill its L1 (unlocked once finished)
    hc.drain()
    epoch = hc.cache.epoch
    got = admit_counted(hc, "c", TOK, lookups)
    assert hc.cache.epoch > epoch  # the load back's allocation evicted x's pages
    # page-granular eviction: 4 of x's 7 pages make room for the 5 loaded (1 was free)
    assert_expected(got, Expected(host_tokens=20, loaded_l2_pages=5, evicted_l1_pages=4, lookups=1))
    for h in (a, b, hc):
        h.drain()
        h.check_integrity()
        h.close()


def test_service_mode_a_preempted_request_keeps_exact_accounting_over_a_shared_load(service_url, lookups):
    a, b = make(service_url), make(service_url)
    long = TOK[:20] + [7, 8, 9, 10, 11, 12]  # 5 shared pages + 1 full page + 2 tokens
    admit_counted(a, "a", long[:24] + [0], lookups)  # a shares 6 pages
    a.drain()
    req = b.new_request("p", long)
    b.admit(req).wait()
    req.alloc(len(long) - req.computed_tokens)
    req.commit()
    req.preempt()
    b.drain()
    b.evict(100)  # b's L1 is empty: its hit comes back from the segment
    before = lookups[0]
    adm = b.admit(req)  # the shared load reaches its private tail: it counts again (all but the last token)
    assert lookups[0] - before == 1 and adm.host_tokens == 24 and req.computed_tokens == 25
    fresh = req.match()
    assert (adm.match.device_tokens, adm.match.exact_tokens) == (fresh.device_tokens, fresh.exact_tokens) == (24, 25)
    adm.wait()
    req.finish()
    for h in (a, b):
        h.drain()
        h.check_integrity()
        h.close()
