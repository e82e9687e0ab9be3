"""The REST routes, one router per concern (``ROUTERS``, included by ``hicache.api.app``):

- ``health_router``: ``/healthz`` (the process answers) and ``/readyz`` (engine socket and L3 reachable).
- ``stats_router``: ``/v1/stats`` (JSON), ``/metrics`` (Prometheus text) and ``/v1/config``.
- ``lookup_router``: ``POST /v1/lookup``: per-tier prefix hit of a prompt, for cache-aware routers.
- ``events_router``: ``GET /v1/events``: Server-Sent Events of pages stored and removed.
- ``admin_router``: Admin actions (``POST /v1/flush``); every route here needs the admin token (see ``deps``).

and the configuration as ``/v1/config`` shows it (``redacted_config``: secrets out).
"""
from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Annotated, Any, AsyncIterator

from fastapi import APIRouter, HTTPException, Query, Request, Response, status
from fastapi.responses import StreamingResponse
from starlette.background import BackgroundTask
from starlette.types import Message, Send

from hicache.api.deps import AdminDep, StateDep
from hicache.api.events import EventBus, Subscription, SubscribersFull, sse_text
from hicache.api.rest_guards import parsed_tokens
from hicache.api.metrics import render
from hicache.api.models import (ConfigResponse, ErrorBody, FlushRequest, FlushResponse, Health, L3Readiness,
                                LookupByTokens, LookupRequest, LookupResponse, PageEvent, Readiness, StatsResponse,
                                TierHit)
from hicache.api.stats import collect
from hicache.core.config import HiCacheConfig
from hicache.core.errors import ServiceError
from hicache.core.hashing import page_hashes
from hicache.core.redact import REDACTED, Redactor, redact_url
from hicache.core.types import PageHash


def redacted_config(cfg: HiCacheConfig, token_set: bool) -> dict[str, Any]:
    """The configuration as JSON-ready data, secrets replaced by ``***``.

    ``token_set``: an admin token is in force (possibly read from
    ``admin_token_file``); shown as ``***`` so operators can see that it is.
    """
    d = Redactor.from_config(cfg).value(cfg.model_dump(mode="json"))
    d["storage"]["url"] = redact_url(d["storage"]["url"])
    if token_set or d["service"]["admin_token"]:
        d["service"]["admin_token"] = REDACTED
    for key in ("auth_key",):
        if d["storage"].get(key):
            d["storage"][key] = REDACTED
    return d


# ---- ``/healthz`` (the process answers) and ``/readyz`` (engine socket and L3 reachable).
health_router = APIRouter(tags=["health"])


@health_router.get("/healthz", response_model=Health, summary="Liveness: the process answers")
def healthz() -> Health:
    return Health()


@health_router.get("/readyz", response_model=Readiness, summary="Readiness: engine socket serving and L3 reachable",
            responses={503: {"model": Readiness, "description": "not ready (e.g. the configured L3 is unreachable)"}})
def readyz(state: StateDep, response: Response) -> Readiness:
    try:
        state.engine.stats()
        engine = True
    except (ServiceError, FutureTimeout, RuntimeError):
        engine = False
    st = state.storage
    l3 = L3Readiness(configured=st is not None, url=redact_url(state.config.storage.url),
                     reachable=st is None or st.ping())
    ready = engine and l3.reachable
    if not ready:
        response.status_code = status.HTTP_503_SERVICE_UNAVAILABLE
    return Readiness(ready=ready, engine=engine, l3=l3)


# ---- ``/v1/stats`` (JSON), ``/metrics`` (Prometheus text) and ``/v1/config``.
stats_router = APIRouter(tags=["stats"])

PROMETHEUS_TEXT = "text/plain; version=0.0.4; charset=utf-8"


class PrometheusResponse(Response):
    media_type = PROMETHEUS_TEXT


@stats_router.get("/v1/stats", response_model=StatsResponse, summary="Per-tier statistics since start")
def stats(state: StateDep) -> StatsResponse:
    return collect(state)


@stats_router.get("/metrics", response_model=str, response_class=PrometheusResponse,
            summary="Prometheus metrics (text exposition format)")
def metrics(request: Request) -> Response:
    return PrometheusResponse(render(request.app.state.registry))


@stats_router.get("/v1/config", response_model=ConfigResponse, dependencies=[AdminDep], summary="Resolved configuration (secrets redacted)")
def config(state: StateDep) -> ConfigResponse:
    layout = state.layout
    return ConfigResponse(config=redacted_config(state.config, bool(state.admin_token)), fingerprint=layout.fingerprint(),
                          layout=layout.to_dict(), page_bytes=layout.page_bytes)


# ---- ``POST /v1/lookup``: per-tier prefix hit of a prompt, for cache-aware routers.
lookup_router = APIRouter(tags=["lookup"])


@lookup_router.post("/v1/lookup", response_model=LookupResponse,
             summary="Leading pages of a token list (or page hashes) held by L2, then by L3; with intent "
                     "'admit', also keep its L2 pages and start loading its L3 pages into L2")
def lookup(req: LookupRequest, state: StateDep, request: Request) -> LookupResponse:
    ps = state.layout.page_size
    if isinstance(req, LookupByTokens):
        tokens = parsed_tokens(request.scope)  # a big list BodyGate read off the loop (the body held [])
        if tokens is None:
            tokens = req.tokens
        try:
            req.namespace.encode("utf-8")
        except UnicodeEncodeError:
            raise HTTPException(status.HTTP_422_UNPROCESSABLE_ENTITY, detail=[
                {"loc": ["body", "namespace"], "type": "string_unicode",
                 "msg": "namespace must be valid Unicode text (it holds a lone surrogate escape)"}]) from None
        hashes = page_hashes(tokens, ps, namespace=req.namespace)
    else:
        hashes = [PageHash(bytes.fromhex(h)) for h in req.hashes]
    l2 = state.engine.expect(hashes) if req.intent == "admit" else state.engine.peek_l2(hashes)
    l3: int | None = None
    if req.include_l3 and state.storage is not None:
        l3 = state.storage.prefix_hits(hashes[l2:])
    total = l2 + (l3 or 0)
    return LookupResponse(
        page_size=ps, query_pages=len(hashes), L2=TierHit(pages=l2, tokens=l2 * ps),
        L3=None if l3 is None else TierHit(pages=l3, tokens=l3 * ps),
        total=TierHit(pages=total, tokens=total * ps),
        hit_tokens_exact=total * ps, hit_tokens_visible=total * ps)


# ---- ``GET /v1/events``: Server-Sent Events of pages stored and removed.
events_router = APIRouter(tags=["events"])

KEEPALIVE_S = 5.0
CHUNK_EVENTS = 256  # events per write (~60 KB): what one client holds in flight, and a yield to the loop between
SEND_TIMEOUT_S = 30.0  # a client that accepts no bytes for this long is dropped: its stream ends


class _SlowClient(Exception):
    pass


class EventStreamResponse(StreamingResponse):
    """An SSE stream that drops a client which accepts no bytes for ``send_timeout_s``
    (uvicorn then closes its connection), so a client that never reads holds one
    chunk and its queue slots, never the service."""

    media_type = "text/event-stream"

    def __init__(self, content: Any, status_code: int = 200, headers: Any = None, media_type: str | None = None,
                 background: BackgroundTask | None = None, send_timeout_s: float = SEND_TIMEOUT_S):
        super().__init__(content, status_code, headers, media_type, background)
        self.send_timeout_s = send_timeout_s

    async def stream_response(self, send: Send) -> None:
        async def timed(msg: Message) -> None:
            try:
                await asyncio.wait_for(send(msg), self.send_timeout_s)
            except TimeoutError:
                raise _SlowClient from None
        try:
            await super().stream_response(timed)
        except _SlowClient:
            log.info("/v1/events: a client took no bytes for %.0f s; dropped it", self.send_timeout_s)
            await self.body_iterator.aclose()  # type: ignore[attr-defined]  (unsubscribes now)


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
            for i in range(0, len(events), CHUNK_EVENTS):
                yield "".join(sse_text(e, dropped) for e in events[i:i + CHUNK_EVENTS])
    finally:
        bus.unsubscribe(sub)


@events_router.get("/v1/events", response_model=PageEvent, response_class=EventStreamResponse,
            summary="Server-Sent Events of pages stored and removed (each data line is a PageEvent)",
            responses={503: {"model": ErrorBody, "description": "every event stream slot is taken"}})
async def events(state: StateDep,
                 max_events: Annotated[int | None, Query(ge=1, le=1_000_000)] = None,
                 timeout_s: Annotated[float | None, Query(gt=0, le=86_400)] = None,
                 queue_size: Annotated[int, Query(ge=1, le=65_536)] = 1024) -> EventStreamResponse:
    try:
        sub = state.bus.subscribe(queue_size)  # before returning: nothing published from now on is missed
    except SubscribersFull as e:
        raise HTTPException(status.HTTP_503_SERVICE_UNAVAILABLE, str(e), headers={"Retry-After": "5"}) from None
    # The background task also unsubscribes when the client left before the stream started.
    return EventStreamResponse(_stream(state.bus, sub, max_events, timeout_s),
                               background=BackgroundTask(state.bus.unsubscribe, sub), send_timeout_s=SEND_TIMEOUT_S)


# ---- Admin actions (``POST /v1/flush``); every route here needs the admin token (see ``deps``).
log = logging.getLogger(__name__)

admin_router = APIRouter(tags=["admin"], dependencies=[AdminDep],
                   responses={401: {"model": ErrorBody, "description": "missing or wrong admin token"}})


@admin_router.post("/v1/flush", response_model=FlushResponse,
             responses={501: {"model": ErrorBody, "description": "the L3 backend cannot list its objects"}},
             summary="Drop cached pages from L2 (unlocked pages), L3 (this layout's objects) or both")
def flush(req: FlushRequest, state: StateDep) -> FlushResponse:
    l2 = l3 = None
    if req.tier in ("L2", "all"):
        l2 = state.engine.flush_l2()
    if req.tier in ("L3", "all") and state.storage is not None:
        st = state.storage
        with state.flush_lock:
            # Names of what is removed are only known to the backend, so L3
            # removals are counted here and not published as events.
            l3 = st.clear()
            if l3 is None:
                raise HTTPException(status.HTTP_501_NOT_IMPLEMENTED,
                                    detail=f"L3 backend {st.name} cannot list its objects, so it cannot be flushed")
            state.l3_flushed += l3
    log.info("flushed %s: L2 %s pages, L3 %s pages", req.tier, l2, l3)
    return FlushResponse(L2=l2, L3=l3)


ROUTERS = (health_router, stats_router, lookup_router, events_router, admin_router)
