"""Offline baselines of ``--simulate`` over the same page stream as the real runs.

A request of ``n`` tokens may hit at most its first ``(n - 1) // page_size``
pages (the last token is always computed) and, once served, holds its
``n // page_size`` full pages: the rules ``HiCache`` follows. Pages are named
by their chained page hash (``hicache.core.hashing``), numbered densely here.

- ``infinite``: every page any earlier request held is still cached.
- ``belady``: one cache of ``capacity`` pages; when full, the page whose next
  use is furthest in the future goes first (Belady's MIN: no eviction policy
  hits more at this capacity). Ties go to the deeper page, so a page never
  outlives its prefix. It sees one pool of the distinct pages the tiers can
  hold together (``sim_report.distinct_capacity``: ``max(L1, L2)`` when L2
  holds a copy of every L1 page, ``L1 + L2`` when a page may live on one tier).
"""
from __future__ import annotations

import heapq
from typing import Iterable, NamedTuple

import numpy as np

from hicache.core.hashing import namespace_root, raw_page_hashes


class PageStream(NamedTuple):
    """Per request: its full pages' ids, how many it may hit, its prompt tokens."""

    pages: list[np.ndarray]  # int64 page ids of each request's full pages
    caps: list[int]  # pages each request may hit at most
    tokens: list[int]  # prompt tokens of each request
    unique_pages: int  # distinct pages in the whole stream: the working set


def page_stream(requests: Iterable, page_size: int) -> PageStream:
    """Number the pages of ``requests`` (``SimRequest``s) by their chained hash."""
    ids: dict[bytes, int] = {}
    pages, caps, tokens = [], [], []
    for r in requests:
        n = len(r.key) // 4
        hs = raw_page_hashes(r.key, page_size, namespace_root(r.namespace))
        pages.append(np.fromiter((ids.setdefault(h, len(ids)) for h in hs), dtype=np.int64, count=len(hs)))
        caps.append(max(0, n - 1) // page_size)
        tokens.append(n)
    return PageStream(pages, caps, tokens, len(ids))


def _prefix_in(ids: np.ndarray, cap: int, cached) -> int:
    k = 0
    while k < cap and int(ids[k]) in cached:
        k += 1
    return k


def infinite(stream: PageStream, page_size: int) -> int:
    """Hit tokens of an infinite cache."""
    seen: set[int] = set()
    hit = 0
    for ids, cap in zip(stream.pages, stream.caps):
        hit += _prefix_in(ids, cap, seen) * page_size
        seen.update(ids.tolist())
    return hit


def belady(stream: PageStream, page_size: int, capacity: int) -> int:
    """Hit tokens of Belady's MIN over one pool of ``capacity`` pages."""
    if capacity <= 0:
        return 0
    never = len(stream.pages)
    nxt: list[np.ndarray] = [np.empty(0, dtype=np.int64)] * len(stream.pages)
    last: dict[int, int] = {}
    for i in range(len(stream.pages) - 1, -1, -1):  # next use of each page after request i
        ids = stream.pages[i].tolist()
        nxt[i] = np.fromiter((last.get(p, never) for p in ids), dtype=np.int64, count=len(ids))
        for p in ids:
            last[p] = i
    cached: dict[int, int] = {}  # page -> its next use
    heap: list[tuple[int, int, int]] = []  # (-next use, -depth, page); stale entries skipped
    hit = 0
    for i, (ids, cap) in enumerate(zip(stream.pages, stream.caps)):
        hit += _prefix_in(ids, cap, cached) * page_size
        for depth, (p, u) in enumerate(zip(ids.tolist(), nxt[i].tolist())):
            cached[p] = u
            heapq.heappush(heap, (-u, -depth, p))
        while len(cached) > capacity:
            u, _, p = heapq.heappop(heap)
            if cached.get(p) == -u:
                del cached[p]
    return hit
