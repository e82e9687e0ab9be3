"""KV events (pages stored / removed) fanned out to REST subscribers.

The REST app pulls the node service's events (``ServiceView.take_events``,
see ``pump_events`` in ``hicache.api.app``) and hands each batch to
``EventBus.publish``, which may be called from any thread and never blocks:
each subscriber has a bounded queue, and an event that does not fit is
dropped and counted on that subscriber and on the bus. At most
``max_subscribers`` streams at once (``subscribe`` raises ``SubscribersFull``
past it), and each event's wire text is formatted once, at publish, however
many subscribers there are: a crowd of clients costs the loop queue slots, not
formatting. What a slow client may hold is bounded by the route (``routes``):
one chunk in flight, and a send that waits too long ends its stream. Events the service
itself dropped (its log was full) count as dropped for every subscriber, so
each stream reports them. Subscribers consume on an asyncio loop (the REST
app's); ``publish`` wakes them with ``call_soon_threadsafe``.
"""
from __future__ import annotations

import asyncio
import json
import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Literal, NamedTuple

from hicache.core.errors import HiCacheError, IntegrityError, InvalidArgument
from hicache.node.snapshot import EventKind, Taken

EventType = Literal["stored", "removed"]
_TYPE: dict[EventKind, EventType] = {EventKind.STORED: "stored", EventKind.REMOVED: "removed"}


class Event(NamedTuple):
    seq: int
    type: EventType
    tier: str
    page_hash: bytes
    parent_hash: bytes | None
    sse: str = ""  # its Server-Sent Events text up to the per-subscriber drop count (``sse_text``)


MAX_SUBSCRIBERS = 64  # /v1/events streams at once; each may hold up to its queue_size events


class SubscribersFull(HiCacheError):
    """Every subscriber slot is taken; the message says how many and what to do."""


def _with_sse(e: Event) -> Event:
    data = {"seq": e.seq, "type": e.type, "tier": e.tier, "page_hash": e.page_hash.hex(),
            "parent_hash": None if e.parent_hash is None else e.parent_hash.hex()}
    body = json.dumps(data, separators=(",", ":"))[:-1]
    return e._replace(sse=f'id: {e.seq}\nevent: {e.type}\ndata: {body},"dropped":')


def sse_text(e: Event, dropped: int) -> str:
    """One event as Server-Sent Events text, with the subscriber's drop count."""
    return f"{e.sse}{dropped}}}\n\n"


@dataclass(slots=True, eq=False)
class Subscription:
    """One consumer. ``queue`` and ``dropped`` are guarded by the bus lock."""

    maxsize: int
    loop: asyncio.AbstractEventLoop
    wake: asyncio.Event = field(default_factory=asyncio.Event)  # set on the consumer's loop
    queue: deque = field(default_factory=deque)
    dropped: int = 0
    closed: bool = False


class EventBus:
    """Thread-safe fan-out with bounded per-subscriber queues."""

    def __init__(self, max_subscribers: int = MAX_SUBSCRIBERS) -> None:
        self.max_subscribers = max_subscribers
        self._lock = threading.Lock()
        self._subs: set[Subscription] = set()
        self._seq = 0
        self.published = 0  # events handed to publish (whether or not anybody listened)
        self.dropped = 0  # deliveries dropped, over all subscribers
        self._closed = False

    # ------------------------------------------------------------- producers
    def publish(self, taken: Taken) -> None:
        """Number ``taken``'s events in order and queue them for every subscriber;
        ``taken.dropped`` (lost before the bus) counts as dropped for each one."""
        if not taken.events and not taken.dropped:
            return
        wake = []
        with self._lock:
            events = []
            for e in taken.events:
                self._seq += 1
                events.append(_with_sse(Event(self._seq, _TYPE[e.kind], e.tier, bytes(e.page_hash),
                                              None if e.parent is None else bytes(e.parent))))
            self.published += len(events)
            for s in self._subs:
                room = max(s.maxsize - len(s.queue), 0)
                s.queue.extend(events[:room])
                lost = len(events) - min(room, len(events)) + taken.dropped
                if lost > 0:
                    s.dropped += lost
                    self.dropped += lost
                wake.append(s)
        for s in wake:
            _wake(s)

    # ------------------------------------------------------------- consumers
    def subscribe(self, maxsize: int) -> Subscription:
        """A new subscription on the running loop; call ``unsubscribe`` when done. Raises
        ``SubscribersFull`` when ``max_subscribers`` are subscribed."""
        if maxsize < 1:
            raise InvalidArgument(f"subscription queue size must be >= 1, got maxsize={maxsize}")
        s = Subscription(maxsize, asyncio.get_running_loop())
        with self._lock:
            if len(self._subs) >= self.max_subscribers:
                raise SubscribersFull(f"{len(self._subs)} event streams are open, the most this service "
                                      "serves at once; close one or retry later")
            s.closed = self._closed
            self._subs.add(s)
        return s

    def unsubscribe(self, s: Subscription) -> None:
        with self._lock:
            self._subs.discard(s)

    async def next_batch(self, s: Subscription, timeout: float) -> tuple[list[Event], int] | None:
        """Queued events (possibly none after ``timeout`` s) and the drop count; None once closed."""
        if not s.queue and not s.closed:
            try:
                await asyncio.wait_for(s.wake.wait(), timeout)
            except TimeoutError:
                pass
        s.wake.clear()
        with self._lock:
            if s.closed and not s.queue:
                return None
            out = list(s.queue)
            s.queue.clear()
            return out, s.dropped

    def close(self) -> None:
        """End every subscription (streams finish after draining). Idempotent; any thread."""
        with self._lock:
            self._closed = True
            subs = list(self._subs)
            for s in subs:
                s.closed = True
        for s in subs:
            _wake(s)

    @property
    def num_subscribers(self) -> int:
        with self._lock:
            return len(self._subs)

    def check_integrity(self) -> None:
        """Queues within bounds; drop counts consistent."""
        with self._lock:
            if len(self._subs) > self.max_subscribers:
                raise IntegrityError(f"{len(self._subs)} subscribers, limit {self.max_subscribers}")
            for s in self._subs:
                if len(s.queue) > s.maxsize:
                    raise IntegrityError(f"subscriber queue holds {len(s.queue)} > maxsize {s.maxsize}")
                if any(b.seq <= a.seq for a, b in zip(s.queue, list(s.queue)[1:])):
                    raise IntegrityError("subscriber queue is not in publish order")
            if sum(s.dropped for s in self._subs) > self.dropped:
                raise IntegrityError(f"subscribers dropped more than the bus counted ({self.dropped})")
            if self._seq != self.published:
                raise IntegrityError(f"seq {self._seq} != published {self.published}")


def _wake(s: Subscription) -> None:
    try:
        s.loop.call_soon_threadsafe(s.wake.set)
    except RuntimeError:  # the consumer's loop is closed: nobody to wake
        pass
