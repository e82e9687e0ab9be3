"""Finite numbers only, in every float setting and in the cost model's observations (issue 36, row 13).

Before the fix ``admission.prefill_tokens_per_s=inf`` recomputed every hit,
``l2_bytes_per_s=inf`` turned the meter NaN, and ``observe_prefill(inf, 1)``
made the estimate NaN for good (every decision LOAD, ``check_integrity``
blind to it).
"""
from __future__ import annotations

import math

import pytest

from hicache.core.config import HiCacheConfig
from hicache.core.errors import ConfigError, IntegrityError, InvalidArgument
from hicache.tiers.cost import BandwidthMeter, Choice, CostModel

FLOAT_SETTINGS = [f"{section}.{name}" for section, sec in HiCacheConfig.model_fields.items()
                  if hasattr(sec.annotation, "model_fields")
                  for name, f in sec.annotation.model_fields.items() if f.annotation is float]


def test_every_float_setting_is_listed():
    assert {"admission.prefill_tokens_per_s", "admission.l2_bytes_per_s", "admission.l3_bytes_per_s",
            "admission.ewma_alpha", "policy.prefetch_timeout_cap_ms", "service.idle_timeout_s"} <= set(FLOAT_SETTINGS)


@pytest.mark.parametrize("key", FLOAT_SETTINGS)
@pytest.mark.parametrize("value", ["inf", "-inf", "nan", "Infinity"])
def test_no_float_setting_takes_a_non_finite_value(key, value):
    with pytest.raises(ConfigError, match=f"{key}={value!r}: Input should be a finite number"):
        HiCacheConfig.load(overrides={key: value}, env={})


def test_toml_inf_is_refused_too(tmp_path):
    p = tmp_path / "c.toml"
    p.write_text("[admission]\nl2_bytes_per_s = inf\n")
    with pytest.raises(ConfigError, match="admission.l2_bytes_per_s=inf: Input should be a finite number"):
        HiCacheConfig.load(p, env={})


def test_observe_prefill_refuses_non_finite_and_the_estimate_stays_sane():
    cm = CostModel(bytes_per_token=1000, enabled=True, priors={"L2": 1e9})
    cm.observe_prefill(1000, 0.1)
    for bad in ((math.inf, 1), (1, math.nan), (math.nan, math.nan), (1000, -math.inf)):
        with pytest.raises(InvalidArgument, match="observe_prefill.*expected finite numbers"):
            cm.observe_prefill(*bad)
    cm.observe_prefill(1e308, 1e-308)  # finite inputs whose rate overflows: skipped
    assert cm.inputs().prefill_tokens_per_s == pytest.approx(1e4)
    cm.check_integrity()
    # 1 MB of KV against 1 GB/s and 10k tokens/s: loading (1 ms) beats recomputing (0.1 s)
    assert cm.decide(1000, 0).choice is Choice.LOAD


def test_the_meter_never_takes_an_infinite_rate():
    m = BandwidthMeter({}, 0.5)
    m.observe("L2", 1000, 1e-320)  # a denormal duration: the rate overflows
    m.observe("L2", 1000, math.nan)
    assert m.rates()["L2"] is None
    m.observe("L2", 1000, 1.0)
    assert m.rates()["L2"] == 1000.0


def test_check_integrity_sees_a_non_finite_estimate():
    cm = CostModel(bytes_per_token=1, enabled=True)
    cm._prefill = math.nan  # what the old observe_prefill(inf, 1) left behind
    with pytest.raises(IntegrityError, match="measured prefill rate is nan"):
        cm.check_integrity()
    with pytest.raises(InvalidArgument, match="prefill_tokens_per_s=inf"):
        CostModel(bytes_per_token=1, enabled=True, prefill_tokens_per_s=math.inf)
