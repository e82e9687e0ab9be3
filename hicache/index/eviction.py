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

from collections import OrderedDict
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, ClassVar, Iterator, Mapping, Protocol, TypeVar

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


class SegmentedPolicy:
    """A policy over ``segments`` classes, each ordered by ``key`` (which only grows
    while a node is a candidate, as for ``monotone``); the victim is the candidate with
    the smallest ``key[0] + offset(segment)``. Exact on lazy heaps (one per segment) as
    long as a candidate's ``key[0] + offset(segment(node))`` never decreases: its
    segment may change only to one whose offset is at least as large, whatever the
    current offsets. ``added`` / ``evicted`` tell it what became a candidate and what
    left the tier (so offsets may learn); they must not change any key."""

    name: ClassVar[str]
    monotone: ClassVar[bool] = True
    segments: ClassVar[int]

    def key(self, node: Node) -> Key:
        return (node.last_access, node.nid)

    def segment(self, node: Node) -> int:
        raise NotImplementedError

    def offset(self, segment: int, applied: bool = True) -> float:
        """The segment's offset now; ``applied=False``: as learnt, before any damping."""
        raise NotImplementedError

    def added(self, node: Node) -> None:
        """``node`` became a candidate (new pages, or back on the tier)."""

    def evicted(self, node: Node) -> None:
        """``node`` left the tier."""

    def touched(self, node: Node) -> None:
        """A request is about to hit ``node``'s path (``node.last_access`` is still the old one)."""

    def compared(self, protected: Node, lru: Node) -> None:
        """At this eviction the offsets, fully applied, would take ``protected``
        where LRU takes ``lru``."""


def depth_class(start_page: int) -> int:
    """0 for pages [0, 2), then one class per doubling of the depth, up to 5 (32 pages on)."""
    return 0 if start_page < 2 else min(5, start_page.bit_length() - 1)


@register_policy
class GhostLRU(SegmentedPolicy):
    """LRU that learns whether deep nodes (``start_page``: a session's later turns,
    whose pages cost more to recompute) or reused nodes (``hit_count >= 1``) should
    outlive their recency. Offset of a node: ``trust * W * (beta_depth * depth_class +
    beta_hit * reused)`` ticks, ``W`` the age of recent victims.

    - betas (ghost lists, ARC's balance): victims' pages are remembered for ``2 W``
      ticks; a page recomputed meanwhile moves each beta by ``step`` times how much
      deeper (more reused) it was than the average victim, within ``[0, 2]``.
    - trust (a duel with LRU): where the learnt offsets and LRU would evict different
      nodes, both are watched; the one used again (hit, or recomputed after eviction)
      is evidence for the side that would have kept it. Trust starts at 0 (LRU
      exactly) and moves by ``trust_step`` a page of evidence, within ``[0, 1]``.

    Measured against LRU on every trace in bench/RESULTS.md: within a
    fraction of a point either way on Mooncake-shaped traces, several points below on
    the built-in medium trace at 32K tokens; not the default. The ghost costs ~250 B
    per remembered page (at most ``max_ghost``)."""

    name: ClassVar[str] = "ghost_lru"
    segments: ClassVar[int] = 12  # depth class (0-5) x reused (0/1)
    step: ClassVar[float] = 0.02
    cap: ClassVar[float] = 2.0
    trust_step: ClassVar[float] = 0.01  # per page of evidence
    max_ghost: ClassVar[int] = 1 << 18  # remembered victim pages at most (~250 B each: ~65 MB)

    def __init__(self) -> None:
        self.beta_depth = self.beta_hit = 0.0
        self.age = 0.0  # EWMA of victims' age in ticks (W)
        self.now = 0  # latest tree clock seen
        self.mean_depth = self.mean_hit = 0.0  # EWMA over victims' pages
        # victims' pages (namespace, first 16 tokens, page index) -> (depth class, reused, tick evicted)
        self.ghost: OrderedDict[tuple[str, bytes, int], tuple[int, int, int, int]] = OrderedDict()
        self.ghost_hits = 0  # pages recomputed while remembered
        # How much of the learnt offsets is applied: 0 (the start) is LRU exactly.
        self.trust = 0.0
        # Nodes where the learnt offsets and LRU disagreed: +1 LRU would evict it, -1 the
        # offsets would; a watched node used again (a hit, or recomputed after eviction)
        # is evidence for the side that would have kept it.
        self.watch: OrderedDict[int, int] = OrderedDict()
        self.gained = self.lost = 0  # pages, for reports

    def segment(self, node: Node) -> int:
        return 2 * depth_class(node.start_page) + (node.hit_count >= 1)

    def offset(self, segment: int, applied: bool = True) -> float:
        full = self.age * (self.beta_depth * (segment >> 1) + self.beta_hit * (segment & 1))
        return self.trust * full if applied else full

    def touched(self, node: Node) -> None:
        self._used(node.nid, node.num_pages)
        for c in node.children.values():  # the hit may end where the lock split a watched leaf
            self._used(c.nid, c.num_pages)

    def _used(self, nid: int, pages: int) -> None:
        tag = self.watch.pop(nid, None)
        if tag is not None:
            self._evidence(tag * pages)

    def _evidence(self, pages: int) -> None:
        """+: LRU would have evicted pages that were used again; -: the offsets would have."""
        if pages > 0:
            self.gained += pages
        else:
            self.lost -= pages
        self.trust = min(1.0, max(0.0, self.trust + self.trust_step * pages))

    def compared(self, protected: Node, lru: Node) -> None:
        w = self.watch
        w[lru.nid], w[protected.nid] = 1, -1
        w.move_to_end(lru.nid)
        w.move_to_end(protected.nid)
        while len(w) > 4096:
            w.popitem(last=False)

    @staticmethod
    def _pages(node: Node) -> Iterator[tuple[str, bytes, int]]:
        pb = len(node.key) // max(1, node.num_pages)
        for j in range(node.num_pages):
            yield (node.namespace, node.key[j * pb:j * pb + 64], node.start_page + j)

    def added(self, node: Node) -> None:
        self.now = max(self.now, node.last_access)
        g = self.ghost
        if not g:
            return
        for pid in self._pages(node):
            got = g.pop(pid, None)
            if got is not None:
                self.ghost_hits += 1
                if got[3]:  # a watched victim came back
                    self._evidence(got[3])
                self.beta_depth = self._nudge(self.beta_depth, got[0] - self.mean_depth)
                self.beta_hit = self._nudge(self.beta_hit, got[1] - self.mean_hit)

    def _nudge(self, beta: float, delta: float) -> float:
        return min(self.cap, max(0.0, beta + self.step * delta))

    def evicted(self, node: Node) -> None:
        d, h = depth_class(node.start_page), int(node.hit_count >= 1)
        self.age += 0.01 * (max(0, self.now - node.last_access) - self.age)
        w = 1.0 - 0.998 ** node.num_pages  # an EWMA over pages, not nodes
        self.mean_depth += w * (d - self.mean_depth)
        self.mean_hit += w * (h - self.mean_hit)
        g = self.ghost
        tag = self.watch.pop(node.nid, 0)  # still watched: its recomputed pages are the evidence
        for pid in self._pages(node):
            g[pid] = (d, h, self.now, tag)
            g.move_to_end(pid)
        horizon = self.now - 2 * self.age  # one cache's worth of victims, twice over
        while g and (next(iter(g.values()))[2] < horizon or len(g) > self.max_ghost):
            g.popitem(last=False)


DEFAULT_POLICY = "lru"
WHY_DEFAULT = ("no other policy was at least LRU's hit rate at every capacity from 0.25M to 20M tokens, GPU-only "
               "and L1+L2, on every trace measured (bench/RESULTS.md)")


def describe_policies(device: str, host: str) -> str:
    """One line for ``hicache info``: the eviction policies in use and why."""
    if device == host == DEFAULT_POLICY:
        return f"{device} on L1 and L2, the default: {WHY_DEFAULT}"
    return f"{device} on L1, {host} on L2, set by policy.device_eviction / policy.host_eviction " \
           f"(the default, {DEFAULT_POLICY}: {WHY_DEFAULT})"


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
