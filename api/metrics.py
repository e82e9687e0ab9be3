"""Prometheus exposition of the live statistics (``/metrics``).

``StatsCollector`` is a custom collector: every scrape calls ``collect()``,
which takes one ``hicache.api.stats.collect`` snapshot and yields metric
families from it, so nothing is cached between scrapes. It is registered on a
registry the app owns (``build_registry``); there is no module-global registry.
Names carry the ``hicache_`` prefix; per-tier series carry ``tier`` and
direction/outcome series an ``op`` label.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from hicache.api.stats import collect

if TYPE_CHECKING:
    from hicache.api.deps import RestState


class StatsCollector(Collector):
    def __init__(self, state: "RestState"):
        self.state = state

    def collect(self) -> Iterator[Metric]:
        st = collect(self.state)
        tiers = [t for t in st.tiers.values() if t.configured]

        def gauge(name: str, doc: str, values: list[tuple[list[str], float]], labels=("tier",)) -> Metric:
            g = GaugeMetricFamily(f"hicache_{name}", doc, labels=list(labels))
            for lv, v in values:
                g.add_metric(lv, v)
            return g

        def counter(name: str, doc: str, values: list[tuple[list[str], float]], labels=("tier",)) -> Metric:
            c = CounterMetricFamily(f"hicache_{name}", doc, labels=list(labels))
            for lv, v in values:
                c.add_metric(lv, v)
            return c

        sized = [t for t in tiers if t.capacity_bytes is not None]
        yield gauge("capacity_bytes", "Tier capacity in bytes.", [([t.tier], t.capacity_bytes) for t in sized])
        yield gauge("capacity_pages", "Tier capacity in pages.", [([t.tier], t.capacity_pages) for t in sized])
        yield gauge("used_bytes", "Bytes held by the tier.", [([t.tier], t.used_bytes) for t in sized])
        yield gauge("used_pages", "Pages held by the tier.", [([t.tier], t.used_pages) for t in sized])
        yield counter("lookup_pages", "Pages looked up, by outcome.",
                      [([t.tier, "hit"], t.hit_pages) for t in tiers]
                      + [([t.tier, "miss"], t.miss_pages) for t in tiers], labels=("tier", "op"))
        yield counter("hit_tokens", "Tokens served from the tier: exact and scheduler-visible (page-floored).",
                      [([t.tier, "exact"], t.hit_tokens_exact) for t in tiers]
                      + [([t.tier, "visible"], t.hit_tokens_visible) for t in tiers], labels=("tier", "op"))
        yield counter("evictions", "Pages evicted to make room.", [([t.tier], t.evictions) for t in tiers])
        yield counter("flushed_pages", "Pages dropped by admin flush.", [([t.tier], t.flushed) for t in tiers])
        yield counter("bytes", "Payload bytes moved, by direction.",
                      [([t.tier, "read"], t.bytes_read) for t in tiers]
                      + [([t.tier, "write"], t.bytes_written) for t in tiers], labels=("tier", "op"))
        yield gauge("bandwidth_bytes_per_second", "Payload bandwidth over the last few seconds.",
                    [([t.tier, "read"], t.read_bytes_per_s) for t in tiers]
                    + [([t.tier, "write"], t.write_bytes_per_s) for t in tiers], labels=("tier", "op"))
        yield counter("errors", "Errors by tier and kind.",
                      [([t.tier, "total"], t.errors) for t in tiers]
                      + [([t.tier, k], v) for t in tiers for k, v in sorted(t.errors_by_kind.items())],
                      labels=("tier", "op"))
        yield gauge("up", "1 when the tier answers (L3: no outage in progress).",
                    [([t.tier], 0.0 if t.down else 1.0) for t in tiers])
        yield gauge("engine_clients", "Engines connected to the local socket.", [([], st.engine.clients)],
                    labels=())
        yield gauge("engine_pages", "L2 pages engines hold now: reserved (being filled) or locked (being read).",
                    [(["reserved"], st.engine.reserved_pages), (["locked"], st.engine.locked_pages)],
                    labels=("state",))
        wb = st.tiers["L3"].service
        if wb is not None:  # the service's write-behind to L3 and its read-through
            yield gauge("l3_write_queue_pages", "Committed pages waiting for the L3 writer.",
                        [([], wb.queue_pages)], labels=())
            yield counter("l3_writeback_pages", "Committed pages by write-behind outcome.",
                          [([op], getattr(wb, op)) for op in ("queued", "written", "dropped", "stale", "failed")],
                          labels=("op",))
            yield counter("l3_fetch_pages", "Pages engines asked the service to fetch from L3, by outcome.",
                          [(["fetched"], wb.fetched), (["no_room"], wb.fetch_no_room)], labels=("op",))
        yield counter("events_published", "KV events published.", [([], st.events.published)], labels=())
        yield counter("events_dropped", "KV event deliveries dropped (a subscriber's queue was full).",
                      [([], st.events.dropped)], labels=())
        yield gauge("event_subscribers", "Open /v1/events streams.", [([], st.events.subscribers)], labels=())


def build_registry(state: "RestState") -> CollectorRegistry:
    """A fresh registry holding only this service's collector."""
    reg = CollectorRegistry(auto_describe=False)
    reg.register(StatsCollector(state))
    return reg


def render(registry: CollectorRegistry) -> bytes:
    """The text exposition format (``text/plain; version=0.0.4``)."""
    return generate_latest(registry)
