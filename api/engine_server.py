"""Node-local engine service: an L2 host pool in shared memory, served over a Unix socket.

``EngineServer(config, layout)`` creates the shared segment
(``service.shm_name``, ``pool.host_pages`` pages of ``layout``), binds
``service.socket_path`` and answers engines with length-prefixed msgpack
frames (``hicache.protocol``). Engines copy page bytes in and out of the
segment themselves; the server only decides which page ids hold what.

With an L3 backend (``storage=``; ``storage.url`` when run from the command
line) committed pages are written behind to L3 and ``fetch`` loads L2 misses
back from it, on worker threads (``hicache.service.l3_tier``).

Concurrency: one asyncio event loop owns every piece of state. ``start()``
runs it in a thread (tests, embedding next to a REST app), ``run_forever()``
in the calling thread (the CLI). ``stats()`` and ``check_integrity()`` may be
called from any thread; they run on the loop.

Run it: ``python -m hicache.api.engine_server [--config FILE] [--set k=v ...]``.
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
import signal
import socket
import sys
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence, TypeVar

from hicache.api.engine_ops import Dispatcher
from hicache.config import HiCacheConfig, parse_set_flags
from hicache.errors import ConfigError, HiCacheError, ServiceError
from hicache.layout import KVLayout
from hicache.service.l2_index import L2Index, L2Listener
from hicache.service.l3_tier import L3Tier, StoredPages
from hicache.pools import HostPool
from hicache.protocol import HEADER_BYTES, body_length, pack, unpack
from hicache.shm import SharedSegment
from hicache.storage import StorageBackend, open_storage
from hicache.types import PageHash

log = logging.getLogger(__name__)
T = TypeVar("T")

# Longest path a Unix socket address can hold on Linux (sun_path minus NUL).
MAX_SOCKET_PATH = 107


@dataclass(slots=True)
class ServiceStats:
    """A snapshot of the service, plain values only (``to_dict`` for JSON)."""

    capacity_pages: int
    page_bytes: int
    segment_bytes: int
    used_pages: int  # reserved + committed
    free_pages: int
    committed_pages: int  # lookup-able
    reserved_pages: int  # being written by clients
    locked_pages: int  # committed and acquired by at least one client
    lookups: int
    hits: int  # pages
    misses: int  # pages
    evictions: int
    reservations: int  # pages reserved since start
    commits: int  # pages inserted since start
    acquired: int  # pages locked for reading by clients since start
    flushed: int  # pages dropped by flush_l2() since start
    duplicates: int
    cancelled: int
    reclaimed: int  # reservations and acquisitions taken back from closed connections
    clients: int  # connected and handshaken now
    clients_total: int  # connections accepted since start
    errors: dict[str, int] = field(default_factory=dict)  # refusals by kind
    l3: dict[str, int] = field(default_factory=dict)  # L3TierStats; empty without an L3

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class EngineServer:
    """The service. Build, ``start()`` (or ``run_forever()``), ``stop()``.

    Owns the shared segment and the socket file: both are removed on stop.
    ``listener`` (optional) is told about pages entering and leaving L2, on
    the server's loop thread (see ``L2Listener``). ``storage`` (optional) is
    the node's L3; the server uses it but does not close it. ``on_l3_stored``
    (optional) is told about pages written to L3, from the writer thread.
    """

    def __init__(self, config: HiCacheConfig, layout: KVLayout | None = None,
                 listener: L2Listener | None = None, storage: StorageBackend | None = None,
                 on_l3_stored: Callable[[StoredPages], None] | None = None):
        self.config = config
        self.listener = listener
        self.storage = storage
        self.on_l3_stored = on_l3_stored
        self.layout = layout if layout is not None else config.layout()
        svc = config.service
        self.socket_path = svc.socket_path
        self.shm_name = svc.shm_name
        self.max_request_bytes = svc.max_request_bytes
        self.num_pages = config.pool.host_pages
        if len(os.fsencode(self.socket_path)) > MAX_SOCKET_PATH:
            raise ConfigError(f"service.socket_path={self.socket_path!r} is longer than "
                              f"{MAX_SOCKET_PATH} bytes; choose a shorter path")
        self.segment: SharedSegment | None = None
        self.pool: HostPool | None = None
        self.index: L2Index | None = None
        self.l3: L3Tier | None = None
        self.dispatcher: Dispatcher | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._thread: threading.Thread | None = None  # start()'s thread; None under run_forever()
        self._loop_thread: int | None = None  # ident of the thread running the loop (either way)
        self._next_client = 0
        self._conns: dict[int, asyncio.StreamWriter] = {}

    # -------------------------------------------------------------- lifecycle
    def start(self, timeout: float = 30.0) -> None:
        """Serve in a background thread; returns once the socket accepts."""
        assert self._thread is None, "already started"
        ready = threading.Event()
        failure: list[BaseException] = []

        def run() -> None:
            try:
                asyncio.run(self._main(ready.set))
            except BaseException as e:  # reported to start() below
                failure.append(e)
                ready.set()

        self._thread = threading.Thread(target=run, name="hicache-engine-server", daemon=True)
        self._thread.start()
        if not ready.wait(timeout):
            raise ServiceError("internal", f"engine server did not start within {timeout}s")
        if failure:
            self._thread.join()
            self._thread = None
            raise failure[0]

    def stop(self, timeout: float = 30.0) -> None:
        """Stop serving, disconnect clients, remove the socket and the segment. Idempotent."""
        loop, stop = self._loop, self._stop
        if loop is not None and stop is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(stop.set)
            except RuntimeError:  # loop closed in between
                pass
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)
            self._thread = None

    def run_forever(self) -> None:
        """Serve in this thread until SIGINT/SIGTERM (or ``stop()`` from another thread)."""
        def on_ready() -> None:
            assert self._loop is not None and self._stop is not None
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._loop.add_signal_handler(sig, self._stop.set)
            log.info("serving %d L2 pages (%d bytes) in shm %r on %s", self.num_pages,
                     self.segment.size if self.segment else 0, self.shm_name, self.socket_path)

        asyncio.run(self._main(on_ready))

    async def _main(self, on_ready: Callable[[], None]) -> None:
        self._loop = asyncio.get_running_loop()
        self._loop_thread = threading.get_ident()
        self._stop = asyncio.Event()
        self._remove_stale_socket()
        self._open_state()
        server = None
        try:
            server = await asyncio.start_unix_server(self._serve_client, path=self.socket_path)
            on_ready()
            await self._stop.wait()
        finally:
            if server is not None:
                server.close()
            for w in list(self._conns.values()):
                w.close()
            if server is not None:
                await server.wait_closed()
            await asyncio.sleep(0)  # let connection handlers run their cleanup
            if self.l3 is not None:
                await self.l3.aclose()  # its threads read and write the segment: stop them first
            self._close_state()

    def _open_state(self) -> None:
        size = HostPool.nbytes_for(self.layout, self.num_pages)
        self.segment = SharedSegment.create(self.shm_name, size)
        try:
            self.pool = HostPool(self.layout, self.num_pages, buffer=self.segment.tensor)
            self.index = L2Index(self.pool.allocator, self.listener)
            if self.storage is not None:
                st = self.config.storage
                # A fetch makes two L3 calls (prefix_hits, get), each bounded by
                # timeout_ms per attempt; wait for no longer than both.
                wait_s = 2 * (1 + st.max_retries) * st.timeout_ms / 1000.0
                self.l3 = L3Tier(self.storage, self.index, self.pool, max_wait_s=wait_s,
                                 queue_pages=self.num_pages, on_l3_stored=self.on_l3_stored)
                self.index.listener = _Fanout([x for x in (self.listener, self.l3) if x is not None])
            info = {"shm_name": self.shm_name, "shm_size": size, "num_pages": self.num_pages}
            self.dispatcher = Dispatcher(self.layout, self.index, info, lambda: self._snapshot().to_dict(),
                                         self.l3)
        except BaseException:
            self._close_state()
            raise

    def _close_state(self) -> None:
        self.pool = None  # drop the segment's views before unmapping it
        if self.segment is not None:
            self.segment.close()
        try:
            os.unlink(self.socket_path)
        except FileNotFoundError:
            pass

    def _remove_stale_socket(self) -> None:
        if not os.path.exists(self.socket_path):
            return
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            try:
                s.connect(self.socket_path)
            except (ConnectionRefusedError, FileNotFoundError):
                log.warning("removing stale socket %s", self.socket_path)
                os.unlink(self.socket_path)
                return
        raise ConfigError(f"another server already listens on service.socket_path={self.socket_path!r}; "
                          "stop it or choose another path")

    # ------------------------------------------------------------ connections
    async def _serve_client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        cid = self._next_client
        self._next_client += 1
        self._conns[cid] = writer
        assert self.dispatcher is not None and self.index is not None
        d, registered = self.dispatcher, False
        try:
            while True:
                req = await self._read_request(reader, writer)
                if req is None:
                    break
                if isinstance(req, ServiceError):
                    reply = d.error(req.kind, req.detail)
                elif registered:
                    reply = await d.handle_async(cid, req)
                else:
                    reply = d.hello(cid, req)
                    registered = reply.body["ok"]
                writer.write(pack(reply.body))
                await writer.drain()
                if reply.close:
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass  # the client went away; reclaim below
        finally:
            del self._conns[cid]
            if registered:
                got = self.index.drop_owner(cid)
                if got.reserved or got.acquired:
                    log.info("client %d closed holding %d reserved pages and %d acquisitions; reclaimed",
                             cid, got.reserved, got.acquired)
            writer.close()

    async def _read_request(self, reader: asyncio.StreamReader,
                            writer: asyncio.StreamWriter) -> dict | ServiceError | None:
        """The next request; a ``ServiceError`` to answer; None to hang up (framing lost)."""
        assert self.dispatcher is not None
        header = await reader.readexactly(HEADER_BYTES)
        try:
            n = body_length(header, self.max_request_bytes)
        except ServiceError as e:
            # The stream cannot be resynchronised: answer, then hang up.
            writer.write(pack(self.dispatcher.error(e.kind, e.detail).body))
            await writer.drain()
            return None
        body = await reader.readexactly(n)
        try:
            return unpack(body)
        except ServiceError as e:
            return e

    # ------------------------------------------------------------------ state
    def _on_loop(self, fn: Callable[[], T], timeout: float = 10.0) -> T:
        loop = self._loop
        if loop is None or not loop.is_running() or threading.get_ident() == self._loop_thread:
            return fn()

        async def call() -> T:
            return fn()
        return asyncio.run_coroutine_threadsafe(call(), loop).result(timeout)

    def stats(self) -> ServiceStats:
        """A consistent snapshot; callable from any thread."""
        return self._on_loop(self._snapshot)

    def peek_l2(self, hashes: list[PageHash]) -> int:
        """Leading ``hashes`` present in L2, without touching recency or counters; any thread."""
        def peek() -> int:
            assert self.index is not None, "server not started"
            return self.index.peek(hashes)
        return self._on_loop(peek)

    def flush_l2(self) -> int:
        """Drop every unlocked committed L2 page; returns how many. Any thread."""
        def flush() -> int:
            assert self.index is not None, "server not started"
            return self.index.flush()
        return self._on_loop(flush)

    def check_integrity(self) -> None:
        """Index, allocator and pool invariants, then the L3 side (off the loop:
        it may scan the backend); callable from any thread."""
        def check() -> None:
            assert self.index is not None and self.pool is not None, "server not started"
            self.index.check_integrity()
            self.pool.check_integrity()
        self._on_loop(check)
        if self.l3 is not None:
            self.l3.check_integrity()

    def _snapshot(self) -> ServiceStats:
        idx, d = self.index, self.dispatcher
        assert idx is not None and d is not None, "server not started"
        c, a = idx.counters, idx.allocator
        return ServiceStats(
            capacity_pages=a.capacity, page_bytes=self.layout.page_bytes,
            segment_bytes=self.segment.size if self.segment else 0,
            used_pages=a.num_used, free_pages=a.num_free, committed_pages=idx.num_committed,
            reserved_pages=idx.num_reserved, locked_pages=idx.num_locked, lookups=c.lookups,
            hits=c.hits, misses=c.misses, evictions=c.evictions, reservations=c.reservations,
            commits=c.commits, acquired=c.acquired, flushed=c.flushed, duplicates=c.duplicates,
            cancelled=c.cancelled, reclaimed=c.reclaimed,
            clients=idx.num_owners - (self.l3 is not None), clients_total=self._next_client,
            errors=dict(d.errors), l3=self.l3.stats().to_dict() if self.l3 is not None else {})


class _Fanout:
    """One ``L2Listener`` that tells several, in order."""

    def __init__(self, listeners: list[L2Listener]):
        self.listeners = listeners

    def pages_stored(self, pages: Sequence[tuple[PageHash, PageHash | None]]) -> None:
        for x in self.listeners:
            x.pages_stored(pages)

    def pages_removed(self, hashes: Sequence[PageHash]) -> None:
        for x in self.listeners:
            x.pages_removed(hashes)


def open_l3(cfg: HiCacheConfig, layout: KVLayout) -> StorageBackend | None:
    """The service's L3 backend for ``storage.url`` (does not connect), or None when it is "".

    Raises ``ConfigError`` for a bad URL, including ``hicache+unix://``: the
    service is what that scheme talks to, so it cannot be its own L3.
    """
    st = cfg.storage
    if not st.url:
        return None
    if st.url.lower().startswith("hicache+"):
        raise ConfigError(f"storage.url={st.url!r}: the service's L3 must be a store (redis://, file://, "
                          "memory://, ...), not another hicache service")
    return open_storage(st.url, fingerprint=layout.fingerprint(), layout=layout, timeout_ms=st.timeout_ms,
                        max_retries=st.max_retries)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m hicache.api.engine_server", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", help="TOML configuration file (else $HICACHE_CONFIG)")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override one configuration value; repeatable")
    args = p.parse_args(argv)
    try:
        cfg = HiCacheConfig.load(args.config, parse_set_flags(args.set))
        logging.basicConfig(level=cfg.log_level, format="%(asctime)s %(name)s %(levelname)s %(message)s")
        layout = cfg.layout()
        storage = open_l3(cfg, layout)
        try:
            EngineServer(cfg, layout, storage=storage).run_forever()
        finally:
            if storage is not None:
                storage.close()
    except HiCacheError as e:
        print(f"hicache engine server: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
