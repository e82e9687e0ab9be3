"""The node's shared L2 as an engine's host tier: one host copy of each page.

In service mode the service's segment *is* L2. ``SharedL2`` wraps an
``ServiceClient``: its ``pool`` is the ``HostPool`` over the mapped segment
(page-locked with ``cudaHostRegister`` when CUDA is present, so the GPU
addresses it directly), and pages move between the engine's L1
(``DevicePool``) and the segment with the page-copy kernels
(``hicache.kernels.page_copy``), never through a private host pool and never
as bytes through the CPU. The service's index says which shared page holds
which hash. Its calls are two-phase, for a ``TransferController`` that
copies in between with ``pool`` as its host pool:

* store: ``begin_store`` (reserve) -> copy L1 -> shared pages -> ``end_store``
  (commit) or ``abort_store`` (the copy failed);
* load: ``begin_load`` (acquire) -> copy shared pages -> L1 -> ``end_load``
  (release), once the copy's completion is observed.

A committed page must hold its bytes and a released page may be evicted and
rewritten, so commit and release wait for the copy to have landed.

A dead engine's reservations and acquisitions are reclaimed by the service
when its connection closes.
"""
from __future__ import annotations

import logging
import time
from typing import Sequence


from hicache.service.client import ServiceClient
from hicache.errors import ConfigError, ContractMismatch, OutOfPages, PoolError, ServiceError
from hicache.kernels.page_copy import PageCopier, default_copier
from hicache.pools import HostPool
from hicache.types import HostPageId, PageHash

log = logging.getLogger(__name__)


class SharedL2:
    """An engine's view of the shared L2. Not thread-safe (one client, one request in flight)."""

    def __init__(self, client: ServiceClient, copier: PageCopier | None = None):
        if client.pool is None:
            raise ValueError("SharedL2 needs a connected ServiceClient (its pool maps the segment)")
        self.client = client
        self.copier = copier or default_copier()
        self.draft = client.layout.draft_layers > 0

    @property
    def pool(self) -> HostPool:
        """The shared pages (valid until the client closes)."""
        assert self.client.pool is not None, "client closed"
        return self.client.pool

    def lookup(self, hashes: Sequence[PageHash], *, need_draft: bool = False) -> int:
        """Leading ``hashes`` the shared L2 holds now (not locked)."""
        return self.client.lookup(hashes, need_draft=need_draft).num_pages

    # ---------------------------------------------------------------- store
    def begin_store(self, n: int) -> list[HostPageId]:
        """Reserve ``n`` shared pages to fill (``OutOfPages`` if the service cannot free them)."""
        return self.client.reserve(n)

    def end_store(self, hashes: Sequence[PageHash], pages: Sequence[int], draft_pages: int | None = None) -> int:
        """Commit filled ``pages`` under ``hashes``; returns how many became lookup-able.
        Call only once the copies into them completed."""
        return self.client.commit(hashes, pages, draft_pages=draft_pages).inserted

    def abort_store(self, pages: Sequence[int]) -> None:
        """Give reserved pages back unfilled (e.g. the backup failed)."""
        self.client.cancel(pages)

    # ----------------------------------------------------------------- load
    def begin_load(self, hashes: Sequence[PageHash], *, need_draft: bool = False) -> list[HostPageId]:
        """Lock the leading present ``hashes``; their shared pages (possibly fewer)."""
        return self.client.acquire(hashes, need_draft=need_draft)

    def end_load(self, hashes: Sequence[PageHash]) -> None:
        """Release what ``begin_load`` returned (``hashes[:len(pages)]``), once copied."""
        self.client.release(hashes)


class ServiceHostTier:
    """The node's shared L2 as ``HiCache``'s host tier (service mode), with the
    failure model of a tier living in another process.

    The service must be up when the engine starts (the segment is mapped then;
    ``ConfigError`` names the socket otherwise). Afterwards a service that goes
    away turns every call into a miss, a dropped backup or a no-op release, with
    one warning per outage; ``reconnect`` maps the restarted service's segment
    (the caller first lets every copy into the old mapping finish). A layout
    the service refuses is ``ContractMismatch`` at start.
    """

    def __init__(self, socket_path: str, layout, *, pin: bool, timeout_s: float, max_wait_s: float = 0.0):
        """``timeout_s``: the socket timeout; ``max_wait_s``: the longest ``fetch`` wait
        for the service's L3 (below ``timeout_s``)."""
        self.socket_path, self.layout, self.max_wait_s = socket_path, layout, max_wait_s
        self._pin, self._timeout = pin, timeout_s
        self.outages = self.reconnects = 0
        self.down = False
        self._down_since = 0.0
        try:
            self.shared = SharedL2(self._connect())
        except ContractMismatch:
            raise
        except (OSError, PoolError, ServiceError) as e:
            raise ConfigError(f"storage.url hicache+unix://{socket_path}: no hicache service answers there "
                              f"({type(e).__name__}: {e}). In service mode the engine's L2 is the service's "
                              "shared segment: start `hicache serve` first (its service.socket_path is this "
                              "path), or set storage.url to another L3 for a private L2") from None

    def _connect(self) -> ServiceClient:
        return ServiceClient(self.socket_path, self.layout, timeout=self._timeout, pin=self._pin)

    @property
    def client(self) -> ServiceClient:
        return self.shared.client

    @property
    def pool(self) -> HostPool:
        return self.shared.pool

    def call(self, fn, *args, default=None, **kw):
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
        old, self.shared = self.shared.client, SharedL2(client, self.shared.copier)
        old.close(send_bye=False)
        self.down = False
        self.reconnects += 1
        return True

    def close(self) -> None:
        self.shared.client.close(send_bye=not self.down)
