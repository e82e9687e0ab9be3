"""What the REST app sees of the node service: ``ServiceView`` (the five methods the
routes call; ``NodeServer`` and the REST tests' in-memory view implement it), its
``ServiceStats``, the statistics snapshot (the single declaration of every figure
``/v1/stats`` and ``/metrics`` report, see ``hicache.core.stats``), and KV events as
a pull queue (``EventLog``: the recorder keeps them, its owner takes them).

Sizes are pages and bytes; token counts are ``pages * page_size``. The service
indexes whole pages only, so a hit's exact token count and its
scheduler-visible (page-floored) count are equal for L2/L3; engines push their
own L1/L2 figures (``EngineReport``), where a request's private partial page
makes them differ.
"""
from __future__ import annotations

import dataclasses
import enum
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Iterable, Literal, NamedTuple, Protocol, Sequence

from hicache.core.errors import ConfigError, IntegrityError
from hicache.core.stats import L3TierStats, MissStats, stat
from hicache.core.types import PageHash


class EventKind(enum.Enum):
    STORED = "stored"  # the page became readable on the tier
    REMOVED = "removed"  # the page stopped being readable on the tier (evicted or flushed)


class KVEvent(NamedTuple):
    kind: EventKind
    tier: str  # "L2" or "L3"
    page_hash: PageHash
    parent: PageHash | None  # STORED: the previous page of the same commit (None: its first); REMOVED: None
    owner: int | None  # STORED on L2: the index owner whose commit stored it; else None
    stamp: int  # time.monotonic_ns() when recorded


class Taken(NamedTuple):
    """What one ``take`` returns: events oldest first, and how many were lost before them."""

    events: list[KVEvent]
    dropped: int  # events the full log refused since the previous take


EMPTY = Taken([], 0)


class EventLog:
    """A bounded, thread-safe queue of ``KVEvent`` with a drop counter.

    Thread-safe (one lock): the L3 writer records from its thread while the
    server's loop takes. Every event carries ``stamp`` (``time.monotonic_ns()``
    when recorded), so an owner that takes from several logs can merge them in
    the order things happened (``merge``).

    A component that changes what a tier holds (the L2 index, the L3 writer) records
    ``KVEvent``s in its own log; its owner calls ``take_events()`` when it wants them,
    which returns the events since the previous take and clears them: the recorder
    never knows who reads. When the log is full, new events are dropped and counted;
    the next take reports how many (``Taken.dropped``), so a reader knows it must
    resynchronise (REST clients re-read ``/v1/lookup``).
    """

    def __init__(self, max_events: int):
        if not isinstance(max_events, int) or max_events < 1:
            raise ConfigError(f"event log: max_events={max_events!r}; it must be an integer >= 1")
        self.max_events = max_events
        self._lock = threading.Lock()
        self._queue: deque[KVEvent] = deque()
        self._dropped_since_take = 0
        self.recorded = 0  # events offered since start (kept + dropped)
        self.taken = 0  # events handed out by take()
        self.dropped = 0  # events refused because the log was full, since start

    def record(self, kind: EventKind, tier: str, pages: Iterable[tuple[PageHash, PageHash | None]],
               owner: int | None = None) -> None:
        """Append one event per ``(page hash, parent)``; never blocks (a full log drops)."""
        stamp = time.monotonic_ns()
        self.extend([KVEvent(kind, tier, h, parent, owner, stamp) for h, parent in pages])

    def extend(self, events: Sequence[KVEvent], dropped: int = 0) -> None:
        """Append events recorded elsewhere (an owner forwarding what it took), with
        the ``dropped`` count that came with them."""
        with self._lock:
            room = max(0, self.max_events - len(self._queue))
            self._queue.extend(events[:room])
            lost = len(events) - min(room, len(events)) + dropped
            self.recorded += len(events) + dropped
            self.dropped += lost
            self._dropped_since_take += lost

    def take(self) -> Taken:
        """Every queued event (oldest first) and the drops since the previous take; clears both."""
        with self._lock:
            out = Taken(list(self._queue), self._dropped_since_take)
            self._queue.clear()
            self._dropped_since_take = 0
            self.taken += len(out.events)
        return out

    def __len__(self) -> int:
        with self._lock:
            return len(self._queue)

    def check_integrity(self) -> None:
        """Bounded, in record order, and every offered event is taken, queued or dropped."""
        with self._lock:
            q, recorded, taken, dropped = list(self._queue), self.recorded, self.taken, self.dropped
            since = self._dropped_since_take
        if len(q) > self.max_events:
            raise IntegrityError(f"event log holds {len(q)} events > max_events {self.max_events}")
        if any(b.stamp < a.stamp for a, b in zip(q, q[1:])):
            raise IntegrityError("event log is not in record order")
        if recorded != taken + len(q) + dropped or not 0 <= since <= dropped:
            raise IntegrityError(f"event log: recorded {recorded} != taken {taken} + queued {len(q)} + "
                                 f"dropped {dropped} (dropped since the last take: {since})")


def merge(*taken: Taken) -> Taken:
    """Several takes as one, events in the order they were recorded (stable on ties)."""
    events = sorted((e for t in taken for e in t.events), key=lambda e: e.stamp)
    return Taken(events, sum(t.dropped for t in taken))


@dataclass(slots=True)
class ServiceStats:
    """A snapshot of the service, plain values only (``to_dict`` for JSON)."""

    capacity_pages: int
    page_bytes: int
    segment_bytes: int
    used_pages: int  # reserved + committed
    free_pages: int
    committed_pages: int  # lookup-able
    reserved_pages: int  # being written by clients
    locked_pages: int  # committed and acquired by at least one client
    lookups: int
    hits: int  # pages
    misses: int  # pages
    evictions: int
    reservations: int  # pages reserved since start
    commits: int  # pages inserted since start
    acquired: int  # pages locked for reading by clients since start
    flushed: int  # pages dropped by flush_l2() since start
    duplicates: int
    cancelled: int
    reclaimed: int  # reservations and acquisitions taken back from closed connections
    draft_cut_pages: int  # present pages need_draft lookups did not return (draft rows missing)
    draft_upgraded: int  # draft-incomplete pages replaced by a complete copy
    segment_origin: str  # the L2 segment was "created", "adopted" (after a crash) or "recreated"
    clients: int  # connected and handshaken now
    clients_total: int  # connections accepted since start
    errors: dict[str, int] = field(default_factory=dict)  # refusals by kind
    l3: dict[str, int] = field(default_factory=dict)  # L3TierStats; empty without an L3
    engines: dict[str, dict[str, Any]] = field(default_factory=dict)  # client id -> its EngineReport
    reported_misses: dict[str, int] = field(default_factory=dict)  # MissStats of every report since start (summed)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class ServiceView(Protocol):
    """The node service as the REST routes use it. Every method may be called from
    any thread (the routes run on FastAPI's worker threads).

    A service that is not serving (not started, stopped, its loop stuck) raises
    ``ServiceError`` (or ``TimeoutError`` when its loop does not answer in time);
    ``/readyz`` reports such a service as not ready.
    """

    def stats(self) -> ServiceStats:
        """A consistent snapshot, built fresh on every call; mutates nothing."""
        ...

    def peek_l2(self, hashes: list[PageHash]) -> int:
        """How many leading ``hashes`` L2 holds. Pure: touches no recency or counter."""
        ...

    def expect(self, hashes: list[PageHash]) -> int:
        """A router sends the request of ``hashes`` here (``/v1/lookup`` with intent
        ``admit``): L2's leading pages among them become the most recently used (evicted
        last) and the L3 pages continuing them start loading into L2 in the background.
        Returns the leading pages L2 holds (as ``peek_l2``); counts as an L2 lookup."""
        ...

    def flush_l2(self) -> int:
        """Drop every unlocked committed L2 page; returns how many were dropped."""
        ...

    def take_events(self) -> Taken:
        """KV events (pages stored and removed, per tier) since the previous call,
        oldest first, and how many were dropped meanwhile; clears them (the REST
        app polls it and fans the events out to ``/v1/events`` subscribers)."""
        ...

    def check_integrity(self) -> None:
        """Raise ``IntegrityError`` when an internal invariant does not hold."""
        ...


Tier = Literal["L2", "L3"]


@dataclass(slots=True)
class TierSnapshot:
    """Counters since start for one tier (``None``: the tier cannot know it)."""

    tier: Tier = stat("Tier name.", metric=None)
    configured: bool = stat("Whether the tier is configured.", metric=None, gate=True)
    capacity_pages: int | None = stat("Tier capacity in pages.", kind="gauge")
    capacity_bytes: int | None = stat("Tier capacity in bytes.", kind="gauge")
    used_pages: int | None = stat("Pages held by the tier.", kind="gauge")
    used_bytes: int | None = stat("Bytes held by the tier.", kind="gauge")
    lookups: int = stat("L2: engine lookup calls; L3: pages asked for by get().")
    hit_pages: int = stat("Pages found.", metric="lookup_pages", labels={"op": "hit"},
                          family_help="Pages looked up, by outcome.")
    miss_pages: int = stat("Pages not found.", metric="lookup_pages", labels={"op": "miss"})
    hit_tokens_exact: int = stat("Tokens served from the tier, exact.", metric="hit_tokens", labels={"op": "exact"},
                                 family_help="Tokens served from the tier: exact and scheduler-visible (page-floored).")
    hit_tokens_visible: int = stat("Tokens served from the tier, floored to a page boundary.", metric="hit_tokens",
                                   labels={"op": "visible"})
    evictions: int = stat("Pages evicted to make room.")
    flushed: int = stat("Pages dropped by POST /v1/flush.", metric="flushed_pages")
    bytes_read: int = stat("L2: pages acquired by engines; L3: verified payload bytes returned.", metric="bytes",
                           labels={"op": "read"}, family_help="Payload bytes moved, by direction.")
    bytes_written: int = stat("L2: pages committed by engines; L3: payload bytes stored.", metric="bytes",
                              labels={"op": "write"})
    read_bytes_per_s: float = stat("Read bandwidth over the last few seconds.", kind="gauge",
                                   metric="bandwidth_bytes_per_second", labels={"op": "read"},
                                   family_help="Payload bandwidth over the last few seconds.")
    write_bytes_per_s: float = stat("Write bandwidth over the last few seconds.", kind="gauge",
                                    metric="bandwidth_bytes_per_second", labels={"op": "write"})
    errors: int = stat("Errors, all kinds.", labels={"op": "total"}, family_help="Errors by tier and kind.")
    errors_by_kind: dict[str, int] = stat("Errors by kind.", metric="errors", key_label="op")
    down: bool = stat("L3 only: an outage is in progress.", metric="up", kind="gauge", invert=True,
                      family_help="1 when the tier answers (L3: no outage in progress).", default=False)
    service: L3TierStats | None = stat("L3 only: what the service moved between L2 and L3.", scoped=True,
                                       default=None)
    usage_scope: str | None = stat('L3 only: what used_pages/used_bytes cover: "store" (this directory or '
                                   'in-process store) or "server" (the whole Redis server, other data included).',
                                   metric=None, default=None)
    usage_exact: bool | None = stat("L3 only: used_bytes is exact (False: the file:// ledger's running "
                                    "estimate, never below the truth).", metric=None, default=None)
    eviction_policy: str | None = stat("L3 only: what goes first at the byte cap (Redis: its maxmemory-policy).",
                                       metric=None, default=None)


@dataclass(slots=True)
class EngineSnapshot:
    clients: int = stat("Engines connected to the local socket.", metric="engine_clients", kind="gauge")
    clients_total: int = stat("Engine connections accepted since start.", metric="engine_connections")
    reserved_pages: int = stat("L2 pages engines are filling now.", metric="engine_pages", kind="gauge",
                               labels={"state": "reserved"},
                               family_help="L2 pages engines hold now: reserved (being filled) or locked (being read).")
    locked_pages: int = stat("L2 pages engines are reading now.", metric="engine_pages", kind="gauge",
                             labels={"state": "locked"})
    duplicates: int = stat("Commits of pages L2 already held.", metric="engine_duplicate_pages")
    reclaimed: int = stat("Reservations and acquisitions taken back from closed connections.",
                          metric="engine_reclaimed_pages")
    draft_cut_pages: int = stat("Present pages need_draft lookups did not return (draft rows missing).")
    draft_upgraded: int = stat("Draft-incomplete shared pages replaced by a complete copy.",
                               metric="draft_upgraded_pages")
    segment_origin: str = stat('The L2 segment was "created", "adopted" (after a crash) or "recreated".',
                               metric=None)


@dataclass(slots=True)
class EventSnapshot:
    subscribers: int = stat("Open /v1/events streams.", metric="event_subscribers", kind="gauge")
    published: int = stat("KV events published.", metric="events_published")
    dropped: int = stat("KV event deliveries dropped (a subscriber's queue was full).", metric="events_dropped")


@dataclass(slots=True)
class EngineReport:
    """Figures one engine pushed over the socket (op ``report``): its own L1
    (device) and L2 (host) hits since it started. Exact hit tokens count a
    request's private partial page; visible ones are floored to a page
    boundary, as the scheduler sees them. Gone when the engine disconnects."""

    name: str = stat("The engine's self-chosen name (may be empty).", metric=None, default="")
    requests: int = stat("Requests the engine looked up.", metric="engine_requests", default=0)
    prompt_tokens: int = stat("Prompt tokens of those requests.", metric="engine_prompt_tokens", default=0)
    l1_hit_tokens_exact: int = stat("Tokens found in the engine's L1, exact.", metric="engine_hit_tokens",
                                    labels={"level": "L1", "op": "exact"}, default=0,
                                    family_help="Hit tokens an engine reported, by level: exact and "
                                                "scheduler-visible (page-floored).")
    l1_hit_tokens_visible: int = stat("Tokens found in the engine's L1, page-floored.", metric="engine_hit_tokens",
                                      labels={"level": "L1", "op": "visible"}, default=0)
    l2_hit_tokens_exact: int = stat("Tokens found in L2 by the engine, exact.", metric="engine_hit_tokens",
                                    labels={"level": "L2", "op": "exact"}, default=0)
    l2_hit_tokens_visible: int = stat("Tokens found in L2 by the engine, page-floored.",
                                      metric="engine_hit_tokens", labels={"level": "L2", "op": "visible"},
                                      default=0)
    l1_used_pages: int = stat("Pages the engine's L1 holds now.", metric="engine_l1_pages", kind="gauge",
                              labels={"state": "used"}, family_help="The engine's L1 pages: used and capacity.",
                              default=0)
    l1_capacity_pages: int = stat("The engine's L1 capacity in pages.", metric="engine_l1_pages", kind="gauge",
                                  labels={"state": "capacity"}, default=0)
    l1_evictions: int = stat("Pages the engine evicted from L1.", metric="engine_l1_evictions", default=0)
    admission_load: int = stat("L2/L3 hits the engine loaded (the cost model chose to).",
                               metric="engine_admission_decisions", labels={"choice": "load"}, default=0,
                               family_help="An engine's admissions with an L2/L3 hit, by the cost model's choice "
                                           "(hicache.tiers.cost).")
    admission_load_l2: int = stat("Hits whose L2 part was loaded, L3 part recomputed.",
                                  metric="engine_admission_decisions", labels={"choice": "load_l2"}, default=0)
    admission_recompute: int = stat("Hits recomputed: loading was estimated slower.",
                                    metric="engine_admission_decisions", labels={"choice": "recompute"}, default=0)
    admission_unmeasured: int = stat("Hits loaded before the cost model's inputs were known.",
                                     metric="engine_admission_decisions", labels={"choice": "unmeasured"}, default=0)
    admission_recomputed_tokens: int = stat("L2/L3-hit tokens recomputed instead of loaded.",
                                            metric="engine_admission_recomputed_tokens", default=0)
    misses: MissStats = stat("The engine's missed pages by reason (hicache.index.misses).", default_factory=MissStats,
                             prefix="engine_")


def engine_report(fields: dict[str, Any]) -> EngineReport:
    """An ``EngineReport`` from its ``dataclasses.asdict`` form (the nested ``misses`` too)."""
    d = dict(fields)
    if isinstance(d.get("misses"), dict):
        d["misses"] = MissStats(**d["misses"])
    return EngineReport(**d)


REPORT_FIELDS = tuple(f for f in EngineReport.__dataclass_fields__ if f != "name")
MAX_REPORT_NAME = 64
MAX_REPORT_VALUE = 2**63 - 1


@dataclass(slots=True)
class StatsSnapshot:
    fingerprint: str = stat("Layout fingerprint.", metric=None)
    page_size: int = stat("Tokens per page.", kind="gauge")
    page_bytes: int = stat("Bytes per page.", kind="gauge")
    uptime_s: float = stat("Seconds since the service started.", metric="uptime_seconds", kind="gauge")
    tiers: dict[Tier, TierSnapshot] = stat("Per-tier counters.", key_label="tier")
    engine: EngineSnapshot = stat("Engine connections and the L2 pages they hold.")
    events: EventSnapshot = stat("KV event stream.")
    engines: dict[str, EngineReport] = stat("Figures engines pushed, by client id (op report); in /metrics "
                                            "labelled by the name each engine gave (engine) and its client id.",
                                            key_label="engine", default_factory=dict, name_label=("name", "client"))
    misses: MissStats = stat("Missed pages every engine reported since the service started, by reason (an "
                             "engine that disconnects keeps its share); every reason from the start, at 0.",
                             default_factory=MissStats)
