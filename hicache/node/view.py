"""What the REST app sees of the node service: ``ServiceView`` and its ``ServiceStats``.

The routes depend on this Protocol only, never on ``NodeServer``, so the app
can be built over any object with these five methods (a test fake, another
server). ``NodeServer`` satisfies it; mypy checks that at the bottom of
``hicache/node/server.py``.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Protocol

from hicache.node.events import Taken
from hicache.core.types import PageHash


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
