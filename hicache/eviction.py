"""Eviction policies, chosen by name, and the loop that applies one.

A policy only orders candidates: ``key(node)`` returns a tuple, smallest is
evicted first. Ties end on ``node.nid`` (creation order), so the order is
deterministic — every CP rank evicts the same nodes given the same history.
The tree decides what a candidate is and what evicting one means
(``RadixTree.evict_device`` / ``evict_host``).
"""
from __future__ import annotations

import heapq
from types import MappingProxyType
from typing import Callable, Iterable, Mapping, Protocol, TypeVar


class EvictionPolicy(Protocol):
    name: str

    def key(self, node) -> tuple:
        """Sort key of a candidate; the smallest is evicted first. Must not mutate."""


class LRU:
    """Least recently used first (``last_access`` is the tree's logical clock)."""

    name = "lru"

    def key(self, node) -> tuple:
        return (node.last_access, node.nid)


class LFU:
    """Fewest hits first, least recently used among equals."""

    name = "lfu"

    def key(self, node) -> tuple:
        return (node.hit_count, node.last_access, node.nid)


class FIFO:
    """Oldest node first (creation order), whatever its use."""

    name = "fifo"

    def key(self, node) -> tuple:
        return (node.nid,)


POLICIES: Mapping[str, type] = MappingProxyType({"lru": LRU, "lfu": LFU, "fifo": FIFO})


def make_policy(spec: "str | EvictionPolicy") -> EvictionPolicy:
    """A policy from a name in ``POLICIES`` or an object with ``key(node)``."""
    if isinstance(spec, str):
        try:
            return POLICIES[spec]()
        except KeyError:
            raise ValueError(f"unknown eviction policy {spec!r}; known: {sorted(POLICIES)}") from None
    if not callable(getattr(spec, "key", None)):
        raise TypeError(f"eviction policy {spec!r} needs a key(node) method")
    return spec


N = TypeVar("N")


def run_eviction(candidates: Iterable[N], policy: EvictionPolicy, num_pages: int,
                 evict_one: Callable[[N], tuple[int, N | None]]) -> int:
    """Evict candidates in policy order until ``num_pages`` logical pages are freed.

    ``evict_one(node)`` evicts a node and returns ``(pages freed, new candidate
    or None)`` (the parent may become a candidate). Returns the pages freed,
    which is less than asked only when candidates run out.
    """
    key = policy.key
    heap = [(key(n), n.nid, n) for n in candidates]
    heapq.heapify(heap)
    freed = 0
    while freed < num_pages and heap:
        _, _, node = heapq.heappop(heap)
        got, nxt = evict_one(node)
        freed += got
        if nxt is not None:
            heapq.heappush(heap, (key(nxt), nxt.nid, nxt))
    return freed
