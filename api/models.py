"""Pydantic models of the REST API: every route's request and response body.

Sizes are pages and bytes; token counts are ``pages * page_size``. The service
indexes whole pages only, so a hit's exact token count and its
scheduler-visible (page-floored) count are equal here; both are reported so
that the schema matches the embedded cache's statistics, where a request's
private partial page makes them differ.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints

Tier = Literal["L2", "L3"]

# Bounds on one lookup, so one request cannot pin the service: 1M tokens
# (64K pages of 16) or 64K hashes.
MAX_LOOKUP_TOKENS = 1 << 20
MAX_LOOKUP_HASHES = 1 << 16


class _Out(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Health(_Out):
    status: Literal["ok"] = "ok"


class L3Readiness(_Out):
    configured: bool
    url: str  # password redacted; "" when no L3 is configured
    reachable: bool


class Readiness(_Out):
    ready: bool  # engine socket serving and (no L3 configured or L3 answers)
    engine: bool
    l3: L3Readiness


class L3WriteReadStats(_Out):
    """L3 only: the service's write-behind of committed pages and its read-through
    (``fetch``), in pages since start."""

    queued: int  # committed pages handed to the L3 writer
    written: int  # stored in L3
    dropped: int  # not queued: the writer's queue was full
    stale: int  # evicted from L2 before the writer copied them
    failed: int  # L3 did not store them (down, or a per-page error)
    queue_pages: int  # waiting for the writer now
    fetches: int  # engine fetches that asked L3
    fetched: int  # pages loaded from L3 into L2
    fetch_timeouts: int  # fetches answered before their load finished (it lands later)
    fetch_busy: int  # fetches answered from L2 only: too many loads in flight
    fetch_no_room: int  # pages L3 held that L2 had no room for
    skipped_draft: int  # committed without valid draft rows: never written to L3


class TierStats(_Out):
    """Counters since start for one tier (``None``: the tier cannot know it)."""

    tier: Tier
    configured: bool
    capacity_pages: int | None
    capacity_bytes: int | None
    used_pages: int | None
    used_bytes: int | None
    lookups: int  # L2: engine lookup calls; L3: pages asked for by get()
    hit_pages: int
    miss_pages: int
    hit_tokens_exact: int
    hit_tokens_visible: int  # floored to a page boundary
    evictions: int
    flushed: int  # pages dropped by POST /v1/flush
    bytes_read: int  # L2: pages acquired by engines; L3: verified payload bytes returned
    bytes_written: int  # L2: pages committed by engines; L3: payload bytes stored
    read_bytes_per_s: float  # over the last few seconds
    write_bytes_per_s: float
    errors: int
    errors_by_kind: dict[str, int]
    down: bool = False  # L3 only: an outage is in progress
    service: L3WriteReadStats | None = None  # L3 only: what the service moved between L2 and L3


class EngineStats(_Out):
    clients: int  # connected engines
    clients_total: int
    reserved_pages: int
    locked_pages: int
    duplicates: int
    reclaimed: int
    draft_cut_pages: int  # present pages need_draft lookups did not return (draft rows missing)
    draft_upgraded: int  # draft-incomplete shared pages replaced by a complete copy
    segment_origin: str  # the L2 segment was "created", "adopted" (after a crash) or "recreated"


class EventStats(_Out):
    subscribers: int
    published: int
    dropped: int  # events not delivered because a subscriber's queue was full


class StatsResponse(_Out):
    fingerprint: str
    page_size: int
    page_bytes: int
    uptime_s: float
    tiers: dict[Tier, TierStats]
    engine: EngineStats
    events: EventStats


HexHash = Annotated[str, StringConstraints(pattern=r"^[0-9a-fA-F]{32}$")]
TokenId = Annotated[int, Field(ge=0, lt=2**32)]


class LookupByTokens(BaseModel):
    """A prompt's token ids; hashed into pages with ``namespace`` (LoRA adapter, cache salt)."""

    model_config = ConfigDict(extra="forbid")

    tokens: list[TokenId] = Field(max_length=MAX_LOOKUP_TOKENS)
    namespace: str = Field("", max_length=1024)
    include_l3: bool = True  # L3 costs a round trip; routers on a hot path may skip it


class LookupByHashes(BaseModel):
    """Chained page hashes (``hicache.hashing.page_hashes``) as 32 hex characters each."""

    model_config = ConfigDict(extra="forbid")

    hashes: list[HexHash] = Field(max_length=MAX_LOOKUP_HASHES)
    include_l3: bool = True


LookupRequest = LookupByTokens | LookupByHashes


class TierHit(_Out):
    pages: int
    tokens: int


class LookupResponse(_Out):
    """L2's leading hit, then L3's hit continuing it; ``total`` is their sum."""

    page_size: int
    query_pages: int  # whole pages in the query (a trailing partial page is never cached)
    L2: TierHit
    L3: TierHit | None  # None when include_l3 is false or no L3 is configured
    total: TierHit
    hit_tokens_exact: int
    hit_tokens_visible: int


class PageEvent(_Out):
    """One Server-Sent Event's ``data`` on ``/v1/events``."""

    seq: int  # per service, increasing; a gap means this subscriber dropped events
    type: Literal["stored", "removed"]
    tier: Tier
    page_hash: str  # hex
    parent_hash: str | None  # hex; None when unknown (first page of a commit) or for removals
    dropped: int  # events this subscriber has missed so far (queue full)


class FlushRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    tier: Literal["L2", "L3", "all"]


class FlushResponse(_Out):
    """Pages removed per tier; None where the tier was not flushed or is not configured."""

    L2: int | None
    L3: int | None


class ConfigResponse(_Out):
    config: dict[str, Any]  # the resolved configuration, secrets redacted
    fingerprint: str
    layout: dict[str, Any]
    page_bytes: int


class ErrorBody(_Out):
    detail: str
