"""One exception tree for hicache.

Boundaries (user input, another process, I/O) raise these with messages that
name the values involved and what to do; internal invariants use ``assert``.
"""
from __future__ import annotations

from typing import Any, Sequence


class HiCacheError(Exception):
    """Base of every error hicache raises on purpose."""


class ConfigError(HiCacheError, ValueError):
    """A configuration value is invalid; the message names the key and the fix."""


class LayoutError(HiCacheError, ValueError):
    """A ``KVLayout`` field is invalid; the message names the field and value.

    ``field`` and ``value`` (when the error is about one field) and ``why``
    let a caller re-word it in its own terms (the configuration does).
    """

    def __init__(self, message: str, field: str | None = None, value: Any = None, why: str = ""):
        self.field = field
        self.value = value
        self.why = why or message
        super().__init__(message)


class ContractMismatch(HiCacheError):
    """Two sides disagree on the KV contract (layout, fingerprint, protocol).

    ``differences`` lists ``(field, ours, theirs)`` for every differing field.
    """

    def __init__(self, what: str, differences: Sequence[tuple[str, Any, Any]]):
        self.differences = list(differences)
        lines = "; ".join(f"{f}: ours={a!r} theirs={b!r}" for f, a, b in self.differences)
        super().__init__(
            f"{what}: refusing to exchange KV, {len(self.differences)} field(s) differ: {lines}"
        )


class PoolError(HiCacheError):
    """Misuse of a page pool or allocator."""


class OutOfPages(PoolError):
    """Not enough free pages; evict first or lower the demand."""


class DoubleFree(PoolError):
    """A page was freed that is not currently allocated."""


class ForeignPage(PoolError):
    """A page id does not belong to this pool."""


class ProvenanceError(HiCacheError, ValueError):
    """Row provenance does not explain the rows handed to a write."""


class InvalidArgument(HiCacheError, ValueError):
    """A call got an argument outside its documented range; the message names the argument and value."""


class StorageError(HiCacheError):
    """An L3 backend failed; callers turn this into a counted miss."""


class IntegrityError(HiCacheError, AssertionError):
    """``check_integrity()`` found a broken invariant."""


class ServiceError(HiCacheError):
    """The local engine service refused a request or the connection failed.

    ``kind`` is the machine-readable reason the service sent in its error frame
    (``bad_frame``, ``unknown_op``, ``bad_args``, ``not_reserved``, ...), or
    ``closed`` when the connection ended.
    """

    def __init__(self, kind: str, message: str):
        self.kind = kind
        self.detail = message
        super().__init__(f"[{kind}] {message}")


class CacheStateError(HiCacheError, RuntimeError):
    """A cache call does not fit the request's or node's current state
    (e.g. ``lock`` on a request that already holds pages, ``alloc`` past its tokens)."""


class StaleMatch(CacheStateError):
    """A ``MatchResult`` was used after an eviction invalidated it; match again."""


class TraceError(HiCacheError, ValueError):
    """A workload trace file is malformed; the message names the line and the field."""


class SlotsExhausted(HiCacheError):
    """Every metadata slot is owned by a live request; back off (never recycle one)."""


class StaleSlot(HiCacheError):
    """A ``SlotView`` was used after its slot was released (its generation moved on)."""


class TransferError(HiCacheError):
    """An L2 -> L1 load failed: the L1 pages it was filling hold unknown bytes,
    so the cache refuses to serve from L1 until it is rebuilt."""
