"""``/healthz`` (the process answers) and ``/readyz`` (engine socket and L3 reachable)."""
from __future__ import annotations

from concurrent.futures import TimeoutError as FutureTimeout

from fastapi import APIRouter, Response, status

from hicache.api.deps import StateDep
from hicache.api.models import Health, L3Readiness, Readiness
from hicache.api.redact import redact_url
from hicache.core.errors import ServiceError

router = APIRouter(tags=["health"])


@router.get("/healthz", response_model=Health, summary="Liveness: the process answers")
def healthz() -> Health:
    return Health()


@router.get("/readyz", response_model=Readiness, summary="Readiness: engine socket serving and L3 reachable",
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
