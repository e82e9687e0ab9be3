"""``/v1/stats`` (JSON), ``/metrics`` (Prometheus text) and ``/v1/config``."""
from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from hicache.api.deps import AdminDep, StateDep
from hicache.api.metrics import render
from hicache.api.models import ConfigResponse, StatsResponse
from hicache.api.redact import redacted_config
from hicache.api.stats import collect

router = APIRouter(tags=["stats"])

PROMETHEUS_TEXT = "text/plain; version=0.0.4; charset=utf-8"


class PrometheusResponse(Response):
    media_type = PROMETHEUS_TEXT


@router.get("/v1/stats", response_model=StatsResponse, summary="Per-tier statistics since start")
def stats(state: StateDep) -> StatsResponse:
    return collect(state)


@router.get("/metrics", response_model=str, response_class=PrometheusResponse,
            summary="Prometheus metrics (text exposition format)")
def metrics(request: Request) -> Response:
    return PrometheusResponse(render(request.app.state.registry))


@router.get("/v1/config", response_model=ConfigResponse, dependencies=[AdminDep], summary="Resolved configuration (secrets redacted)")
def config(state: StateDep) -> ConfigResponse:
    layout = state.layout
    return ConfigResponse(config=redacted_config(state.config, bool(state.admin_token)), fingerprint=layout.fingerprint(),
                          layout=layout.to_dict(), page_bytes=layout.page_bytes)
