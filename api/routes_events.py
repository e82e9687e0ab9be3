"""``GET /v1/events``: Server-Sent Events of pages stored and removed.

Each event is ``event: stored|removed`` with a ``PageEvent`` JSON ``data``
line and ``id: <seq>``; a comment line every ``KEEPALIVE_S`` seconds keeps
proxies from closing an idle stream. A subscriber's queue holds at most
``queue_size`` events: a slow reader loses the overflow, and every later event
reports how many it lost (``dropped``), so it knows to resynchronise with
``/v1/lookup``. ``max_events`` / ``timeout_s`` end the stream early (scripts,
tests); otherwise it lasts until the client goes away or the service stops.
"""
from __future__ import annotations

import json
import time
from typing import Annotated, AsyncIterator

from fastapi import APIRouter, Query
from fastapi.responses import StreamingResponse
from starlette.background import BackgroundTask

from hicache.api.deps import StateDep
from hicache.api.events import Event, EventBus, Subscription
from hicache.api.models import PageEvent

router = APIRouter(tags=["events"])

KEEPALIVE_S = 5.0


class EventStreamResponse(StreamingResponse):
    media_type = "text/event-stream"


def _sse(e: Event, dropped: int) -> str:
    data = {"seq": e.seq, "type": e.type, "tier": e.tier, "page_hash": e.page_hash.hex(),
            "parent_hash": None if e.parent_hash is None else e.parent_hash.hex(), "dropped": dropped}
    return f"id: {e.seq}\nevent: {e.type}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n"


async def _stream(bus: EventBus, sub: Subscription, max_events: int | None,
                  timeout_s: float | None) -> AsyncIterator[str]:
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    sent = 0
    try:
        yield ": hicache events\n\n"  # flush headers at once so clients see the stream open
        while max_events is None or sent < max_events:
            wait = KEEPALIVE_S if deadline is None else min(KEEPALIVE_S, deadline - time.monotonic())
            if wait <= 0:
                return
            got = await bus.next_batch(sub, wait)
            if got is None:
                return
            events, dropped = got
            if not events:
                yield ": keepalive\n\n"
                continue
            if max_events is not None:
                events = events[:max_events - sent]
            sent += len(events)
            yield "".join(_sse(e, dropped) for e in events)
    finally:
        bus.unsubscribe(sub)


@router.get("/v1/events", response_model=PageEvent, response_class=EventStreamResponse,
            summary="Server-Sent Events of pages stored and removed (each data line is a PageEvent)")
async def events(state: StateDep,
                 max_events: Annotated[int | None, Query(ge=1, le=1_000_000)] = None,
                 timeout_s: Annotated[float | None, Query(gt=0, le=86_400)] = None,
                 queue_size: Annotated[int, Query(ge=1, le=65_536)] = 1024) -> EventStreamResponse:
    sub = state.bus.subscribe(queue_size)  # before returning: nothing published from now on is missed
    # The background task also unsubscribes when the client left before the stream started.
    return EventStreamResponse(_stream(state.bus, sub, max_events, timeout_s),
                               background=BackgroundTask(state.bus.unsubscribe, sub))
