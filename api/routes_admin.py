"""Admin actions (``POST /v1/flush``); every route here needs the admin token (see ``deps``)."""
from __future__ import annotations

import logging

from fastapi import APIRouter, HTTPException, status

from hicache.api.deps import AdminDep, StateDep
from hicache.api.models import ErrorBody, FlushRequest, FlushResponse

log = logging.getLogger(__name__)

router = APIRouter(tags=["admin"], dependencies=[AdminDep],
                   responses={401: {"model": ErrorBody, "description": "missing or wrong admin token"}})


@router.post("/v1/flush", response_model=FlushResponse,
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
