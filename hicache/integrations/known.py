"""``KnownSet``: a bounded LRU set of keys, for an adapter's belief about what L3 holds.

An adapter remembers which chunks it stored or found so that lookups of them
need no round trip. L3 evicts by its own policy (Redis ``maxmemory``, a
restart), so the belief is only a hint: loads that miss remove the key, and
the set keeps at most ``cap`` keys, dropping the least recently used.
Not thread-safe: the owner holds its lock around every call.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterable

from hicache.core.errors import ConfigError, IntegrityError

__all__ = ["KnownSet"]


class KnownSet:
    """At most ``cap`` keys; ``touch`` and ``add`` make a key the most recently used."""

    __slots__ = ("cap", "_keys", "evicted")

    def __init__(self, cap: int):
        if not isinstance(cap, int) or isinstance(cap, bool) or cap < 1:
            raise ConfigError(f"known-chunk cap {cap!r}: must be an integer >= 1")
        self.cap = cap
        self._keys: OrderedDict[Hashable, None] = OrderedDict()
        self.evicted = 0  # keys dropped to stay within cap (not those removed by discard)

    def __len__(self) -> int:
        return len(self._keys)

    def touch(self, key: Hashable) -> bool:
        """Whether ``key`` is known; a known key becomes the most recently used."""
        if key not in self._keys:
            return False
        self._keys.move_to_end(key)
        return True

    def __contains__(self, key: Hashable) -> bool:
        """Membership without changing the recency order."""
        return key in self._keys

    def add(self, keys: Iterable[Hashable]) -> None:
        for k in keys:
            self._keys[k] = None
            self._keys.move_to_end(k)
        extra = len(self._keys) - self.cap
        for _ in range(max(0, extra)):
            self._keys.popitem(last=False)
        self.evicted += max(0, extra)

    def discard(self, keys: Iterable[Hashable]) -> None:
        for k in keys:
            self._keys.pop(k, None)

    def check_integrity(self) -> None:
        if len(self._keys) > self.cap or self.evicted < 0:
            raise IntegrityError(f"KnownSet: {len(self._keys)} keys above cap {self.cap} "
                                 f"(evicted {self.evicted})")
