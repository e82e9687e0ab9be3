"""``POST /v1/lookup``: per-tier prefix hit of a prompt, for cache-aware routers.

Read-only: it neither refreshes L2 recency nor counts as an engine lookup,
so a router polling several nodes does not distort their eviction order or
hit statistics.
"""
from __future__ import annotations

from fastapi import APIRouter, HTTPException, Request, status

from hicache.api.deps import StateDep
from hicache.api.lookup_fast import parsed_tokens
from hicache.api.models import LookupByTokens, LookupRequest, LookupResponse, TierHit
from hicache.core.hashing import page_hashes
from hicache.core.types import PageHash

router = APIRouter(tags=["lookup"])


@router.post("/v1/lookup", response_model=LookupResponse,
             summary="Leading pages of a token list (or page hashes) held by L2, then by L3")
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
    l2 = state.engine.peek_l2(hashes)
    l3: int | None = None
    if req.include_l3 and state.storage is not None:
        l3 = state.storage.prefix_hits(hashes[l2:])
    total = l2 + (l3 or 0)
    return LookupResponse(
        page_size=ps, query_pages=len(hashes), L2=TierHit(pages=l2, tokens=l2 * ps),
        L3=None if l3 is None else TierHit(pages=l3, tokens=l3 * ps),
        total=TierHit(pages=total, tokens=total * ps),
        hit_tokens_exact=total * ps, hit_tokens_visible=total * ps)
