"""The statistics types of every layer, in one leaf module: the index
(``CacheStats``), tier movements (``TierMoveStats``), an L3 backend (``StorageStats``),
the service's L3 writer and reader (``L3TierStats``), an embedded cache's snapshot
of them all (``HiCacheStats``) and an engine KV connector's (``ConnectorStats``).

One declaration per statistic: ``stat(help, ...)`` is a ``dataclasses.field`` whose
metadata says what the value means and which Prometheus family it feeds. The REST
response models (``hicache.api.models``) and the ``/metrics`` families
(``hicache.api.metrics``) are generated from these dataclasses, so adding a counter
is one new field.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal

from hicache.core.errors import IntegrityError


Kind = Literal["counter", "gauge"]


def stat(help: str, *, metric: str | None = "", kind: Kind = "counter", labels: dict[str, str] | None = None,
         family_help: str | None = None, invert: bool = False, key_label: str | None = None, gate: bool = False,
         scoped: bool = False, default: Any = dataclasses.MISSING, default_factory: Any = dataclasses.MISSING,
         prefix: str = "", name_label: tuple[str, str] | None = None) -> Any:
    """A dataclass field declaring one statistic. Metadata keys:

    - ``help``: what the value is (REST field description; family help).
    - ``metric``: the family name without the ``hicache_`` prefix; ``None`` when
      the field is an identity or a label (``tier``, ``fingerprint``), not a value.
    - ``kind``: ``"counter"`` or ``"gauge"``.
    - ``labels``: fixed labels of this field's series (``{"op": "hit"}``), so
      several fields can share one family.
    - ``family_help``: the family's help when several fields share it.
    - ``invert``: a bool exported as ``1 - value`` (``down`` -> ``up``).
    - ``key_label``: for ``dict[str, <dataclass>]`` fields, the label naming each key.
    - ``gate``: a bool field that, when false, removes its object from ``/metrics``.
    - ``scoped``: a nested dataclass whose series do not inherit the parent's labels.
    - ``prefix``: a nested dataclass whose families are named ``prefix + name`` (an
      engine's misses, ``engine_miss_pages``, beside the node's ``miss_pages``).
    - ``name_label``: a ``key_label`` field's value names its series by this field of
      each value when set (the engine's own name), the key going to label ``id_label``."""
    meta = {"help": help, "metric": metric, "kind": kind, "labels": dict(labels or {}), "family_help": family_help,
            "invert": invert, "key_label": key_label, "gate": gate, "scoped": scoped, "prefix": prefix,
            "name_label": name_label}
    if default_factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=default_factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def help_of(f: dataclasses.Field) -> str:
    return str(f.metadata.get("help", ""))


def metric_of(f: dataclasses.Field) -> str | None:
    """The family name this field feeds (its own name by default), or None."""
    m = f.metadata.get("metric", "")
    return None if m is None else (m or f.name)


@dataclass(slots=True)
class CacheStats:
    """Counters since construction plus gauges at snapshot time. ``as_dict`` for JSON."""

    lookups: int = 0  # PrefixCache.match / Request.match calls
    requests: int = 0  # new_request calls
    requests_finished: int = 0
    requests_aborted: int = 0
    requests_preempted: int = 0
    admitted_tokens: int = 0  # prompt tokens of requests at lock time
    device_hit_tokens: int = 0  # scheduler-visible (page-floored), at lock time
    device_hit_exact_tokens: int = 0  # + own private tails
    host_hit_tokens: int = 0
    host_hit_exact_tokens: int = 0  # == host_hit_tokens: partial pages never reach L2
    inserted_pages: int = 0  # logical pages that entered the index
    duplicate_pages: int = 0  # computed pages freed because the index already had them
    device_evicted_pages: int = 0  # logical pages taken off L1
    host_evicted_pages: int = 0
    draft_truncated_hits: int = 0  # locked hits cut short because draft planes were missing
    draft_truncated_tokens: int = 0  # tokens those hits lost (recomputed instead)
    draft_upgraded_pages: int = 0  # cached pages whose missing draft rows a later request supplied
    device_pages_cached: int = 0  # gauge: owned L1 ids held by the index
    device_pages_private: int = 0  # gauge: owned L1 ids held privately by live requests
    device_pages_free: int = 0
    host_pages_cached: int = 0
    host_pages_free: int = 0
    nodes: int = 0
    live_requests: int = 0

    def as_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)


@dataclass(slots=True)
class TierMoveStats:
    """Tier movement counters (pages unless named otherwise)."""

    storage_lookups: int = 0
    storage_hit_pages: int = 0  # L3 pages continuing the L2 hit, at admission
    prefetch_started: int = 0
    prefetch_pages: int = 0  # pages that landed in L2 from L3
    prefetch_waited_ms: float = 0.0
    load_back_pages: int = 0  # L2 -> L1
    load_back_no_room_pages: int = 0  # L2 hits not loaded: no L1 room (admission never waits for it)
    write_back_queued_pages: int = 0  # write_back: L1 pages of eviction victims queued for L2, evicted once copied
    backup_pages: int = 0  # L1 -> L2 completed
    backup_dropped_pages: int = 0  # no L2 space, or the path was not on L2
    storage_put_pages: int = 0  # L2 -> L3 completed
    storage_put_dropped_pages: int = 0
    storage_put_skipped_draft_pages: int = 0  # not stored: their L2 draft rows are incomplete
    transfer_errors: int = 0

    def as_dict(self) -> dict[str, float]:
        return dataclasses.asdict(self)


@dataclass(slots=True)
class StorageStats:
    """Counters since the backend was opened. ``stats()`` returns a copy.

    Invariants (checked): ``gets == hits + misses``; ``corrupt +
    fingerprint_mismatch <= misses``; no counter is negative. Every page
    handed to ``put`` lands in exactly one of ``put_ok`` / ``put_dropped``.
    """

    gets: int = 0  # pages asked for by get()
    hits: int = 0  # pages returned, verified
    misses: int = 0  # pages not returned: absent, unreadable, L3 down, or rejected below
    corrupt: int = 0  # rejected: framing, version, hash, sizes, length or checksum wrong
    fingerprint_mismatch: int = 0  # rejected: a well-formed object of another layout
    put_ok: int = 0  # pages stored
    put_dropped: int = 0  # pages not stored (L3 down or a per-item error)
    errors: int = 0  # raw calls that raised, and single items that failed (skipped calls: not counted)
    bytes_read: int = 0  # payload bytes returned by get()
    bytes_written: int = 0  # payload bytes stored by put()
    reconnects: int = 0  # outages that ended (L3 answered again after failing)
    lookup_timeouts: int = 0  # bounded prefix_hits() that answered 0: L3 slower than the budget, or busy
    evicted: int = 0  # objects this process removed to keep the store within its byte cap

    def check(self) -> None:
        """Raise ``IntegrityError`` when the counters contradict each other."""
        bad = [f.name for f in dataclasses.fields(self) if getattr(self, f.name) < 0]
        if bad:
            raise IntegrityError(f"negative storage counters {bad}: {self}")
        if self.gets != self.hits + self.misses:
            raise IntegrityError(f"gets={self.gets} != hits={self.hits} + misses={self.misses}")
        if self.corrupt + self.fingerprint_mismatch > self.misses:
            raise IntegrityError(f"corrupt={self.corrupt} + fingerprint_mismatch="
                                 f"{self.fingerprint_mismatch} > misses={self.misses}")


@dataclass(slots=True)
class L3TierStats:
    """Counters since start, in pages unless named otherwise. Every page handed
    to the writer ends in exactly one of written / stale / failed, or is still
    queued; ``dropped`` pages were never queued."""

    queued: int = stat("Committed pages handed to the L3 writer.", metric="l3_writeback_pages",
                       labels={"op": "queued"}, family_help="Committed pages by write-behind outcome.", default=0)
    written: int = stat("Pages stored in L3.", metric="l3_writeback_pages", labels={"op": "written"}, default=0)
    dropped: int = stat("Pages not queued: the writer's queue was full.", metric="l3_writeback_pages",
                        labels={"op": "dropped"}, default=0)
    stale: int = stat("Pages evicted from L2 before the writer copied them.", metric="l3_writeback_pages",
                      labels={"op": "stale"}, default=0)
    failed: int = stat("Pages L3 did not store (down, or a per-page error).", metric="l3_writeback_pages",
                       labels={"op": "failed"}, default=0)
    fetches: int = stat("Engine fetch calls that asked L3.", metric="l3_fetches", labels={"op": "total"},
                        family_help="Engine fetch calls that asked L3, by outcome.", default=0)
    fetched: int = stat("Pages loaded from L3 into L2.", metric="l3_fetch_pages", labels={"op": "fetched"},
                        family_help="Pages engines asked the service to fetch from L3, by outcome.", default=0)
    fetch_timeouts: int = stat("Fetches answered before their load finished (it lands later).",
                               metric="l3_fetches", labels={"op": "timeout"}, default=0)
    fetch_busy: int = stat("Fetches answered from L2 only: too many loads in flight.", metric="l3_fetches",
                           labels={"op": "busy"}, default=0)
    fetch_no_room: int = stat("Pages L3 held that L2 had no room for.", metric="l3_fetch_pages",
                              labels={"op": "no_room"}, default=0)
    skipped_draft: int = stat("Pages committed without valid draft rows: never written to L3.",
                              metric="l3_skipped_draft_pages", default=0)
    queue_pages: int = stat("Committed pages waiting for the L3 writer now.", metric="l3_write_queue_pages",
                            kind="gauge", default=0)

    def to_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)


_FAMILY = "Missed pages by reason (each missed page has exactly one; they sum to the misses)."


def _reason(help: str, name: str) -> object:
    return stat(help, metric="miss_pages", labels={"reason": name}, family_help=_FAMILY, default=0)


@dataclasses.dataclass(slots=True)
class MissStats:
    """Missed pages by reason since start (see the module docstring); the one declaration
    ``HiCache.stats()``, the replay report, ``/v1/stats`` and ``/metrics`` read."""

    first_use: int = _reason("First use: no earlier request computed the page.", "first_use")
    l1_evicted: int = _reason("Evicted from L1 with no L2 copy.", "l1_evicted")
    no_l1_room: int = _reason("On L2, but L1 had no room to load it into (pinned, or its victims "
                              "still being written back).", "no_l1_room")
    l2_evicted: int = _reason("Evicted from L2 with no L3 copy.", "l2_evicted")
    l3_evicted: int = _reason("Evicted from L3 (stored there once, gone now).", "l3_evicted")
    l3_error: int = _reason("L3 held it but the read failed (error, corrupt object).", "l3_error")
    prefetch_expired: int = _reason("L3 held it but the prefetch missed the policy's budget.", "prefetch_expired")
    other_namespace: int = _reason("Another namespace holds the same tokens.", "other_namespace")
    fingerprint_mismatch: int = _reason("L3 holds it under another layout fingerprint.", "fingerprint_mismatch")
    partial_page: int = _reason("The request's last page (partial, or holding the last token).", "partial_page")
    forgotten: int = stat("Pages the bounded miss tracker dropped from its window (0: every reason is exact).",
                          metric="miss_tracker_forgotten_pages", default=0)

    @property
    def total(self) -> int:
        return sum(getattr(self, f) for f in REASONS)

    def as_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)


REASONS = tuple(f.name for f in dataclasses.fields(MissStats) if f.name != "forgotten")


@dataclasses.dataclass(slots=True)
class AdmissionStats:
    """Cost-based admission decisions since start (one per admission with an L2 or L3 hit)."""

    load: int = stat("Hits loaded whole (L2 and L3 parts).", metric="admission_decisions",
                     labels={"choice": "load"}, default=0,
                     family_help="Admissions with an L2/L3 hit, by the cost model's choice.")
    load_l2: int = stat("Hits whose L2 part was loaded and L3 part recomputed.", metric="admission_decisions",
                        labels={"choice": "load_l2"}, default=0)
    recompute: int = stat("Hits recomputed: loading was estimated slower.", metric="admission_decisions",
                          labels={"choice": "recompute"}, default=0)
    unmeasured: int = stat("Hits loaded because an input (prefill rate, a bandwidth) was not known yet.",
                           metric="admission_decisions", labels={"choice": "unmeasured"}, default=0)
    recomputed_l2_tokens: int = stat("L2-hit tokens recomputed instead of loaded.",
                                     metric="admission_recomputed_tokens", labels={"tier": "L2"}, default=0,
                                     family_help="Hit tokens recomputed instead of loaded.")
    recomputed_l3_tokens: int = stat("L3-hit tokens recomputed instead of loaded.",
                                     metric="admission_recomputed_tokens", labels={"tier": "L3"}, default=0)

    def as_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)


# The cost model's choices (``AdmissionStats`` fields, and the ``choice`` label of their families).
ADMISSION_CHOICES = ("load", "load_l2", "recompute", "unmeasured")


def _conn_pages(help: str, event: str, family_help: str | None = None) -> Any:
    return stat(help, metric="connector_pages", labels={"event": event}, family_help=family_help, default=0)


@dataclass(slots=True, frozen=True)
class ConnectorStats:
    """An engine KV connector's counters since start (``hicache.connector``), a snapshot."""

    lookups: int = stat("Requests the connector looked up beyond the engine's own prefix hit.",
                        metric="connector_lookups", default=0)
    hit_tokens: dict[str, int] = stat("Tokens admitted for loading beyond the engine's own prefix hit, by tier.",
                                      metric="connector_hit_tokens", key_label="source",
                                      default_factory=lambda: {"L2": 0, "L3": 0})
    loaded_pages: int = _conn_pages("Pages that reached the engine's blocks (every rank).", "loaded",
                                    "Pages the connector moved or could not, by event: loaded into vLLM's blocks, "
                                    "load_error (reported to vLLM, which recomputes them), saved to L2, "
                                    "save_dropped, stored to L3.")
    load_error_pages: int = _conn_pages("Pages reported to the engine as failed loads (it recomputes them).",
                                        "load_error")
    saved_pages: int = _conn_pages("Pages copied to L2 and indexed.", "saved")
    save_dropped_pages: int = _conn_pages("Pages not saved: no L2 room, or a failed copy.", "save_dropped")
    stored_pages: int = _conn_pages("Pages L3 accepted.", "stored")
    decisions: dict[str, int] = stat("The cost model's load-or-recompute choices on hits.",
                                     metric="connector_admission", key_label="choice",
                                     default_factory=lambda: dict.fromkeys(ADMISSION_CHOICES, 0))
    recomputed_tokens: dict[str, int] = stat("Hit tokens the cost model had recomputed instead of loaded, by tier.",
                                             metric="connector_recomputed_tokens", key_label="tier",
                                             default_factory=lambda: {"L2": 0, "L3": 0})

    @classmethod
    def of(cls, lookups: int, hit_tokens: dict[str, int], pages: dict[str, int],
           admission: AdmissionStats) -> "ConnectorStats":
        """From a connector's own counts (``pages`` by field name) and its cost model's stats."""
        return cls(lookups, dict(hit_tokens), **pages,
                   decisions={c: getattr(admission, c) for c in ADMISSION_CHOICES},
                   recomputed_tokens={"L2": admission.recomputed_l2_tokens, "L3": admission.recomputed_l3_tokens})


@dataclass(slots=True, frozen=True)
class HiCacheStats:
    """A snapshot of an embedded cache (``HiCache.stats``); ``as_dict`` for JSON."""

    index: CacheStats  # the index: lookups, hits (exact and page-floored), pages per tier
    tiers: TierMoveStats  # pages moved between tiers, dropped, failed
    bytes_moved: dict[str, int]  # per direction: d2h, h2d, l3_put, l3_get
    capacity_pages: dict[str, int]  # "L1", "L2"
    storage: StorageStats | None  # the L3 backend's counters; None without L3
    admission: AdmissionStats | None = None  # the cost model's decisions (hicache.tiers.cost)
    misses: MissStats = dataclasses.field(default_factory=MissStats)  # missed pages by reason

    def as_dict(self) -> dict:
        out = {"index": self.index.as_dict(), "tiers": self.tiers.as_dict(), "misses": self.misses.as_dict(),
               "bytes_moved": dict(self.bytes_moved), "capacity_pages": dict(self.capacity_pages)}
        if self.admission is not None:
            out["admission"] = self.admission.as_dict()
        if self.storage is not None:
            out["storage"] = dataclasses.asdict(self.storage)
        return out
