"""``hicache+unix:///abs/path/to.sock``: the node-local service as an engine's L3.

What ``open_storage`` returns for the service's URL: an engine that keeps its
own host tier (the vLLM and SGLang connectors) shares pages with every other
engine of the node through the service's L2 (a shared-memory segment), and
through whatever L3 the service persists to. (An embedded ``HiCache`` given
this URL does not open it: the segment becomes its L2, ``hicache.tiers.l2.shared``.
Both go through the one client, ``hicache.client.link``.)
"""
from __future__ import annotations

import logging
import threading
from typing import ClassVar, Sequence

from hicache.client.link import SCHEME, SOCKET_SLACK_S, ServiceClient, socket_path_of
from hicache.core.errors import ConfigError, ContractMismatch, IntegrityError, OutOfPages, PoolError, ServiceError
from hicache.core.redact import redact_url
from hicache.core.layout import KVLayout
from hicache.storage.base import StorageBackend
from hicache.storage.health import DOWN
from hicache.storage.capacity import StorageOptions
from hicache.storage.into import PutBatch, PutItem
from hicache.storage.codec import Buffer, as_bytes_view

log = logging.getLogger(__name__)

class _Unreachable(OSError):
    """The service cannot be reached (down, restarting, hung, or refusing us after a restart)."""


class ServiceBackend(StorageBackend):
    """L3 slot backed by the node's hicache service. Thread-safe: one client,
    one request in flight (calls from several threads take turns).

    * ``put``: ``reserve`` + copy payloads into the segment + ``commit`` under
      the page hashes (the service writes them behind to its own L3);
    * ``get``: ``acquire`` + copy out + ``release``; a page evicted meanwhile is
      a miss, never wrong bytes (acquired pages cannot be evicted);
    * ``prefix_hits``: ``fetch`` (a lookup that first loads what the service's
      L2 lacks from its L3, within a bounded wait).

    The service answers prefixes: ``get``/``exists`` treat every key after the
    first absent one as absent. Pages carry no L3 object header here: the
    service's handshake checks the whole layout (fingerprint included) on every
    (re)connect, and it hands out only committed pages.

    Failure model (as ``StorageBackend``): a service that is down, restarting or
    hung turns calls into misses and dropped writes with one warning per outage;
    the backend reconnects on a later call (probes spaced by the base's
    backoff). A layout the service refuses raises ``ContractMismatch`` when the
    backend is opened; if a restarted service refuses it later, that is logged
    as an error and treated as an outage. Not-connecting at open is not an
    error: the service may start after the engine.
    """

    scheme = SCHEME
    OUTAGE_ERRORS: ClassVar[tuple[type[BaseException], ...]] = (OSError,)
    # A refusal of one call (e.g. L2 full of locked pages): the call fails, the connection stays.
    CALL_ERRORS: ClassVar[tuple[type[BaseException], ...]] = (ServiceError, OutOfPages)

    def __init__(self, options: StorageOptions, socket_path: str, *, name: str = ""):
        super().__init__(options, name or f"{SCHEME}://{socket_path}")
        if options.layout is None:
            raise ConfigError(f"storage url {self.name!r}: the service needs the whole KVLayout for its "
                              "handshake; open it with open_storage(url, fingerprint=..., layout=layout)")
        self.layout: KVLayout = options.layout
        self.socket_path = socket_path
        self.wait_ms = options.timeout_ms * (1 + options.max_retries)  # how long fetch may wait for L3
        self._sizes = [p.page_bytes for p in self.layout.planes]
        self._last_sizes: object = None  # the last plane-sizes object that matched
        self._io = threading.Lock()  # one request in flight on the client
        self._client: ServiceClient | None = None
        self._opened = False
        self._refused = False  # a restarted service refused our layout (logged once until it accepts)
        # Connect now so that a layout mismatch fails here, loudly; an
        # unreachable service only starts an outage (one warning).
        self._call("connect", self._connect_now, probe=True)
        self._opened = True

    @classmethod
    def from_url(cls, url: str, options: StorageOptions) -> "ServiceBackend":
        return cls(options, socket_path_of(url), name=redact_url(url))

    # ------------------------------------------------------------- connection
    def _connect_now(self) -> bool:
        with self._io:
            self._ensure_client()
        return True

    def _ensure_client(self) -> ServiceClient:
        if self._client is not None:
            return self._client
        try:
            # pin=False: pages are copied by the CPU here, never addressed by GPU kernels.
            self._client = ServiceClient(self.socket_path, self.layout, timeout=self.wait_ms / 1000 + SOCKET_SLACK_S,
                                        pin=False)
        except ContractMismatch as e:
            if not self._opened:
                raise  # a configuration error: fail at open time
            if not self._refused:
                self._refused = True
                log.error("L3 %s: the restarted service refuses this engine's layout: %s", self.name, e)
            raise _Unreachable(f"layout refused: {e}") from None
        except ServiceError as e:
            if not self._opened or e.kind != "closed":
                raise
            raise _Unreachable(str(e)) from None
        except (OSError, PoolError) as e:  # no socket / refused / segment gone mid-restart
            raise _Unreachable(f"{type(e).__name__}: {e}") from None
        self._refused = False
        return self._client

    def _io_call(self, fn):
        """Run ``fn(client)`` on a connected client; ``_Unreachable`` when the connection is lost."""
        with self._io:
            c = self._ensure_client()
            try:
                return fn(c)
            except ServiceError as e:
                if e.kind != "closed":
                    raise
                self._drop_client()
                raise _Unreachable(str(e)) from None
            except OSError:
                self._drop_client()
                raise

    def _drop_client(self) -> None:
        c, self._client = self._client, None
        if c is not None:
            c.close(send_bye=False)

    # ------------------------------------------------------------- primitives
    def _full(self, key: bytes) -> bytes:
        super()._full(key)  # validates
        return key  # the service keys pages by hash; its handshake separates layouts

    def _raw_get(self, keys: list[bytes]) -> list[Buffer | None]:
        def read(c: ServiceClient) -> list[Buffer | None]:
            pages = c.acquire(keys, need_draft=True)  # L3 semantics: complete pages only
            try:
                data: list[Buffer | None] = [c.pool.read_page(p) for p in pages]
            finally:
                c.release(keys[:len(pages)])
            return data + [None] * (len(keys) - len(pages))
        return self._io_call(read)

    def _raw_put(self, items: PutBatch) -> list[bool | BaseException]:
        raise AssertionError("ServiceBackend.put writes payloads without L3 headers; see _put_pages")

    def _put_pages(self, rows: list[tuple[bytes, memoryview]]) -> int:
        def write(c: ServiceClient) -> int:
            pages = c.reserve(len(rows))
            try:
                for p, (_, payload) in zip(pages, rows):
                    c.pool.write_page(p, payload)
                # The controller stores complete pages only (draft rows included).
                r = c.commit([k for k, _ in rows], pages, draft_pages=len(rows))
            except ServiceError as e:
                if e.kind != "closed":
                    c.cancel(pages)  # the connection is fine: give the pages back now
                raise
            except BaseException:
                # e.g. a payload that does not fit: the connection is fine, so give
                # the pages back rather than hold them for the connection's life.
                c.cancel(pages)
                raise
            return r.inserted + r.duplicates
        return self._io_call(write)

    def _raw_exists(self, keys: list[bytes]) -> list[bool]:
        n = self._io_call(lambda c: c.lookup(keys, need_draft=True).num_pages)
        return [i < n for i in range(len(keys))]

    def _fetch(self, keys: list[bytes], wait_ms: float) -> int:
        return self._io_call(lambda c: c.fetch(keys, wait_ms, need_draft=True).num_pages)

    def _raw_delete(self, keys: list[bytes]) -> int:
        self._warnings.once("delete", "L3 %s: the service does not delete pages for engines (they age out "
                            "of its L2 by LRU; flush with POST /v1/flush)", self.name)
        return 0

    def _raw_ping(self) -> bool:
        self._io_call(lambda c: c.stats())
        return True

    def _raw_close(self) -> None:
        with self._io:
            c, self._client = self._client, None
        if c is not None:
            c.close()

    # ------------------------------------------------------------ public API
    def get(self, keys: Sequence[bytes], plane_sizes: Sequence[int]) -> list[memoryview | None]:
        """Payloads of the leading ``keys`` the service holds (``None`` from the
        first miss on). The memoryviews are copies the caller owns."""
        self._check_sizes(plane_sizes)
        keys = [self._full(k) for k in keys]
        if not keys:
            return []
        raw = self._call("get", self._raw_get, keys)
        if raw is DOWN:
            self._count(gets=len(keys), misses=len(keys))
            return [None] * len(keys)
        out = [None if b is None else memoryview(b).toreadonly() for b in raw]
        hits = sum(b is not None for b in out)
        self._count(gets=len(keys), hits=hits, misses=len(keys) - hits,
                    bytes_read=sum(b.nbytes for b in out if b is not None))
        return out

    def put(self, items: Sequence[PutItem]) -> int:
        """Write pages into the service's L2 and commit them; returns how many are
        there now (pages another engine committed first count as stored)."""
        rows = []
        for key, payload, sizes in items:
            self._check_sizes(sizes)
            mv = as_bytes_view(payload)
            if mv.nbytes != self.layout.page_bytes:
                raise ValueError(f"L3 put: payload of {mv.nbytes} bytes, a page of layout "
                                 f"{self.layout.model_id!r} holds {self.layout.page_bytes}")
            rows.append((self._full(key), mv))
        if not rows:
            return 0
        res = self._call("put", self._put_pages, rows)
        stored = 0 if res is DOWN else int(res)
        self._count(put_ok=stored, put_dropped=len(rows) - stored, bytes_written=stored * self.layout.page_bytes)
        return stored

    def prefix_hits(self, keys: Sequence[bytes], budget_s: float | None = None) -> int:
        """Leading ``keys`` in the service's L2 after it loads what it can from its
        own L3, waiting up to ``timeout_ms * (1 + max_retries)`` or ``budget_s``,
        whichever is shorter (pages it loads later land in its L2). One round trip."""
        keys = [self._full(k) for k in keys]
        if not keys:
            return 0
        wait_ms = self.wait_ms if budget_s is None else min(self.wait_ms, max(0.0, budget_s) * 1000)
        res = self._call("fetch", self._fetch, keys, wait_ms)
        return 0 if res is DOWN else int(res)

    def clear(self) -> int | None:
        """The service's pages are shared by every engine: not cleared from here (None)."""
        return None

    def check_integrity(self) -> None:
        """Counters agree, and (when the service is reachable) its own
        ``check_integrity`` passes. Raises ``IntegrityError``."""
        self.stats().check()
        with self._lock:
            closed = self._closed
        if closed or self.down:
            return
        try:
            self._io_call(lambda c: c.check_integrity())
        except OSError:
            return  # unreachable now: the next call starts the outage
        except ServiceError as e:
            raise IntegrityError(f"L3 {self.name}: the service's integrity check failed: {e.detail}") from None

    def _check_sizes(self, plane_sizes: Sequence[int]) -> None:
        if plane_sizes is self._last_sizes:  # callers pass one list for a whole batch
            return
        if list(plane_sizes) != self._sizes:
            raise ValueError(f"L3 {self.name}: plane sizes {list(plane_sizes)[:4]}... do not match layout "
                             f"{self.layout.model_id!r} ({len(self._sizes)} planes, {self.layout.page_bytes} "
                             "bytes a page)")
        self._last_sizes = plane_sizes
