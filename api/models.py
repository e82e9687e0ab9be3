"""Pydantic models of the REST API: every route's request and response body.

The statistics models (``StatsResponse`` and the models nested in it) are
generated from the snapshot dataclasses of ``hicache.node.snapshot``,
which declare each figure once with its help text.
"""
from __future__ import annotations

import dataclasses
import types
import typing
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, create_model

from hicache.core.stats import L3TierStats
from hicache.node.snapshot import EngineSnapshot, EventSnapshot, StatsSnapshot, TierSnapshot
from hicache.core.stats import help_of

Tier = Literal["L2", "L3"]

# Bounds on one lookup, so one request cannot pin the service: 1M tokens
# (64K pages of 16) or 64K hashes.
MAX_LOOKUP_TOKENS = 1 << 20
MAX_LOOKUP_HASHES = 1 << 16
# The most JSON items a lookup body can hold and still be valid (the token
# list, plus slack for the other fields): BodyGate refuses more unparsed.
LOOKUP_MAX_ITEMS = max(MAX_LOOKUP_TOKENS, MAX_LOOKUP_HASHES) + 4096  # a namespace may hold commas


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


def model_from_dataclass(cls: type, name: str, names: dict[type, str] | None = None,
                         _made: dict[type, type[BaseModel]] | None = None) -> type[BaseModel]:
    """A pydantic model with ``cls``'s fields, types and help (``description``).

    Nested snapshot dataclasses become models too (named by ``names``, else
    after the dataclass); fields stay in declaration order. This is how every
    statistics model of the REST API is made: the dataclass is the declaration.
    """
    made = {} if _made is None else _made
    if cls in made:
        return made[cls]
    hints = typing.get_type_hints(cls)

    def sub(tp: Any) -> Any:
        if dataclasses.is_dataclass(tp) and isinstance(tp, type):
            return model_from_dataclass(tp, (names or {}).get(tp, tp.__name__), names, made)
        args = typing.get_args(tp)
        if not args:
            return tp
        origin = typing.get_origin(tp)
        new = tuple(sub(a) for a in args)
        if origin is types.UnionType or origin is typing.Union:
            return typing.Union[new]  # noqa: UP007 (built from a tuple)
        if origin is Literal:
            return tp
        return origin[new] if len(new) > 1 else origin[new[0]]

    fields: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        default = ... if f.default is dataclasses.MISSING else f.default
        fields[f.name] = (sub(hints[f.name]), Field(default, description=help_of(f) or None))
    model = create_model(name, __base__=_Out, __doc__=cls.__doc__, **fields)
    made[cls] = model
    return model


_STATS_NAMES: dict[type, str] = {L3TierStats: "L3WriteReadStats", TierSnapshot: "TierStats",
                                 EngineSnapshot: "EngineStats", EventSnapshot: "EventStats"}
_STATS_MODELS: dict[type, type[BaseModel]] = {}
StatsResponse = model_from_dataclass(StatsSnapshot, "StatsResponse", _STATS_NAMES, _STATS_MODELS)
TierStats = _STATS_MODELS[TierSnapshot]
L3WriteReadStats = _STATS_MODELS[L3TierStats]
EngineStats = _STATS_MODELS[EngineSnapshot]
EventStats = _STATS_MODELS[EventSnapshot]


HexHash = Annotated[str, StringConstraints(pattern=r"^[0-9a-fA-F]{32}$")]
TokenId = Annotated[int, Field(ge=0, lt=2**32)]


class LookupByTokens(BaseModel):
    """A prompt's token ids; hashed into pages with ``namespace`` (LoRA adapter, cache salt)."""

    model_config = ConfigDict(extra="forbid")

    tokens: list[TokenId] = Field(max_length=MAX_LOOKUP_TOKENS)
    namespace: str = Field("", max_length=1024)
    include_l3: bool = True  # L3 costs a round trip; routers on a hot path may skip it
    # "peek": only look; "admit": the router sends this request here: its L2 pages are
    # evicted last and its L3 pages start loading into L2 while it waits to be admitted
    intent: Literal["peek", "admit"] = "peek"


class LookupByHashes(BaseModel):
    """Chained page hashes (``hicache.core.hashing.page_hashes``) as 32 hex characters each."""

    model_config = ConfigDict(extra="forbid")

    hashes: list[HexHash] = Field(max_length=MAX_LOOKUP_HASHES)
    include_l3: bool = True
    intent: Literal["peek", "admit"] = "peek"  # as ``LookupByTokens.intent``


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
