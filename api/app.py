"""Builds the REST app from a ``RestState`` (see ``hicache.api.deps``).

No module-global state: everything the routes need hangs off ``app.state``
(``rest``: the ``RestState``; ``registry``: its Prometheus registry). The
lifespan samples byte counters once a second so bandwidth figures are fresh
between scrapes, and closes the event bus on shutdown so streams end.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import AsyncIterator

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError

from hicache.api import routes_admin, routes_events, routes_health, routes_lookup, routes_stats
from hicache.api.deps import RestState, check_bind
from hicache.api.metrics import build_registry
from hicache.api.rest_guards import BodyLimit, validation_error
from hicache.api.stats import collect

log = logging.getLogger(__name__)

SAMPLE_INTERVAL_S = 1.0


async def _sample_forever(state: RestState) -> None:
    while True:
        await asyncio.sleep(SAMPLE_INTERVAL_S)
        try:
            await asyncio.to_thread(collect, state)
        except (AssertionError, RuntimeError, TimeoutError) as e:  # engine stopping; try again later
            log.debug("stats sample skipped: %s", e)


def create_app(state: RestState) -> FastAPI:
    """A FastAPI app serving ``state``. Raises ``ConfigError`` if the bind needs a token and has none."""
    check_bind(state.config.service.host, state.admin_token)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        task = asyncio.create_task(_sample_forever(state))
        try:
            yield
        finally:
            task.cancel()
            state.bus.close()

    app = FastAPI(title="hicache", summary="Tiered KV cache: statistics, lookup, events, admin",
                  version="1", lifespan=lifespan)
    app.state.rest = state
    app.state.registry = build_registry(state)
    for r in (routes_health, routes_stats, routes_lookup, routes_events, routes_admin):
        app.include_router(r.router)
    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_middleware(BodyLimit, max_bytes=state.config.service.max_request_bytes)
    return app
