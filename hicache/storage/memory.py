"""``memory://``: an in-process L3 (tests, single-process demos).

Each ``open_storage("memory://")`` gets its own empty store; nothing is shared
through module state. ``max_bytes`` (0 = unbounded) evicts least recently
used objects (``eviction="lru"``, the default) or the oldest written
(``"fifo"``) once the stored bytes exceed it.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Iterator

from hicache.core.errors import ConfigError, IntegrityError
from hicache.core.redact import redact_url
from hicache.storage.base import StorageBackend
from hicache.storage.capacity import StorageOptions
from hicache.storage.into import PutBatch
from hicache.storage.capacity import StorageUsage, check_eviction
from hicache.storage.codec import Buffer


class MemoryBackend(StorageBackend):
    scheme = "memory"
    BOUNDED_LOOKUPS = False  # never blocks

    def __init__(self, options: StorageOptions, *, max_bytes: int = 0, eviction: str = "lru",
                 name: str = "memory://"):
        super().__init__(options, name)
        if not isinstance(max_bytes, int) or max_bytes < 0:
            raise ConfigError(f"memory:// max_bytes={max_bytes!r}: must be an integer >= 0 (0 = unbounded)")
        self.max_bytes = max_bytes
        self.eviction = check_eviction(eviction, "memory://")
        self._objects: OrderedDict[bytes, bytes] = OrderedDict()  # full key -> whole object
        self._nbytes = 0
        self._mu = threading.Lock()

    @classmethod
    def from_url(cls, url: str, options: StorageOptions, **opts) -> "MemoryBackend":
        rest = url.split("://", 1)[1]
        if rest not in ("", "/"):
            raise ConfigError(f"storage url {redact_url(url)!r}: memory:// takes no host or path")
        return cls(options, name=redact_url(url), **opts)

    def _raw_get(self, keys: list[bytes]) -> list[Buffer | None]:
        with self._mu:
            out = []
            for k in keys:
                obj = self._objects.get(k)
                if obj is not None and self.eviction == "lru":
                    self._objects.move_to_end(k)
                out.append(obj)
            return out

    def _raw_put(self, items: PutBatch) -> list[bool]:
        objs = [(k, hdr + p) for k, hdr, p in items]  # the one copy: we must own the bytes
        with self._mu:
            for k, obj in objs:
                old = self._objects.pop(k, None)
                self._nbytes += len(obj) - (len(old) if old is not None else 0)
                self._objects[k] = obj
            evicted = 0
            while self.max_bytes and self._nbytes > self.max_bytes and self._objects:
                _, old = self._objects.popitem(last=False)
                self._nbytes -= len(old)
                evicted += 1
        if evicted:
            self._count(evicted=evicted)
        return [True] * len(items)

    def _raw_exists(self, keys: list[bytes]) -> list[bool]:
        with self._mu:
            return [k in self._objects for k in keys]

    def _raw_delete(self, keys: list[bytes]) -> int:
        n = 0
        with self._mu:
            for k in keys:
                old = self._objects.pop(k, None)
                if old is not None:
                    self._nbytes -= len(old)
                    n += 1
        return n

    def _raw_usage(self) -> StorageUsage:
        with self._mu:
            return StorageUsage(len(self._objects), self._nbytes, self.max_bytes or None, self.eviction)

    def _raw_ping(self) -> bool:
        return True

    def _raw_close(self) -> None:
        with self._mu:
            self._objects.clear()
            self._nbytes = 0

    def _raw_scan(self) -> Iterator[tuple[bytes, Buffer]]:
        with self._mu:
            items = list(self._objects.items())
            total = sum(len(v) for _, v in items)
        if total != self._nbytes:
            raise IntegrityError(f"memory:// byte count {self._nbytes} != {total} bytes stored")
        return iter(items)

    # test hook: corrupt the stored object directly
    def raw_object(self, key: bytes) -> bytes | None:
        """The stored object (header + payload) of a page hash, unverified."""
        with self._mu:
            return self._objects.get(self.key_prefix + key)

    def replace_raw_object(self, key: bytes, obj: bytes) -> None:
        """Overwrite a page's stored object with arbitrary bytes (for corruption tests)."""
        with self._mu:
            fk = self.key_prefix + key
            old = self._objects.get(fk)
            self._nbytes += len(obj) - (len(old) if old is not None else 0)
            self._objects[fk] = obj
