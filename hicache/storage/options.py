"""``StorageOptions``: what every L3 backend is opened with, validated once."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from hicache.core.errors import ConfigError
from hicache.core.layout import KVLayout
from hicache.storage import codec

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
