"""Per-tier statistics of the running service, built from live snapshots.

``snapshot(state)`` reads the engine server's L2 snapshot and the L3 backend's
counters once and returns a ``StatsSnapshot``; ``/v1/stats`` serves it as JSON
(``collect``) and the Prometheus collector turns the same object into metric
families, both generated from the snapshot's field declarations. Bandwidth comes from ``RateTracker``: byte counters
sampled over a sliding window (the app samples once a second, and every
collection samples too).
"""
from __future__ import annotations

import dataclasses
import time

from hicache.api.models import StatsResponse
from hicache.api.state import RATE_WINDOW_S, RateTracker  # noqa: F401  (re-exported)
from hicache.api.state import RestState
from hicache.core.stats import L3TierStats, MissStats
from hicache.node.snapshot import EngineSnapshot, EventSnapshot, StatsSnapshot, TierSnapshot, engine_report

def snapshot(state: RestState) -> StatsSnapshot:
    """One consistent-per-tier snapshot. Blocks briefly on the engine server's loop."""
    s = state.engine.stats()
    page_bytes = state.layout.page_bytes
    ps = state.layout.page_size
    storage = state.storage
    l3 = storage.stats() if storage is not None else None
    counters = {"L2.read": s.acquired * page_bytes, "L2.write": s.commits * page_bytes,
                "L3.read": l3.bytes_read if l3 else 0, "L3.write": l3.bytes_written if l3 else 0}
    rate = state.rates.sample(counters)
    l2 = TierSnapshot(
        tier="L2", configured=True, capacity_pages=s.capacity_pages, capacity_bytes=s.capacity_pages * page_bytes,
        used_pages=s.used_pages, used_bytes=s.used_pages * page_bytes, lookups=s.lookups,
        hit_pages=s.hits, miss_pages=s.misses, hit_tokens_exact=s.hits * ps, hit_tokens_visible=s.hits * ps,
        evictions=s.evictions, flushed=s.flushed, bytes_read=counters["L2.read"],
        bytes_written=counters["L2.write"], read_bytes_per_s=rate["L2.read"],
        write_bytes_per_s=rate["L2.write"], errors=sum(s.errors.values()), errors_by_kind=dict(s.errors))
    if l3 is not None and storage is not None:
        use = storage.usage()  # None: L3 down or cannot tell
        t3 = TierSnapshot(
            tier="L3", configured=True, capacity_pages=None, capacity_bytes=use.max_bytes if use else None,
            used_pages=use.objects if use else None, used_bytes=use.used_bytes if use else None,
            lookups=l3.gets, hit_pages=l3.hits, miss_pages=l3.misses,
            hit_tokens_exact=l3.hits * ps, hit_tokens_visible=l3.hits * ps, evictions=l3.evicted,
            flushed=state.l3_flushed, bytes_read=l3.bytes_read, bytes_written=l3.bytes_written,
            read_bytes_per_s=rate["L3.read"], write_bytes_per_s=rate["L3.write"], errors=l3.errors,
            errors_by_kind={"corrupt": l3.corrupt, "fingerprint_mismatch": l3.fingerprint_mismatch,
                            "put_dropped": l3.put_dropped},
            down=storage.down, service=L3TierStats(**s.l3) if s.l3 else None,
            usage_scope=use.scope if use else None, usage_exact=use.exact if use else None,
            eviction_policy=use.policy if use else None)
    else:
        t3 = TierSnapshot(tier="L3", configured=False, capacity_pages=0, capacity_bytes=0, used_pages=0,
                          used_bytes=0, lookups=0, hit_pages=0, miss_pages=0, hit_tokens_exact=0,
                          hit_tokens_visible=0, evictions=0, flushed=0, bytes_read=0, bytes_written=0,
                          read_bytes_per_s=0.0, write_bytes_per_s=0.0, errors=0, errors_by_kind={})
    bus = state.bus
    return StatsSnapshot(
        fingerprint=state.layout.fingerprint(), page_size=ps, page_bytes=page_bytes,
        uptime_s=time.monotonic() - state.started_at, tiers={"L2": l2, "L3": t3},
        engine=EngineSnapshot(clients=s.clients, clients_total=s.clients_total, reserved_pages=s.reserved_pages,
                              locked_pages=s.locked_pages, duplicates=s.duplicates, reclaimed=s.reclaimed,
                              draft_cut_pages=s.draft_cut_pages, draft_upgraded=s.draft_upgraded,
                              segment_origin=s.segment_origin),
        events=EventSnapshot(subscribers=bus.num_subscribers, published=bus.published, dropped=bus.dropped),
        engines={k: engine_report(v) for k, v in s.engines.items()}, misses=MissStats(**s.reported_misses))


def collect(state: RestState) -> StatsResponse:
    """``snapshot`` as the REST model (generated from the same dataclasses)."""
    return to_response(snapshot(state))


def to_response(snap: StatsSnapshot) -> StatsResponse:
    return StatsResponse.model_validate(dataclasses.asdict(snap))
