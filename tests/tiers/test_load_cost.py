"""Cost-based admission (issue 25, item 7): the pure estimate and choice, and
HiCache.admit loading or recomputing by them, with exact decision counts."""
from __future__ import annotations

import math

import pytest

from hicache.tiers.cost import AdmissionStats, BandwidthMeter, Choice, CostInputs, CostModel, choose, estimate
from tests.helpers.tiers import TOK, check_l1_values, make, serve

from .test_hicache import _Gate, _l2_only

FAST, SLOW = 1e12, 10.0  # bytes/s
RATE = 1000.0  # prefill tokens/s


def inputs(l2=FAST, l3=FAST, rate=RATE, queued=None, bpt=100):
    return CostInputs(bpt, rate, {"L2": l2, "L3": l3}, queued or {})


def test_estimate_is_the_documented_formula():
    e = estimate({"L2": 10, "L3": 10}, bytes_per_token=100, bandwidth={"L2": 1000.0, "L3": 500.0},
                 prefill_tokens_per_s=4.0, queued_bytes={"L3": 500, "L2": 1000})
    # L3 link: (500 queued + 1000) / 500 = 3 s; L2 link: (1000 queued + 2000) / 1000 = 3 s; recompute 20 / 4.
    assert e == (6.0, 5.0)
    assert estimate({"L2": 8}, bytes_per_token=100, bandwidth={"L2": 400.0}, prefill_tokens_per_s=2.0) == (2.0, 4.0)
    with pytest.raises(ValueError, match=r"bandwidth\['L3'\]=0"):
        estimate({"L3": 1}, bytes_per_token=1, bandwidth={"L2": 1.0, "L3": 0}, prefill_tokens_per_s=1.0)


@pytest.mark.parametrize("l2_bw, l3_bw, l2, l3, want", [
    (FAST, FAST, 16, 16, Choice.LOAD),  # fast tiers: load everything
    (FAST, SLOW, 16, 16, Choice.LOAD_L2),  # slow L3: keep the L2 part, recompute the L3 part
    (FAST, SLOW, 0, 16, Choice.RECOMPUTE),  # only an L3 part, slow: recompute it
    (SLOW, FAST, 16, 16, Choice.RECOMPUTE),  # slow L2 (every hit goes through it): recompute
    (SLOW, FAST, 16, 0, Choice.RECOMPUTE),
    (FAST, None, 16, 0, Choice.LOAD),  # no L3 part: its bandwidth is not needed
    (FAST, None, 16, 16, Choice.UNMEASURED),  # L3 not measured yet: load
])
def test_choose_both_ways(l2_bw, l3_bw, l2, l3, want):
    d = choose(l2, l3, inputs(l2_bw, l3_bw))
    assert d.choice is want and (d.l2_tokens, d.l3_tokens) == (l2, l3)
    assert d.load_l2 is (want is not Choice.RECOMPUTE)
    assert d.load_l3 is (want in (Choice.LOAD, Choice.UNMEASURED))
    if want is not Choice.UNMEASURED:
        assert d.plan_s <= min(d.load_s, d.recompute_s) and d.recompute_s == (l2 + l3) / RATE
        assert d.plan_s == {Choice.LOAD: d.load_s, Choice.RECOMPUTE: d.recompute_s}.get(want, d.plan_s)


def test_choose_ties_load_and_queued_bytes_count():
    # 10 tokens of 100 bytes at 1000 B/s = 1 s; recompute at 10 tokens/s = 1 s: a tie loads.
    assert choose(10, 0, inputs(l2=1000.0, rate=10.0)).choice is Choice.LOAD
    # 1000 bytes already queued on L2 make the same load 2 s: recompute.
    assert choose(10, 0, inputs(l2=1000.0, rate=10.0, queued={"L2": 1000})).choice is Choice.RECOMPUTE
    assert choose(10, 0, inputs(rate=None)).choice is Choice.UNMEASURED
    assert math.isnan(choose(10, 0, inputs(rate=None)).load_s)


def test_bandwidth_meter_ewma_and_prefill_measured():
    m = BandwidthMeter({"L2": 100.0}, alpha=0.5)
    m.observe("L2", 300, 1.0)
    m.observe("L3", 50, 0.5)
    m.observe("L3", 0, 1.0)  # nothing moved: no sample
    assert m.rates() == {"L2": 200.0, "L3": 100.0} and m.samples == {"L2": 1, "L3": 1}
    cm = CostModel(bytes_per_token=1, enabled=True, priors={"L2": FAST, "L3": FAST}, alpha=0.5)
    assert cm.decide(4, 0).choice is Choice.UNMEASURED  # no prefill rate yet
    cm.observe_prefill(100, 1.0)
    cm.observe_prefill(300, 1.0)
    assert cm.inputs().prefill_tokens_per_s == 200.0
    assert cm.decide(4, 0).choice is Choice.LOAD
    assert cm.stats == AdmissionStats(load=1, unmeasured=1)
    cm.check_integrity()


def cost(l2=FAST, l3=FAST, rate=RATE):
    return {"admission.prefill_tokens_per_s": rate, "admission.l2_bytes_per_s": l2, "admission.l3_bytes_per_s": l3}


def l3_only(url):
    a = make(url)
    serve(a, "a", TOK)
    a.drain()
    a.close()


def test_slow_l3_recomputes(tmp_path):
    url = f"file://{tmp_path}/l3"
    l3_only(url)
    b = make(url, **cost(l3=SLOW))  # 20 tokens of 64 B over 10 B/s: 128 s against 0.02 s of prefill
    adm, req = serve(b, "b", TOK)
    b.drain()
    assert (adm.host_tokens, adm.storage_tokens, adm.device_tokens) == (0, 0, 0)
    st = b.stats()
    assert st.admission == AdmissionStats(recompute=1, recomputed_l3_tokens=20)
    assert st.storage.gets == 0  # L3 was probed, never read
    assert check_l1_values(b, TOK) == 20  # the recomputed pages are right
    b.check_integrity()
    b.close()


def test_fast_l3_loads_and_measures_bandwidth(tmp_path):
    url = f"file://{tmp_path}/l3"
    l3_only(url)
    b = make(url, **cost())
    adm, req = serve(b, "b", TOK)
    b.drain()
    assert (adm.host_tokens, adm.storage_tokens) == (20, 20)
    assert b.stats().admission == AdmissionStats(load=1)
    assert b.cost.bandwidth.samples == {"L2": 1, "L3": 1}  # both links measured by the real transfers
    assert check_l1_values(b, TOK) == 20
    b.check_integrity()
    b.close()


def test_slow_l2_recomputes_an_l2_hit():
    hc = make("", **cost(l2=SLOW))
    serve(hc, "a", TOK)
    hc.drain()
    hc.evict(100)  # L1 dropped, the L2 copies stay
    assert hc.match(TOK)[0].host_tokens == 20
    adm, _ = serve(hc, "b", TOK)
    hc.drain()
    assert (adm.host_tokens, adm.device_tokens) == (0, 0)
    assert hc.stats().admission == AdmissionStats(recompute=1, recomputed_l2_tokens=20)
    assert hc.stats().tiers.load_back_pages == 0
    assert check_l1_values(hc, TOK) == 20
    adm, _ = serve(hc, "c", TOK)  # now on L1: no L2/L3 part, no decision counted
    assert adm.device_tokens == 20 and hc.stats().admission == AdmissionStats(recompute=1, recomputed_l2_tokens=20)
    hc.check_integrity()
    hc.close()


def test_default_config_loads_unmeasured_and_always_load_counts_nothing(tmp_path):
    for over, want in (({}, AdmissionStats(unmeasured=1)), ({"admission.policy": "always_load"}, AdmissionStats())):
        url = f"file://{tmp_path}/{len(over)}"
        l3_only(url)
        b = make(url, **over)
        adm, _ = serve(b, "b", TOK)
        assert adm.storage_tokens == 20 and b.stats().admission == want
        b.check_integrity()
        b.close()


def test_a_load_in_flight_is_queued_bytes_that_tip_the_next_decision(monkeypatch):
    # 20 tokens of 64 B = 1280 B per hit. L2 at 64 KB/s: one hit loads in 20 ms; prefill 20 tokens in 25 ms.
    hc = make("", **cost(l2=64_000.0, rate=800.0))
    other = [t + 1000 for t in TOK]
    _l2_only(hc, TOK)
    serve(hc, "o", other)
    hc.drain()
    hc.evict(100)
    gate = _Gate(monkeypatch)  # the copy worker holds every load back
    a = hc.new_request("a", TOK)
    assert hc.admit(a).host_tokens == 20  # alone: 20 ms of load < 25 ms of prefill
    assert hc.transfers.queued_bytes() == {"L2": 5 * hc.layout.page_bytes, "L3": 0}
    b = hc.new_request("b", other)
    adm = hc.admit(b)  # behind 1280 queued bytes: 40 ms > 25 ms
    assert adm.host_tokens == 0
    assert hc.stats().admission == AdmissionStats(load=1, recompute=1, recomputed_l2_tokens=20)
    gate.open()
    a.abort()
    b.abort()
    hc.drain()
    assert hc.transfers.queued_bytes() == {"L2": 0, "L3": 0}
    hc.check_integrity()
    hc.close()
