"""docker/prometheus.yml and the Grafana dashboard ask for what the service exports.

Every PromQL expression of ``docker/grafana/hicache-dashboard.json`` is checked
against a real ``hicache serve``'s ``/metrics``: each metric it names exists,
and each ``label="value"`` / ``label=~"a|b"`` matcher selects at least one
series there. The scrape target is the Compose service and its REST port.
"""
from __future__ import annotations

import json
import re

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from ..api.conftest import start_serve, stop_serve
from .test_compose import DOCKER

DASHBOARD = DOCKER / "grafana" / "hicache-dashboard.json"


@pytest.fixture(scope="module")
def exported() -> dict[str, list[dict[str, str]]]:
    """Sample name -> label sets, from a live service with an L3 (memory://)."""
    s = start_serve()
    try:
        with s.client() as c:
            text = c.get("/metrics").text
    finally:
        stop_serve(s)
    out: dict[str, list[dict[str, str]]] = {}
    for fam in text_string_to_metric_families(text):
        for sample in fam.samples:
            out.setdefault(sample.name, []).append(sample.labels)
    return out


def dashboard_exprs() -> list[str]:
    dash = json.loads(DASHBOARD.read_text())
    assert dash["uid"] == "hicache" and dash["panels"]
    return [t["expr"] for p in dash["panels"] for t in p["targets"]]


def test_every_dashboard_query_selects_exported_series(exported):
    exprs = dashboard_exprs()
    needed = {"hit rate": "hicache_lookup_pages_total", "bytes moved": "hicache_bytes_total",
              "L3 errors": "hicache_errors_total", "queue depth": "hicache_l3_write_queue_pages"}
    for what, name in needed.items():
        assert any(name in e for e in exprs), f"no panel shows {what} ({name})"
    for expr in exprs:
        for name, matchers in re.findall(r"(hicache_\w+)(?:\{([^}]*)\})?", expr):
            assert name in exported, f"{expr!r}: {name} is not exported; have {sorted(exported)}"
            for label, op, value in re.findall(r'(\w+)\s*(=~|!=|=)\s*"([^"]*)"', matchers):
                if op == "!=":
                    continue
                want = re.compile(value if op == "=~" else re.escape(value))
                assert any(want.fullmatch(ls.get(label, "")) for ls in exported[name]), \
                    f"{expr!r}: no {name} series has {label}{op}{value!r}; have {exported[name]}"


def test_prometheus_scrapes_the_compose_service():
    prom = yaml.safe_load((DOCKER / "prometheus.yml").read_text())
    compose = yaml.safe_load((DOCKER / "compose.yaml").read_text())
    (job,) = prom["scrape_configs"]
    port = compose["services"]["hicache"]["environment"]["HICACHE_SERVICE__PORT"]
    assert job["metrics_path"] == "/metrics"
    assert job["static_configs"] == [{"targets": [f"hicache:{port}"]}]
    mon = {n for n, s in compose["services"].items() if s.get("profiles") == ["monitoring"]}
    assert mon == {"prometheus", "grafana"}  # opt-in: plain `docker compose up` starts neither
    vols = compose["services"]["grafana"]["volumes"]
    assert "./grafana/hicache-dashboard.json:/var/lib/grafana/dashboards/hicache-dashboard.json:ro" in vols
    provider = yaml.safe_load((DOCKER / "grafana/provisioning/dashboards/hicache.yml").read_text())
    assert provider["providers"][0]["options"]["path"] == "/var/lib/grafana/dashboards"
