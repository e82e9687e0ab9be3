"""Every statistic is declared once (``hicache.node.snapshot``) and reaches
both ``/v1/stats`` and ``/metrics``; engines push their own figures (op ``report``)."""
from __future__ import annotations

import dataclasses
import time
import typing

import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from hicache.api.metrics import families
from hicache.api.models import model_from_dataclass
from hicache.api.stats import snapshot
from hicache.index.prefix_cache import CacheStats
from hicache.client.link import ServiceClient
from hicache.core.errors import ServiceError
from hicache.core.hashing import page_hashes
from hicache.cache.hicache import HiCacheStats
from hicache.tiers.cost import AdmissionStats
from hicache.index.misses import REASONS, MissStats
from hicache.node.snapshot import REPORT_FIELDS, EngineReport, StatsSnapshot
from hicache.core.stats import help_of, metric_of, stat
from hicache.tiers.manager import TierMoveStats

from .test_serve_process import commit

FIGURES = {"requests": 3, "prompt_tokens": 50, "l1_hit_tokens_exact": 13, "l1_hit_tokens_visible": 12,
           "l2_hit_tokens_exact": 9, "l2_hit_tokens_visible": 8, "l1_used_pages": 5, "l1_capacity_pages": 64,
           "l1_evictions": 2, "misses": {"first_use": 4, "l2_evicted": 1, "partial_page": 3}}
NO_MISSES = MissStats().as_dict()


def samples(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for fam in text_string_to_metric_families(text):
        out.setdefault(fam.name, []).extend((dict(s.labels), s.value) for s in fam.samples)
    return out


def check_declared(cls: type, data: dict, exported: dict, where: str, seen: set[str]) -> None:
    """Each field of ``cls`` has help and is in ``data`` (JSON); each value field's family is exported."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        here = f"{where}.{f.name}"
        assert help_of(f), f"{here} has no help"
        assert f.name in data, f"{here} missing from /v1/stats"
        seen.add(here)
        tp, value = hints[f.name], data[f.name]
        inner = [a for a in typing.get_args(tp) if dataclasses.is_dataclass(a)]
        if value is None and inner:
            continue  # optional part (L2 has no ``service``); ``seen`` shows it was checked elsewhere
        if dataclasses.is_dataclass(tp) or inner and typing.get_origin(tp) is not dict:
            check_declared(tp if dataclasses.is_dataclass(tp) else inner[0], value, exported, here, seen)
        elif inner:  # dict[str, <dataclass>]
            assert value, f"{here} is empty: the test must fill it"
            for k, v in value.items():
                check_declared(inner[0], v, exported, f"{here}[{k}]", seen)
        elif metric_of(f) is not None and not isinstance(value, str):
            name = "hicache_" + metric_of(f)  # type: ignore[operator]
            assert name in exported, f"{here}: {name} not in /metrics"
            want = f.metadata["labels"]
            assert any(want.items() <= ls.items() for ls, _ in exported[name]), (here, want, exported[name])


def test_every_declared_field_is_in_stats_json_and_metrics(served):
    layout = served.config.layout()
    with served.client() as c, ServiceClient(served.socket_path, layout, pin=False) as eng:
        eng.report(name="engine-a", **FIGURES)
        h = page_hashes(list(range(9000, 9000 + 2 * layout.page_size)), layout.page_size)
        commit(eng, h)
        st = c.get("/v1/stats").json()
        exported = samples(c.get("/metrics").text)
    assert st["tiers"]["L3"]["service"] is not None  # memory:// L3: the write-behind figures are there too
    seen: set[str] = set()
    check_declared(StatsSnapshot, st, exported, "stats", seen)
    assert "stats.engines[%d].l1_hit_tokens_exact" % eng.client_id in seen
    assert "stats.tiers[L3].service.fetch_busy" in seen


def test_a_field_added_to_a_snapshot_reaches_json_and_metrics(make_state, app_of):
    """Adding a statistic is one declaration: model and family follow from it."""
    st = make_state()
    snap = snapshot(st)
    Extended = dataclasses.make_dataclass(
        "Extended", [("widgets", int, stat("Widgets made.", kind="gauge", labels={"op": "made"}, default=0))],
        bases=(StatsSnapshot,))
    ext = Extended(**{f.name: getattr(snap, f.name) for f in dataclasses.fields(StatsSnapshot)}, widgets=7)
    model = model_from_dataclass(Extended, "ExtendedResponse")
    body = model.model_validate(dataclasses.asdict(ext)).model_dump(mode="json")
    assert body["widgets"] == 7 and body["tiers"]["L2"]["capacity_pages"] == 16
    assert model.model_json_schema()["properties"]["widgets"]["description"] == "Widgets made."
    fams = {m.name: m for m in families(ext)}
    assert fams["hicache_widgets"].documentation == "Widgets made."
    assert [(s.labels, s.value) for s in fams["hicache_widgets"].samples] == [({"op": "made"}, 7.0)]
    # The app's own JSON is the same snapshot through the generated StatsResponse.
    with TestClient(app_of(st)) as c:
        real = c.get("/v1/stats").json()
    assert set(real) == set(body) - {"widgets"}


def test_engine_report_is_per_engine_and_gone_on_disconnect(served):
    layout = served.config.layout()
    with served.client() as c:
        a = ServiceClient(served.socket_path, layout, pin=False)
        b = ServiceClient(served.socket_path, layout, pin=False)
        a.report(name="a", **FIGURES)
        b.report(l2_hit_tokens_exact=5)
        a.report(name="a", **{**FIGURES, "l1_hit_tokens_exact": 21})  # replaces a's last report
        engines = c.get("/v1/stats").json()["engines"]
        ka, kb = str(a.client_id), str(b.client_id)
        assert engines[ka] == {**{k: 0 for k in REPORT_FIELDS}, "name": "a", **FIGURES, "l1_hit_tokens_exact": 21,
                               "misses": {**NO_MISSES, **FIGURES["misses"]}}
        assert engines[kb] == {**{k: 0 for k in REPORT_FIELDS}, "name": "", "l2_hit_tokens_exact": 5,
                               "misses": NO_MISSES}
        m = samples(c.get("/metrics").text)
        # labelled by the name each engine gave, with its client id; no name: the client id
        hits = {(ls["engine"], ls["client"], ls["level"], ls["op"]): v for ls, v in m["hicache_engine_hit_tokens"]}
        assert hits[("a", ka, "L1", "exact")] == 21 and hits[("a", ka, "L1", "visible")] == 12
        assert hits[(kb, kb, "L2", "exact")] == 5 and hits[(kb, kb, "L2", "visible")] == 0
        l1 = {(ls["engine"], ls["state"]): v for ls, v in m["hicache_engine_l1_pages"]}
        assert l1[("a", "capacity")] == 64 and l1[("a", "used")] == 5
        a.close()
        for _ in range(400):  # the server drops the connection after a's bye
            time.sleep(0.02)
            engines = c.get("/v1/stats").json()["engines"]
            if ka not in engines:
                break
        assert set(engines) == {kb}
        b.close()


@pytest.mark.parametrize("req,why", [
    ({"figures": {"bogus": 1}}, "unknown figure"),
    ({"figures": {"requests": -1}}, "must be an int"),
    ({"figures": {"requests": True}}, "must be an int"),
    ({"figures": {"requests": 2**63}}, "must be an int"),
    ({"figures": {"requests": 1.5}}, "must be an int"),
    ({"figures": {"misses": {"first_use": -1}}}, "misses must map"),
    ({"figures": {"misses": {"bogus": 1}}}, "misses must map"),
    ({"figures": {"misses": 3}}, "misses must map"),
    ({"figures": [1, 2]}, "figures must be a map"),
    ({"figures": {f"x{i}": 1 for i in range(len(REPORT_FIELDS) + 1)}}, "figures must be a map"),
    ({"figures": {}, "name": "x" * 65}, "name must be printable"),
    ({"figures": {}, "name": "a\nb"}, "name must be printable"),
    ({"figures": {}, "name": 7}, "name must be printable"),
])
def test_bad_reports_are_refused_and_change_nothing(served, req, why):
    layout = served.config.layout()
    with served.client() as c, ServiceClient(served.socket_path, layout, pin=False) as eng:
        eng.report(requests=4)
        with pytest.raises(ServiceError, match=why) as e:
            eng._call({"op": "report", **req})
        assert e.value.kind == "bad_args"
        assert c.get("/v1/stats").json()["engines"][str(eng.client_id)]["requests"] == 4
        eng.report(requests=5)  # the connection still serves
        assert c.get("/v1/stats").json()["engines"][str(eng.client_id)]["requests"] == 5


def test_report_fields_are_the_dataclass_fields():
    assert set(REPORT_FIELDS) | {"name"} == {f.name for f in dataclasses.fields(EngineReport)}


def test_an_embedded_caches_stats_are_reported(served):
    """``report_stats`` maps ``HiCache.stats()``: exact vs page-floored L1/L2 hit tokens."""
    idx = CacheStats(requests=2, admitted_tokens=40, device_hit_tokens=16, device_hit_exact_tokens=18,
                     host_hit_tokens=8, host_hit_exact_tokens=8, device_pages_cached=3, device_pages_private=1,
                     device_evicted_pages=6)
    adm = AdmissionStats(load=3, load_l2=1, recompute=2, unmeasured=5, recomputed_l2_tokens=8,
                         recomputed_l3_tokens=4)
    misses = MissStats(first_use=5, l1_evicted=2, partial_page=2)
    hs = HiCacheStats(idx, TierMoveStats(), {}, {"L1": 32, "L2": 64}, None, adm, misses)
    with served.client() as c, ServiceClient(served.socket_path, served.config.layout(), pin=False) as eng:
        eng.report_stats(hs, name="embedded")
        got = c.get("/v1/stats").json()["engines"][str(eng.client_id)]
        m = samples(c.get("/metrics").text)
    assert got == {"name": "embedded", "requests": 2, "prompt_tokens": 40, "l1_hit_tokens_exact": 18,
                   "l1_hit_tokens_visible": 16, "l2_hit_tokens_exact": 8, "l2_hit_tokens_visible": 8,
                   "l1_used_pages": 4, "l1_capacity_pages": 32, "l1_evictions": 6,
                   "admission_load": 3, "admission_load_l2": 1, "admission_recompute": 2,
                   "admission_unmeasured": 5, "admission_recomputed_tokens": 12, "misses": misses.as_dict()}
    mine = str(eng.client_id)
    decisions = {ls["choice"]: v for ls, v in m["hicache_engine_admission_decisions"]
                 if (ls["engine"], ls["client"]) == ("embedded", mine)}
    assert decisions == {"load": 3, "load_l2": 1, "recompute": 2, "unmeasured": 5}
    by_reason = {ls["reason"]: v for ls, v in m["hicache_engine_miss_pages"]
                 if (ls["engine"], ls["client"]) == ("embedded", mine)}
    assert by_reason == {r: float(getattr(misses, r)) for r in REASONS}


def test_node_misses_are_exported_from_the_start(make_state, app_of):
    """``hicache_miss_pages_total{reason}`` exists before any engine reports, every reason at 0."""
    with TestClient(app_of(make_state())) as c:
        m = samples(c.get("/metrics").text)
        assert {ls["reason"]: v for ls, v in m["hicache_miss_pages"]} == {r: 0.0 for r in REASONS}
        assert all(set(ls) == {"reason"} for ls, _ in m["hicache_miss_pages"])
        assert c.get("/v1/stats").json()["misses"] == NO_MISSES


def test_node_misses_sum_every_report_and_keep_a_gone_engines_share(served):
    """The node's misses sum every engine's reports (a re-report adds only its growth) and
    keep a disconnected engine's share; per engine the family is ``hicache_engine_miss_pages``."""
    layout = served.config.layout()
    with served.client() as c:
        base = {ls["reason"]: v for ls, v in samples(c.get("/metrics").text)["hicache_miss_pages"]}
        a = ServiceClient(served.socket_path, layout, pin=False)
        b = ServiceClient(served.socket_path, layout, pin=False)
        a.report(name="vllm-0", misses={"first_use": 4, "l2_evicted": 1})
        a.report(name="vllm-0", misses={"first_use": 6, "l2_evicted": 1})  # cumulative: adds 2
        b.report(name="vllm-0", misses={"first_use": 3})  # a second engine of the same name
        total = {ls["reason"]: v for ls, v in samples(c.get("/metrics").text)["hicache_miss_pages"]}
        assert total == {r: base[r] + {"first_use": 9.0, "l2_evicted": 1.0}.get(r, 0.0) for r in REASONS}
        per = {(ls["engine"], ls["client"], ls["reason"]): v
               for ls, v in samples(c.get("/metrics").text)["hicache_engine_miss_pages"]}
        ka, kb = str(a.client_id), str(b.client_id)
        assert per[("vllm-0", ka, "first_use")] == 6 and per[("vllm-0", kb, "first_use")] == 3
        a.close()
        for _ in range(400):
            time.sleep(0.02)
            if ka not in c.get("/v1/stats").json()["engines"]:
                break
        after = c.get("/v1/stats").json()
        assert ka not in after["engines"] and after["misses"]["first_use"] == base["first_use"] + 9  # a's share stays
        b.close()
