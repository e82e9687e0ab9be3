"""Page events of an engine connector's L2 and L3, keyed by the engine's own block keys.

A router that follows the engine's KV events (vLLM's ``BlockStored`` /
``BlockRemoved`` with a medium) learns from these where a prefix lives below the
GPU. Keys are opaque (vLLM: the request's block hashes), one per page; pages
whose keys the engine did not give produce no events.
"""
from __future__ import annotations

from typing import NamedTuple, Sequence

from hicache.core.types import HostPageId

L2, L3 = "L2", "L3"


class PageEvent(NamedTuple):
    stored: bool  # False: removed
    medium: str  # L2 or L3
    keys: tuple  # the engine's keys of the pages, in order
    parent: object | None = None  # stored: the key of the page before the first (None: none)
    tokens: tuple[int, ...] = ()  # stored: the pages' token ids


class EventLog:
    """Events since the last ``take``, and the key of every indexed L2 page (for removals)."""

    def __init__(self) -> None:
        self._events: list[PageEvent] = []
        self._l2_keys: dict[HostPageId, object] = {}

    def stored(self, medium: str, keys: Sequence, parent, tokens: Sequence[int],
               host: Sequence[HostPageId] = ()) -> None:
        """Pages ``keys`` reached ``medium``; ``host``: their L2 ids (L2 only)."""
        if not keys:
            return
        if medium == L2:
            self._l2_keys.update(zip(host, keys))
        self._events.append(PageEvent(True, medium, tuple(keys), parent, tuple(tokens)))

    def removed_l2(self, freed: Sequence[HostPageId]) -> None:
        keys = tuple(k for k in (self._l2_keys.pop(h, None) for h in freed) if k is not None)
        if keys:
            self._events.append(PageEvent(False, L2, keys))

    def take(self) -> list[PageEvent]:
        out, self._events = self._events, []
        return out

    @property
    def tracked(self) -> int:
        """L2 pages whose keys are known."""
        return len(self._l2_keys)
