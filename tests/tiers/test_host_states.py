"""The debug-mode L2 page state machine (``hicache.tiers.host_states``): legal sequences,
an illegal move raises naming page, from and to, each two-phase movement of the
tier manager moves the states it should, ``check_integrity`` catches a table out
of step, and a randomized run over ``HiCache`` (this folder runs with the flag
on, see conftest.py) stays clean."""
from __future__ import annotations

import random

import pytest

from hicache.memory.allocator import PageAllocator
from hicache.index.prefix_cache import PrefixCache
from hicache.core.errors import IntegrityError, OutOfPages
from hicache.tiers.host_states import ENV, HostPageState, HostPageStates
from hicache.core.layout import KVLayout
from hicache.tiers.manager import TierManager
from tests.helpers.tiers import TOK, check_l1_values, make, serve

S = HostPageState
X = list(range(100, 116))  # 4 pages of 4 tokens


def test_the_write_lifecycle_and_reads_are_legal():
    st = HostPageStates(4)
    st.move([0, 1], S.RESERVED)
    st.move([0, 1], S.PROTECTED)
    st.move([0], S.SYNCED)
    st.move([1], S.FREE)  # the copy was not used
    st.read([0])
    st.read([0])  # a load back and a store at once
    st.move([0], S.BACKED_UP)
    st.done_reading([0])
    st.done_reading([0])
    st.move([0], S.BACKED_UP)  # stored again: still in L3
    st.move([0], S.FREE)
    assert [st.state(p) for p in range(4)] == [S.FREE] * 4 and st.transitions == 9


@pytest.mark.parametrize("setup,to,msg", [
    ([], S.SYNCED, "L2 page 2: illegal state transition FREE -> SYNCED"),
    ([S.RESERVED], S.BACKED_UP, "L2 page 2: illegal state transition RESERVED -> BACKED_UP"),
    ([S.RESERVED, S.PROTECTED, S.SYNCED], S.PROTECTED, "L2 page 2: illegal state transition SYNCED -> PROTECTED"),
    ([S.RESERVED], S.RESERVED, "L2 page 2: illegal state transition RESERVED -> RESERVED"),
])
def test_an_illegal_move_raises_naming_page_from_and_to(setup, to, msg):
    st = HostPageStates(4)
    for s in setup:
        st.move([2], s)
    with pytest.raises(IntegrityError, match=msg):
        st.move([2], to)


def test_a_move_with_one_illegal_page_moves_none():
    st = HostPageStates(3)
    st.move([2], S.RESERVED)
    with pytest.raises(IntegrityError, match="L2 page 2: illegal state transition RESERVED -> RESERVED"):
        st.move([0, 1, 2], S.RESERVED)
    assert [st.state(p) for p in range(3)] == [S.FREE, S.FREE, S.RESERVED]


def test_a_page_being_read_cannot_be_freed_nor_read_unless_indexed():
    st = HostPageStates(2)
    st.move([0], S.RESERVED)
    with pytest.raises(IntegrityError, match="L2 page 0: a transfer reads it in state RESERVED"):
        st.read([0])
    st.move([0], S.PROTECTED)
    st.move([0], S.SYNCED)
    st.read([0])
    with pytest.raises(IntegrityError, match="L2 page 0: illegal state transition SYNCED -> FREE while 1"):
        st.move([0], S.FREE)
    with pytest.raises(IntegrityError, match="L2 page 1: a read ended that never started"):
        st.done_reading([1])


def _tm(host_pages: int = 8):
    lay = KVLayout("tiny", 1, num_kv_heads=1, head_dim=2, page_size=4)
    c = PrefixCache(lay, PageAllocator(8, "L1"), PageAllocator(host_pages, "L2"))
    return c, TierManager(c)


def _computed(c: PrefixCache, toks: list[int]):
    r = c.new_request("x", toks + [0])
    r.lock(r.match())
    r.alloc(len(toks))
    r.commit()
    r.finish()
    return c.match(toks).device_node


def _check(c, tm):
    c.check_integrity(host_in_flight=tm.host_in_flight)
    tm.check_integrity()


def test_each_two_phase_movement_moves_the_states_it_should():
    c, tm = _tm()
    node = _computed(c, X)
    plan = tm.prepare_backup(node)
    assert [tm.states.state(p) for p in plan.host] == [S.PROTECTED] * 4
    _check(c, tm)
    tm.complete_backup(plan, ok=True)
    assert [tm.states.state(p) for p in range(8)] == [S.SYNCED] * 4 + [S.FREE] * 4
    store = tm.prepare_store(node)
    _check(c, tm)
    tm.complete_store(store, stored=4)
    assert [tm.states.state(p) for p in range(4)] == [S.BACKED_UP] * 4
    c.evict(100)  # L1 -> L2 only
    req = tm.plan_load(c.match(X))
    _check(c, tm)
    load = tm.prepare_load(req, c.alloc_device(req.num_pages))
    assert tm.evict_host(100) == []  # read by the load: pinned
    tm.complete_load(load, ok=True)
    _check(c, tm)
    c.evict(100)
    assert sorted(tm.evict_host(100)) == [0, 1, 2, 3]
    assert [tm.states.state(p) for p in range(8)] == [S.FREE] * 8
    _check(c, tm)
    pre = tm.prepare_prefetch(b"\0" * 4 * 4 * 2, "", 0, [b"x" * 16, b"y" * 16])
    assert [tm.states.state(p) for p in pre.host] == [S.PROTECTED] * 2
    tm.complete_prefetch(pre, 1)  # one landed: indexed, from L3; the other freed
    assert [tm.states.state(p) for p in pre.host] == [S.BACKED_UP, S.FREE]
    _check(c, tm)


def test_check_integrity_catches_a_table_out_of_step_with_the_allocator_and_the_index():
    c, tm = _tm()
    node = _computed(c, X)
    tm.complete_backup(tm.prepare_backup(node), ok=True)
    _check(c, tm)
    c.evict(100)
    c.evict_host(100)  # behind the tier manager's back: the pages are free, the table says SYNCED
    with pytest.raises(IntegrityError, match="L2 page 0 is SYNCED but the allocator has it free"):
        tm.check_integrity()
    c2, tm2 = _tm()
    tm2.states.move([5], S.RESERVED)  # a state no allocation backs
    with pytest.raises(IntegrityError, match="L2 page 5 is RESERVED but the allocator has it free"):
        tm2.check_integrity()


def test_off_unless_asked_for(monkeypatch):
    monkeypatch.delenv(ENV)
    c, tm = _tm()
    assert tm.states is None
    node = _computed(c, X)
    tm.complete_backup(tm.prepare_backup(node), ok=True)  # (no table: nothing checked, nothing kept)
    _check(c, tm)
    assert TierManager(PrefixCache(c.layout, PageAllocator(2), PageAllocator(2)), debug_states=True).states


@pytest.mark.parametrize("policy,clean", [("write_through", "0.125"), ("write_back", "0"), ("write_back", "0.125"),
                                          ("write_back", "0.5"), ("write_through_selective", "0.125")])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_randomized_run_over_hicache_keeps_every_l2_page_in_a_legal_state(policy, clean, seed, tmp_path):
    """``clean``: ``write_back_clean_fraction`` (write_back: none, the default, half of L1 cleaned ahead)."""
    rnd = random.Random(seed)
    hc = make("memory://", **{"policy.write_policy": policy, "pool.device_pages": "12",
                              "pool.host_pages": "14", "policy.write_through_threshold": "2",
                              "policy.write_back_clean_fraction": clean})
    assert hc.tiers.states is not None
    prompts = [list(range(1000 * k, 1000 * k + len(TOK))) for k in range(5)] + [TOK, TOK[:12] + [1, 2, 3]]
    for step in range(100):
        op = rnd.random()
        if op < 0.6:
            p = rnd.choice(prompts)
            try:
                serve(hc, f"r{step}", p)
            except OutOfPages:  # L1 pinned by copies in flight: as an engine would, drain and go on
                hc.cache.requests[f"r{step}"].abort()
                hc.drain()
            check_l1_values(hc, p)  # every L1 hit row holds what recomputing it writes
        elif op < 0.75:
            hc.evict(rnd.randint(1, 8))
        elif op < 0.85:
            hc.evict_host(rnd.randint(1, 8))
        elif op < 0.95:
            hc.poll()
        else:
            hc.drain()
        hc.check_integrity()
    hc.drain()
    hc.check_integrity()
    assert hc.tiers.states.transitions > 0
    hc.close()
