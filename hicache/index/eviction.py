"""Eviction policies: registered classes, chosen by name.

A policy only orders candidates: ``key(node)`` returns a tuple, smallest is
evicted first. Ties end on ``node.nid`` (creation order), so the order is
deterministic — every CP rank evicts the same nodes given the same history.
The eviction index decides what a candidate is (``hicache.index.candidates``) and
the tree what evicting one means.

``monotone`` declares that a node's key never decreases while it is a
candidate (it depends on a clock, a hit count or the creation order). Only
such policies may be served from the persistent lazy heap, whose stale
entries are fixed on pop; any other policy (e.g. ``MRU``, whose key shrinks as
a node is used) is ordered by a fresh scan per call.
"""
from __future__ import annotations

from types import MappingProxyType
from typing import TYPE_CHECKING, Any, ClassVar, Mapping, Protocol, TypeVar

from hicache.core.errors import ConfigError, IntegrityError
from hicache.core.types import EVICTION_POLICIES

if TYPE_CHECKING:
    from hicache.index.node import Node

Key = tuple[Any, ...]  # compared lexicographically; ends on the node's nid


class EvictionPolicy(Protocol):
    name: str
    monotone: bool  # a candidate's key only grows: the lazy heap is exact

    def key(self, node: Node) -> Key:
        """Sort key of a candidate; the smallest is evicted first. Must not mutate."""


_REGISTRY: dict[str, type[EvictionPolicy]] = {}
POLICIES: Mapping[str, type[EvictionPolicy]] = MappingProxyType(_REGISTRY)
P = TypeVar("P", bound=type)


def register_policy(cls: P) -> P:
    """Class decorator: make ``cls`` selectable by its ``name`` (config, ``make_policy``)."""
    if not isinstance(getattr(cls, "name", None), str) or not isinstance(getattr(cls, "monotone", None), bool):
        raise TypeError(f"eviction policy {cls!r} needs a str `name` and a bool `monotone`")
    name: str = getattr(cls, "name")
    if name in _REGISTRY and _REGISTRY[name] is not cls:
        raise ValueError(f"eviction policy name {name!r} is taken by {_REGISTRY[name]!r}")
    _REGISTRY[name] = cls
    return cls


@register_policy
class LRU:
    """Least recently used first (``last_access`` is the tree's logical clock)."""

    name: ClassVar[str] = "lru"
    monotone: ClassVar[bool] = True

    def key(self, node: Node) -> Key:
        return (node.last_access, node.nid)


@register_policy
class LFU:
    """Fewest hits first, least recently used among equals."""

    name: ClassVar[str] = "lfu"
    monotone: ClassVar[bool] = True

    def key(self, node: Node) -> Key:
        return (node.hit_count, node.last_access, node.nid)


@register_policy
class FIFO:
    """Oldest node first (creation order), whatever its use."""

    name: ClassVar[str] = "fifo"
    monotone: ClassVar[bool] = True

    def key(self, node: Node) -> Key:
        return (node.nid,)


@register_policy
class MRU:
    """Most recently used first (scan-resistant for one-off sweeps). Its key
    shrinks as a node is used, so it is never served from the lazy heap."""

    name: ClassVar[str] = "mru"
    monotone: ClassVar[bool] = False

    def key(self, node: Node) -> Key:
        return (-node.last_access, node.nid)


@register_policy
class SLRU:
    """Segmented LRU: nodes hit at least ``protect_hits`` times (the protected
    segment) go only after every probationary node, LRU inside each segment.
    One-hit prefixes (a long unique prompt) cannot flush the shared system
    prompts. Keys only grow (a node moves probationary -> protected)."""

    name: ClassVar[str] = "slru"
    monotone: ClassVar[bool] = True
    protect_hits: ClassVar[int] = 2

    def key(self, node: Node) -> Key:
        return (node.hit_count >= self.protect_hits, node.last_access, node.nid)


@register_policy
class S3FIFO:
    """S3-FIFO's quick demotion (Yang et al., SOSP'23) on the tree: nodes no request
    has hit since they were inserted (one-hit wonders: the tail of a conversation that
    ended) go first, oldest first; nodes hit at least once go after, oldest first.
    Unlike S3-FIFO the segments are unbounded and there is no ghost queue, so nodes
    hit once long ago are never demoted: it beats LRU on short runs (the first 3,000
    Mooncake requests, the built-in synthetic traces) but over the whole Mooncake
    hour its hit rate falls to 18.6% against LRU's 27.6% (bench/RESULTS.md). Keys
    only grow.
    """

    name: ClassVar[str] = "s3fifo"
    monotone: ClassVar[bool] = True

    def key(self, node: Node) -> Key:
        return (node.hit_count >= 1, node.nid)


@register_policy
class QuickDemotionLRU:
    """LRU where a node no request has hit since it was inserted counts as
    ``bonus`` clock ticks older than it is: one-hit wonders (the last turn of a
    conversation that ended, a long unique prompt) go before nodes that proved
    reusable, yet reused nodes still age out, unlike ``s3fifo``. The bonus,
    ~1,500 ticks (a tick is a lock or an insert, 2-3 per request), was swept on
    the Mooncake conversation trace at L1+L2 = 1.1 TiB of llama-3.1-8b: 0 (LRU)
    27.6%, 1,500 28.6%, 3,000 28.5%, 5,000 27.4%, 12,000 23.3%; on the built-in
    synthetic traces with L2 < working set it gains 2-8 points over LRU
    (bench/RESULTS.md). Keys only grow (``last_access`` and ``hit_count`` do)."""

    name: ClassVar[str] = "qd_lru"
    monotone: ClassVar[bool] = True
    bonus: ClassVar[int] = 1500

    def key(self, node: Node) -> Key:
        return (node.last_access + (self.bonus if node.hit_count >= 1 else 0), node.nid)


# The configuration validates names against core's list (core imports nothing of the index).
if sorted(_REGISTRY) != list(EVICTION_POLICIES):
    raise IntegrityError(f"eviction policies registered {sorted(_REGISTRY)} but hicache.core.types."
                         f"EVICTION_POLICIES lists {list(EVICTION_POLICIES)}: keep the two equal")


def make_policy(spec: str | EvictionPolicy) -> EvictionPolicy:
    """A policy from a registered name or an object with ``key(node)`` and ``monotone``.

    Raises ``ConfigError`` for an unknown name, ``TypeError`` for an object
    that is not a policy."""
    if isinstance(spec, str):
        cls = _REGISTRY.get(spec)
        if cls is None:
            raise ConfigError(f"unknown eviction policy {spec!r}; known: {sorted(_REGISTRY)}")
        return cls()
    if not callable(getattr(spec, "key", None)) or not isinstance(getattr(spec, "monotone", None), bool):
        raise TypeError(f"eviction policy {spec!r} needs a key(node) method and a bool `monotone` "
                        "(True only if a node's key never decreases)")
    return spec
