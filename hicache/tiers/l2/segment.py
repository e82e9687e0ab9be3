"""The connection to the node service's shared segment, with the failure model
of an L2 living in another process (used by ``hicache.tiers.l2.shared``).

The segment is mapped through a ``ServiceClient`` (``hicache.client.link``):
its ``pool`` is the ``HostPool`` over the mapping (page-locked with
``cudaHostRegister`` when CUDA is present, so the page-copy kernels address it
directly). Bytes never go through the socket or the CPU byte path here; the
socket carries the service index's answers (which shared page holds which
hash) and the two-phase calls: ``reserve`` -> copy -> ``commit`` / ``cancel``
for a store, ``acquire`` -> copy -> ``release`` for a load.
"""
from __future__ import annotations

import logging
import time
from typing import Any, Callable

from hicache.core.config import HiCacheConfig
from hicache.core.errors import ConfigError, ContractMismatch, OutOfPages, PoolError, ServiceError
from hicache.core.layout import KVLayout
from hicache.memory.pools import HostPool
from hicache.client.link import SOCKET_SLACK_S, ServiceClient, socket_path_of

log = logging.getLogger(__name__)


class ServiceHostTier:
    """The node's shared segment as an engine's host tier.

    The service must be up when the engine starts (the segment is mapped then;
    ``ConfigError`` names the socket otherwise). Afterwards a service that goes
    away turns every ``call`` into its ``default`` (a miss, a dropped backup or
    a no-op release), with one warning per outage; ``reconnect`` maps the
    restarted service's segment (the caller first lets every copy into the old
    mapping finish). A layout the service refuses is ``ContractMismatch`` at
    start. A dead engine's reservations and acquisitions are reclaimed by the
    service when its connection closes. Not thread-safe.
    """

    def __init__(self, socket_path: str, layout: KVLayout, *, pin: bool, timeout_s: float,
                 max_wait_s: float = 0.0):
        """``timeout_s``: the socket timeout; ``max_wait_s``: the longest ``fetch`` wait
        for the service's L3 (below ``timeout_s``)."""
        self.socket_path, self.layout, self.max_wait_s = socket_path, layout, max_wait_s
        self._pin, self._timeout = pin, timeout_s
        self.outages = self.reconnects = 0
        self.down = False
        self._down_since = 0.0
        try:
            self.client = self._connect()
        except ContractMismatch:
            raise
        except (OSError, PoolError, ServiceError) as e:
            raise ConfigError(f"storage.url hicache+unix://{socket_path}: no hicache service answers there "
                              f"({type(e).__name__}: {e}). In service mode the engine's L2 is the service's "
                              "shared segment: start `hicache serve` first (its service.socket_path is this "
                              "path), or set storage.url to another L3 for a private L2") from None

    @classmethod
    def open(cls, cfg: HiCacheConfig, layout: KVLayout, device: str) -> "ServiceHostTier":
        """Map the segment of the service ``cfg.storage.url`` names (``ConfigError`` if it cannot be)."""
        if layout.cp_size > 1:
            raise ConfigError(f"storage.url {cfg.storage.url!r} with cp_size={layout.cp_size}: the shared L2 "
                              "holds whole pages; context-parallel ranks use a private L2 (another storage.url)")
        wait_s = cfg.storage.timeout_ms * (1 + cfg.storage.max_retries) / 1e3
        wait_s = max(wait_s, cfg.policy.prefetch_timeout_cap_ms / 1e3)
        return cls(socket_path_of(cfg.storage.url), layout, pin=device.startswith("cuda"),
                   max_wait_s=wait_s, timeout_s=wait_s + SOCKET_SLACK_S)

    def _connect(self) -> ServiceClient:
        client = ServiceClient(self.socket_path, self.layout, timeout=self._timeout, pin=self._pin)
        if client.pool is None:
            client.close()
            raise PoolError(f"the service at {self.socket_path} mapped no segment for this engine")
        return client

    @property
    def pool(self) -> HostPool:
        """The shared pages (valid until ``reconnect`` maps a new segment, or ``close``)."""
        pool = self.client.pool
        if pool is None:
            raise ServiceError("closed", f"shared L2 hicache+unix://{self.socket_path}: the connection is closed")
        return pool

    def call(self, fn: Callable[..., Any], *args: Any, default: Any = None, **kw: Any) -> Any:
        """``fn(*args, **kw)``; during an outage (or when it starts one) ``default``.
        ``OutOfPages`` (the service cannot free pages now) is also ``default``."""
        if self.down:
            return default
        try:
            return fn(*args, **kw)
        except OutOfPages:
            return default
        except ServiceError as e:
            if e.kind != "closed":
                raise
            self._outage(e)
        except OSError as e:
            self._outage(e)
        return default

    def _outage(self, e: BaseException) -> None:
        self.down, self._down_since = True, time.monotonic()
        self.outages += 1
        log.warning(
            "shared L2 hicache+unix://%s unreachable (%s: %s): running without it until it is back",
            self.socket_path, type(e).__name__, e)

    def reconnect(self, min_interval_s: float = 1.0) -> bool:
        """After an outage, try (at most every ``min_interval_s``) to map the service's
        segment again; True when reconnected (``pool`` is then a new mapping; the caller
        let every copy into the old one finish, which is unmapped here)."""
        if not self.down or time.monotonic() - self._down_since < min_interval_s:
            return False
        try:
            client = self._connect()
        except Exception:  # still down (or refusing us): try again later
            self._down_since = time.monotonic()
            return False
        old, self.client = self.client, client
        old.close(send_bye=False)
        self.down = False
        self.reconnects += 1
        return True

    def close(self) -> None:
        self.client.close(send_bye=not self.down)
