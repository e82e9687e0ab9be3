"""Prometheus exposition of the live statistics (``/metrics``).

``StatsCollector`` is a custom collector: every scrape takes one
``hicache.api.stats.snapshot`` and turns it into metric families with
``families``, a loop over the snapshot dataclasses' field declarations
(``hicache.core.stats``): each field names its family, kind, help and fixed
labels, so nothing here lists statistics and nothing is cached between
scrapes. It is registered on a registry the app owns (``build_registry``);
there is no module-global registry. Names carry the ``hicache_`` prefix;
per-tier series carry ``tier`` and direction/outcome series an ``op`` label.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from hicache.api.state import RestState
from hicache.api.stats import snapshot
from hicache.core.stats import help_of, metric_of

PREFIX = "hicache_"


class _Family:
    def __init__(self, kind: str, doc: str):
        self.kind, self.doc = kind, doc
        self.samples: list[tuple[dict[str, str], float]] = []


def _walk(obj: Any, labels: dict[str, str], out: dict[str, _Family], prefix: str = "") -> None:
    if any(f.metadata.get("gate") and not getattr(obj, f.name) for f in dataclasses.fields(obj)):
        return
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        meta = f.metadata
        if value is None:
            continue
        if dataclasses.is_dataclass(value):
            _walk(value, {} if meta.get("scoped") else labels, out, prefix + meta.get("prefix", ""))
            continue
        if isinstance(value, dict) and meta.get("key_label"):
            for key, v in sorted(value.items()):
                if dataclasses.is_dataclass(v):
                    _walk(v, {**labels, **_key_labels(meta, str(key), v)}, out, prefix)
                else:
                    _add(f, v, {**labels, **meta.get("labels", {}), meta["key_label"]: str(key)}, out, prefix)
            continue
        if metric_of(f) is None or isinstance(value, str):
            continue
        _add(f, value, {**labels, **meta.get("labels", {})}, out, prefix)


def _key_labels(meta: Any, key: str, value: Any) -> dict[str, str]:
    """The labels of one value of a ``key_label`` dict: its key, or (``name_label``) the
    name the value gives itself, with the key under the id label."""
    if not meta.get("name_label"):
        return {meta["key_label"]: key}
    name_field, id_label = meta["name_label"]
    return {meta["key_label"]: getattr(value, name_field) or key, id_label: key}


def _add(f: dataclasses.Field, value: Any, labels: dict[str, str], out: dict[str, _Family],
         prefix: str = "") -> None:
    name = prefix + (metric_of(f) or f.name)
    v = float(value)
    if f.metadata.get("invert"):
        v = 1.0 - v
    fam = out.get(name)
    if fam is None:
        fam = out[name] = _Family(f.metadata.get("kind", "counter"), f.metadata.get("family_help") or help_of(f))
    fam.samples.append((labels, v))


def families(snap: Any) -> list[Metric]:
    """Metric families of one snapshot dataclass, in field declaration order."""
    out: dict[str, _Family] = {}
    _walk(snap, {}, out)
    metrics: list[Metric] = []
    for name, fam in out.items():
        names = sorted({k for lv, _ in fam.samples for k in lv})
        cls = CounterMetricFamily if fam.kind == "counter" else GaugeMetricFamily
        m = cls(PREFIX + name, fam.doc, labels=names)
        for lv, v in fam.samples:
            m.add_metric([lv.get(k, "") for k in names], v)
        metrics.append(m)
    return metrics


class StatsCollector(Collector):
    def __init__(self, state: RestState):
        self.state = state

    def collect(self) -> Iterator[Metric]:
        yield from families(snapshot(self.state))


def build_registry(state: RestState) -> CollectorRegistry:
    """A fresh registry holding only this service's collector."""
    reg = CollectorRegistry(auto_describe=False)
    reg.register(StatsCollector(state))
    return reg


def render(registry: CollectorRegistry) -> bytes:
    """The text exposition format (``text/plain; version=0.0.4``)."""
    return generate_latest(registry)
