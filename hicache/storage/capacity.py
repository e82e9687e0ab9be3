"""Bounded L3: the byte cap (``storage.max_bytes``), its default, the L3 eviction
policies, and ``StorageUsage`` (what a backend holds now).

L3 eviction orders stored objects, not tree nodes: ``lru`` (least recently read or
written first; a hit refreshes the object) and ``fifo`` (oldest write first; reads
stay read-only). Frequency-based policies would need per-object counters that a
shared directory cannot keep cheaply across processes.

The default cap (``max_bytes = "auto"``) is ``min(20 GiB, 10% of the file system)``
for ``file://`` and ``min(20 GiB, 10% of physical memory)`` for ``memory://``: the
default L3 lives in the per-user cache directory, which the cache must never fill.
An operator with a disk for L3 sets ``storage.max_bytes``. Redis is bounded by its
own ``maxmemory`` (see ``RedisBackend.usage``).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
import os
from pathlib import Path
from urllib.parse import unquote, urlsplit
from typing import Any, ClassVar, Literal, NamedTuple

from hicache.core.errors import ConfigError
from hicache.core.config import host_memory, parse_size  # noqa: F401  (parse_size re-exported)
from hicache.core.layout import KVLayout
from hicache.storage import codec


L3Eviction = Literal["lru", "fifo"]
L3_EVICTION: tuple[str, ...] = ("lru", "fifo")

DEFAULT_CAP_BYTES = 20 << 30
DEFAULT_CAP_FRACTION = 0.10
# A trim deletes down to this fraction of the cap, so the scan it costs is paid
# once per ~10% of the cap written, not on every put past the cap.
TRIM_TO = 0.90

def _filesystem_bytes(path: Path) -> int | None:
    """Total size of the file system holding ``path`` (or its nearest existing parent)."""
    p = path.absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    try:
        st = os.statvfs(p)
    except OSError:
        return None
    return st.f_blocks * st.f_frsize


def default_cap(url: str) -> int:
    """The ``auto`` cap of ``url`` in bytes (0: unbounded, for schemes that bound themselves)."""
    scheme = url.partition("://")[0].lower()
    if scheme == "file":
        # the directory's file system; hicache.storage.file parses the URL fully when it
        # opens it (importing it here would climb the layering: it imports this module)
        total = _filesystem_bytes(Path(unquote(urlsplit(url).path) or "."))
    elif scheme == "memory":
        have = host_memory()  # the RAM, or the container's limit where lower
        total = have[0] if have else None
    else:
        return 0
    if total is None:
        return DEFAULT_CAP_BYTES
    return min(DEFAULT_CAP_BYTES, int(total * DEFAULT_CAP_FRACTION))


def backend_options(storage: Any, url: str | None = None) -> dict[str, Any]:
    """The ``open_storage`` keywords that ``storage.max_bytes`` / ``storage.eviction``
    mean for ``url`` (default ``storage.url``; ``storage`` is a
    ``hicache.core.config.StorageConfig``, not imported: the config sits above this module): ``max_bytes`` and ``eviction`` for
    ``file://`` and ``memory://``, nothing for the others.

    Raises ``ConfigError`` when a cap is set explicitly for a store that has
    its own bound (Redis: ``maxmemory``)."""
    url = storage.url if url is None else url
    scheme = url.partition("://")[0].lower()
    if scheme not in ("file", "memory"):
        if storage.max_bytes != "auto" and storage.max_bytes != 0:
            raise ConfigError(f"storage.max_bytes={storage.max_bytes!r} applies to file:// and memory:// only; "
                              f"{scheme or 'this'}:// is bounded by the store itself (Redis: set maxmemory "
                              "and maxmemory-policy allkeys-lru); remove storage.max_bytes")
        return {}
    cap = default_cap(url) if storage.max_bytes == "auto" else int(storage.max_bytes)
    group = {"group": storage.file_group} if scheme == "file" and storage.file_group else {}
    return {"max_bytes": cap, "eviction": storage.eviction, **group}


def check_eviction(policy: str, where: str) -> str:
    if policy not in L3_EVICTION:
        raise ConfigError(f"{where} eviction={policy!r}: L3 evicts by one of {', '.join(L3_EVICTION)}")
    return policy


@dataclasses.dataclass(frozen=True, slots=True)
class StorageUsage:
    """What an L3 store holds now (``StorageBackend.usage``).

    ``scope`` says what the figures cover: ``"store"`` (this backend's store:
    a ``file://`` directory, every layout in it; a ``memory://`` store) or
    ``"server"`` (a whole Redis server or cluster, other data included).
    ``exact`` is False where ``used_bytes`` is a running estimate that never
    falls below the true size (the ``file://`` ledger between scans).
    """

    objects: int | None  # objects stored (None: unknown without a scan)
    used_bytes: int  # bytes stored (objects' header + payload; Redis: used_memory)
    max_bytes: int | None  # the cap (None: unbounded)
    policy: str  # eviction policy at the cap ("lru", "fifo"; Redis: its maxmemory-policy)
    scope: Literal["store", "server"] = "store"
    exact: bool = True
    SCOPES: ClassVar[tuple[str, ...]] = ("store", "server")


class PrefixUsage(NamedTuple):
    """One key prefix (one layout fingerprint) of an L3 store, as ``hicache storage du`` lists it."""

    prefix: str  # "hicache:1a2b3c4d:" (the dir hicache-1a2b3c4d on file://)
    objects: int
    bytes: int


# A shorter MAC key is guessable; 16 bytes (e.g. 22 base64 characters) is the floor.
MIN_AUTH_KEY_BYTES = 16


@dataclass(frozen=True, slots=True)
class StorageOptions:
    """What every backend is opened with (see ``open_storage``)."""

    fingerprint: str  # layout fingerprint; written into and checked on every object
    timeout_ms: int = 50  # socket / connect timeout of one attempt
    max_retries: int = 2  # retries of one call (redis-py Retry) before it counts as failed
    key_prefix: bytes = b""  # b"" = b"hicache:" + fingerprint[:8] + b":"
    probe_max_ms: int = 1000  # longest wait between probes while L3 is down
    # The whole layout, for backends that must present it (the node-local
    # service's handshake); object stores need only the fingerprint.
    layout: KVLayout | None = None
    # Secret for the objects' MAC (b"": none); see hicache.storage.codec. repr=False: never printed.
    auth_key: bytes = dataclasses.field(default=b"", repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.fingerprint, str) or len(self.fingerprint) < 8:
            raise ConfigError(f"storage fingerprint={self.fingerprint!r}: pass KVLayout.fingerprint() "
                              "(a string of at least 8 characters)")
        if self.layout is not None and self.layout.fingerprint() != self.fingerprint:
            raise ConfigError(f"storage fingerprint={self.fingerprint!r} is not the fingerprint "
                              f"{self.layout.fingerprint()!r} of layout {self.layout.model_id!r}; pass both "
                              "from the same KVLayout")
        for name, low in (("timeout_ms", 1), ("max_retries", 0), ("probe_max_ms", 1)):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < low:
                raise ConfigError(f"storage {name}={v!r}: must be an integer >= {low}")
        prefix = self.key_prefix
        if isinstance(prefix, str):
            prefix = prefix.encode()
        if not isinstance(prefix, bytes):
            raise ConfigError(f"storage key_prefix={prefix!r}: must be str or bytes")
        object.__setattr__(self, "key_prefix", prefix or f"hicache:{self.fingerprint[:8]}:".encode())
        key = self.auth_key.encode() if isinstance(self.auth_key, str) else self.auth_key
        if not isinstance(key, bytes) or (key and len(key) < MIN_AUTH_KEY_BYTES):
            raise ConfigError(f"storage auth_key: must be at least {MIN_AUTH_KEY_BYTES} bytes (or empty for "
                              f"no MAC), got {len(key) if isinstance(key, bytes) else type(key).__name__}")
        object.__setattr__(self, "auth_key", codec.mac_key(key) if key else b"")

    @property
    def timeout_s(self) -> float:
        return self.timeout_ms / 1000.0
