"""Builds the REST app from a ``RestState`` (see ``hicache.api.deps``).

No module-global state: everything the routes need hangs off ``app.state``
(``rest``: the ``RestState``; ``registry``: its Prometheus registry). The
lifespan samples byte counters once a second so bandwidth figures are fresh
between scrapes, pulls the node service's KV events every ``EVENT_POLL_S``
into the event bus (the service never calls the app), and closes the bus on
shutdown so streams end.
"""
from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import logging
import os
from typing import AsyncIterator

from fastapi import FastAPI
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import HTMLResponse
from fastapi.staticfiles import StaticFiles
from fastapi.exceptions import RequestValidationError

from hicache.api.routes import ROUTERS
from hicache.api.deps import RestState, check_bind
from hicache.api.metrics import build_registry
from hicache.api.models import LOOKUP_MAX_ITEMS
from hicache.api.rest_guards import BodyGate, BodyLimit, validation_error
from hicache.api.stats import collect
from hicache.core.errors import ConfigError, ServiceError

log = logging.getLogger(__name__)

SAMPLE_INTERVAL_S = 1.0
# How often the KV events are pulled from the service: the latency a /v1/events
# reader sees on top of the service's own; one hop onto the service's loop each time.
EVENT_POLL_S = 0.02


async def _sample_forever(state: RestState) -> None:
    while True:
        await asyncio.sleep(SAMPLE_INTERVAL_S)
        try:
            await asyncio.to_thread(collect, state)
        except (ServiceError, RuntimeError, TimeoutError) as e:  # engine stopping; try again later
            log.debug("stats sample skipped: %s", e)


async def pump_events(state: RestState, interval_s: float = EVENT_POLL_S) -> None:
    """Forever: take the service's KV events and publish them to the bus."""
    while True:
        try:
            state.bus.publish(await asyncio.to_thread(state.engine.take_events))
        except (ServiceError, RuntimeError, TimeoutError) as e:  # engine stopping; try again later
            log.debug("event pull skipped: %s", e)
        await asyncio.sleep(interval_s)


def create_app(state: RestState) -> FastAPI:
    """A FastAPI app serving ``state``. Raises ``ConfigError`` if the bind needs a token and has none."""
    check_bind(state.config.service.host, state.admin_token)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        tasks = [asyncio.create_task(_sample_forever(state)), asyncio.create_task(pump_events(state))]
        try:
            yield
        finally:
            for t in tasks:
                t.cancel()
            state.bus.close()

    # docs_url/redoc_url off: FastAPI's own pages load Swagger UI from a CDN
    # and are blank offline; _mount_docs serves the same UI from local files.
    app = FastAPI(title="hicache", summary="Tiered KV cache: statistics, lookup, events, admin",
                  version="1", lifespan=lifespan, docs_url=None, redoc_url=None)
    _mount_docs(app)
    app.state.rest = state
    app.state.registry = build_registry(state)
    for r in ROUTERS:
        app.include_router(r)
    app.add_exception_handler(RequestValidationError, validation_error)
    svc = state.config.service
    # Added last, runs first: BodyLimit refuses oversized bodies, then BodyGate admits the rest.
    app.add_middleware(BodyGate, max_bodies=svc.max_body_requests, max_bytes=svc.max_request_bytes,
                       max_items={"/v1/lookup": LOOKUP_MAX_ITEMS}, read_timeout_s=svc.body_read_timeout_s)
    app.add_middleware(BodyLimit, max_bytes=svc.max_request_bytes)
    return app


DOCS_ASSETS = "/docs/assets"


def swagger_ui_dir() -> str:
    """The Swagger UI dist files (JS, CSS, favicon, license) that the
    ``swagger-ui-py`` package ships; found without importing it."""
    spec = importlib.util.find_spec("swagger_ui")
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError("the swagger-ui-py package (a dependency of hicache) is not installed; "
                          "reinstall hicache or `pip install swagger-ui-py`")
    return os.path.join(next(iter(spec.submodule_search_locations)), "static")


def _mount_docs(app: FastAPI) -> None:
    """``GET /docs``: Swagger UI for the OpenAPI schema, every asset served by this app."""
    app.mount(DOCS_ASSETS, StaticFiles(directory=swagger_ui_dir()), name="docs-assets")

    @app.get("/docs", include_in_schema=False, response_class=HTMLResponse)
    def docs() -> HTMLResponse:
        return get_swagger_ui_html(openapi_url=app.openapi_url or "/openapi.json", title="hicache API",
                                   swagger_js_url=f"{DOCS_ASSETS}/swagger-ui-bundle.js",
                                   swagger_css_url=f"{DOCS_ASSETS}/swagger-ui.css",
                                   swagger_favicon_url=f"{DOCS_ASSETS}/favicon-32x32.png")
