"""KV events as a pull queue: the recorder keeps them, its owner takes them.

A component that changes what a tier holds (the L2 index, the L3 writer)
records ``KVEvent``s in its own ``EventLog``; whoever owns that component
calls its ``take_events()`` when it wants them, which returns the events
recorded since the previous take and clears them. Nothing is called back:
the recorder never knows who reads (the issue-26 rule "the caller asks, the
callee returns").

The log is bounded. When it is full, new events are dropped and counted; the
next ``take`` reports how many were lost since the previous one
(``Taken.dropped``), so a reader knows it must resynchronise (REST clients
re-read ``/v1/lookup``).
"""
from __future__ import annotations

import enum
import threading
import time
from collections import deque
from typing import Iterable, NamedTuple, Sequence

from hicache.core.errors import ConfigError, IntegrityError
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
