"""hicache.integrations.metrics: the adapters' metric set, derived from AdapterStats,
on a registry; values follow an L3 backend's counters exactly."""
from __future__ import annotations

import dataclasses
import logging

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from hicache.core.errors import IntegrityError
from hicache.integrations.metrics import (
    SGLANG_PREFIX,
    AdapterMetrics,
    AdapterStats,
    GroupCounts,
    Increases,
    PoolCounts,
    SglangStats,
    VllmTierStats,
    adapter_stats,
    families,
    series,
    sglang_stats,
    start_line,
    warnings_for,
)
from hicache.core.layout import KVLayout
from hicache.core.stats import metric_of
from hicache.storage import open_storage

LAYOUT = KVLayout("metrics-test", 2, num_kv_heads=1, head_dim=8, page_size=4, dtype="float16")
SIZES = [p.page_bytes for p in LAYOUT.planes]


def key(i: int) -> bytes:
    return i.to_bytes(16, "big")


def payload(i: int) -> bytes:
    return bytes([i % 251]) * LAYOUT.page_bytes


def sample(reg, name: str, **labels) -> float:
    v = reg.get_sample_value(name, labels)
    return 0.0 if v is None else v


def test_families_follow_the_store_counters():
    reg = CollectorRegistry()
    store = open_storage("memory://", fingerprint=LAYOUT.fingerprint())
    m = AdapterMetrics("sglang", registry=reg)
    assert store.put([(key(i), payload(i), SIZES) for i in range(3)]) == 3
    got = store.get([key(0), key(1), key(7)], SIZES)
    assert [g is not None for g in got] == [True, True, False]
    # a foreign object (another layout's fingerprint) under our key
    other = open_storage("memory://", fingerprint=LAYOUT.replace(model_id="other").fingerprint())
    other.put([(key(9), payload(9), SIZES)])
    obj = other._objects[other.key_prefix + key(9)]
    store._objects[store.key_prefix + key(9)] = obj  # what a shared store shows another layout
    store._nbytes += len(obj)
    assert store.get([key(9)], SIZES) == [None]
    assert store.delete([key(9)]) == 1  # foreign objects are left in place; check_integrity would flag it
    # a corrupt one: flip its last byte
    full = store.key_prefix + key(2)
    obj = bytearray(store._objects[full])
    obj[-1] ^= 0xFF
    store._objects[full] = bytes(obj)
    assert store.get([key(2)], SIZES) == [None]
    m.update(adapter_stats(store, lookups=5, lookup_hits=3, skipped=4))
    s = store.stats()
    assert sample(reg, "hicache_adapter_load_pages_total", engine="sglang", result="hit") == s.hits == 2
    assert sample(reg, "hicache_adapter_load_pages_total", engine="sglang", result="miss") == s.misses == 3
    assert sample(reg, "hicache_adapter_store_pages_total", engine="sglang", result="stored") == 3
    assert sample(reg, "hicache_adapter_store_pages_total", engine="sglang", result="skipped") == 4
    assert sample(reg, "hicache_adapter_lookup_pages_total", engine="sglang", result="asked") == 5
    assert sample(reg, "hicache_adapter_lookup_pages_total", engine="sglang", result="found") == 3
    assert sample(reg, "hicache_adapter_bytes_total", engine="sglang", op="write") == 3 * LAYOUT.page_bytes
    assert sample(reg, "hicache_adapter_bytes_total", engine="sglang", op="read") == 2 * LAYOUT.page_bytes
    assert sample(reg, "hicache_adapter_rejected_objects_total", engine="sglang", reason="corrupt") == 1
    assert sample(reg, "hicache_adapter_rejected_objects_total", engine="sglang", reason="foreign") == 1
    # a second update adds only what changed; a second adapter on the registry shares the families
    store.get([key(0)], SIZES)
    m.update(adapter_stats(store, lookups=5, lookup_hits=3, skipped=4))
    m2 = AdapterMetrics("sglang", registry=reg)
    m2.update(AdapterStats(hits=10, errors={"put": 2}))
    assert sample(reg, "hicache_adapter_load_pages_total", engine="sglang", result="hit") == 3 + 10
    assert sample(reg, "hicache_adapter_errors_total", engine="sglang", op="put") == 2
    text = generate_latest(reg).decode()
    families = {ln.split()[2].removesuffix("_total") for ln in text.splitlines()
                if ln.startswith("# TYPE") and ln.endswith(" counter")}
    assert families == {"hicache_adapter_lookup_pages", "hicache_adapter_load_pages", "hicache_adapter_store_pages",
                        "hicache_adapter_bytes", "hicache_adapter_rejected_objects", "hicache_adapter_errors",
                        "hicache_adapter_pool_pages"}
    m.check_integrity()
    store.check_integrity()


def test_errors_are_counted_per_operation():
    reg = CollectorRegistry()
    store = open_storage("redis://127.0.0.1:1/0", fingerprint=LAYOUT.fingerprint(), timeout_ms=20, max_retries=0)
    try:
        assert store.put([(key(1), payload(1), SIZES)]) == 0  # connection refused: opens the circuit
        by_op = store.errors_by_op()
        assert by_op == {"put": 1} and store.stats().errors == 1
        m = AdapterMetrics("vllm", registry=reg)
        m.update(adapter_stats(store))
        assert sample(reg, "hicache_adapter_errors_total", engine="vllm", op="put") == 1
        assert sample(reg, "hicache_adapter_store_pages_total", engine="vllm", result="dropped") == 1
        store.check_integrity()
    finally:
        store.close()


def test_a_counter_never_goes_down():
    reg = CollectorRegistry()
    m = AdapterMetrics("sglang", registry=reg)
    m.update(AdapterStats(hits=5))
    m.update(AdapterStats(hits=2))  # e.g. the store was reopened: rebase, do not subtract
    m.update(AdapterStats(hits=4))
    assert sample(reg, "hicache_adapter_load_pages_total", engine="sglang", result="hit") == 7


def test_every_field_declares_a_family():
    for cls in (AdapterStats, SglangStats, PoolCounts, VllmTierStats, GroupCounts):
        for f in dataclasses.fields(cls):
            assert metric_of(f) or f.metadata["key_label"], (cls, f.name)  # a family, or a dict of them
            assert f.metadata["help"], (cls, f.name)


def test_check_integrity_catches_an_undeclared_series():
    m = AdapterMetrics("sglang", registry=CollectorRegistry())
    m._increases._last[("made_up", ())] = 1.0
    with pytest.raises(IntegrityError, match="made_up"):
        m.check_integrity()
    m = AdapterMetrics("sglang", registry=CollectorRegistry())
    m._increases._last[("load_pages", (("op", "x"),))] = 1.0  # a declared family, undeclared labels
    with pytest.raises(IntegrityError, match="load_pages"):
        m.check_integrity()


def test_sglang_channel_serves_exactly_the_declared_families():
    """Every SglangStats family, its help and its labels (plus ``engine``), nothing else."""
    reg = CollectorRegistry()
    m = AdapterMetrics("sglang", registry=reg)
    m.update(AdapterStats(errors={"get": 1}))
    declared = families(SglangStats)
    assert families(AdapterStats).items() <= declared.items()
    assert set(declared) - set(families(AdapterStats)) == {"pool_pages"}
    served = {f.name: f for f in reg.collect()}
    assert set(served) == {SGLANG_PREFIX + n for n in declared}
    for name, fam in declared.items():
        assert (served[SGLANG_PREFIX + name].type, served[SGLANG_PREFIX + name].documentation) == (fam.kind, fam.help)
        assert m._counters[name]._labelnames == ("engine", *fam.labels)
    m.check_integrity()


def test_the_vllm_declaration_extends_the_shared_one():
    """vLLM's tier counts what SGLang's backend counts under the same families (same help,
    same labels), plus its own; the exact family and label sets are pinned here (the
    vLLM channel itself is tested in tests/integrations/vllm/test_observability.py)."""
    shared, vllm = families(AdapterStats), families(VllmTierStats)
    assert shared.items() <= vllm.items()
    assert {n: (f.kind, f.labels) for n, f in vllm.items()} == {
        "lookup_pages": ("counter", ("result",)), "load_pages": ("counter", ("result",)),
        "store_pages": ("counter", ("result",)), "bytes": ("counter", ("op",)),
        "rejected_objects": ("counter", ("reason",)), "errors": ("counter", ("op",)),
        "jobs": ("counter", ("op", "result")), "jobs_reported": ("counter", ()),
        "known_chunks": ("gauge", ()), "group_pages": ("counter", ("group", "result"))}
    s = VllmTierStats(hits=3, misses=1, known_chunks=7, errors={"put": 2},
                      groups={"0": GroupCounts(stored=4, loaded=1), "3": GroupCounts(load_missed=2)})
    got = {(n, tuple(sorted(lab.items()))): v for n, lab, v in series(s) if v}
    assert got == {("load_pages", (("result", "hit"),)): 3, ("load_pages", (("result", "miss"),)): 1,
                   ("known_chunks", ()): 7, ("errors", (("op", "put"),)): 2,
                   ("group_pages", (("group", "0"), ("result", "stored"))): 4,
                   ("group_pages", (("group", "0"), ("result", "hit"))): 1,
                   ("group_pages", (("group", "3"), ("result", "miss"))): 2}


def test_sglang_pools_sum_and_count_per_pool():
    reg = CollectorRegistry()
    kv = AdapterStats(lookups=4, lookup_hits=2, hits=3, misses=1, stored=5, errors={"get": 1})
    swa = AdapterStats(hits=7, misses=1, stored=8, corrupt=1, errors={"get": 2, "put": 1})
    s = sglang_stats({"kv": kv, "swa": swa})
    assert (s.lookups, s.hits, s.misses, s.stored, s.corrupt, s.errors) == (4, 10, 2, 13, 1, {"get": 3, "put": 1})
    assert s.pools == {"kv": PoolCounts(hits=3, misses=1, stored=5), "swa": PoolCounts(hits=7, misses=1, stored=8)}
    m = AdapterMetrics("sglang", registry=reg)
    m.update(s)
    assert sample(reg, "hicache_adapter_pool_pages_total", engine="sglang", pool="swa", result="hit") == 7
    assert sample(reg, "hicache_adapter_pool_pages_total", engine="sglang", pool="kv", result="stored") == 5
    assert sample(reg, "hicache_adapter_load_pages_total", engine="sglang", result="hit") == 10
    m.check_integrity()


def test_increases_report_gauges_as_values_and_counters_as_gains():
    inc = Increases(VllmTierStats)
    first = inc.take(VllmTierStats(stored=2, known_chunks=5))
    assert {(f.name, v) for f, _, v in first} == {("store_pages", 2.0), ("known_chunks", 5.0)}
    second = inc.take(VllmTierStats(stored=3, known_chunks=4))
    assert {(f.name, v) for f, _, v in second} == {("store_pages", 1.0), ("known_chunks", 4.0)}
    inc.check_integrity()
    with pytest.raises(IntegrityError, match="outside the declared families"):
        Increases(AdapterStats).take(VllmTierStats(store_jobs=1))


def test_fields_sharing_a_family_must_agree_on_its_labels():
    @dataclasses.dataclass
    class Bad:
        a: int = dataclasses.field(default=0, metadata={"metric": "x", "labels": {"op": "r"}, "kind": "counter",
                                                        "key_label": None, "help": "a"})
        b: int = dataclasses.field(default=0, metadata={"metric": "x", "labels": {"result": "w"}, "kind": "counter",
                                                        "key_label": None, "help": "b"})
    with pytest.raises(IntegrityError, match="family x"):
        families(Bad)


def test_start_line_redacts_and_warnings_are_rate_limited(caplog):
    log = logging.getLogger("hicache.test.adapter")
    with caplog.at_level(logging.INFO, logger="hicache.test.adapter"):
        start_line(log, "sglang", "redis://user:s3cret@host:6379/0", "abcd1234", "8 pages")
        limiter = warnings_for(log)
        for i in range(50):
            limiter.warning("put", "put failed %d", i)
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0] == ("hicache sglang adapter started: L3 redis://user:***@host:6379/0, layout fingerprint "
                        "abcd1234, 8 pages")
    assert "s3cret" not in "".join(lines)
    assert lines[1:] == [f"put failed {i}" for i in range(5)]
    assert limiter.suppressed_total == 45
