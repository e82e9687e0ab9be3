"""Node-local engine service: an L2 host pool in shared memory, served over a Unix socket.

``NodeServer(config, layout)`` creates the shared segment
(``service.shm_name``, ``pool.host_pages`` pages of ``layout``), binds
``service.socket_path`` and answers engines with length-prefixed msgpack
frames (``hicache.client.protocol``). Engines copy page bytes in and out of the
segment themselves; the server only decides which page ids hold what.

With an L3 backend (``storage=``; ``storage.url`` when run from the command
line) committed pages are written behind to L3 and ``fetch`` loads L2 misses
back from it, on worker threads (``hicache.node.l3_tier``).
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
import signal
import sys
import threading
from collections import Counter
from typing import TYPE_CHECKING, Any, Callable, NamedTuple, TypeVar

from hicache.node.ops import Dispatcher
from hicache.node.socket_guard import check_socket_path
from hicache.node.socket_guard import PeerCred, PeerPolicy, bind_unix_socket, peer_cred, resolve_group
from hicache.node.snapshot import ServiceStats, ServiceView
from hicache.node.l2_segment import WriteMarks
from hicache.core.config import HiCacheConfig, parse_set_flags
from hicache.core.errors import ConfigError, HiCacheError, IntegrityError, ServiceError
from hicache.node.l2_segment import L2Segment
from hicache.core.layout import KVLayout
from hicache.node.snapshot import EventLog, Taken, merge
from hicache.node.l2_index import ClientKey, L2Index
from hicache.node.l3_tier import L3Tier
from hicache.memory.pools import HostPool
from hicache.client.protocol import HEADER_BYTES, body_length, pack, unpack
from hicache.core.redact import LogLimiter
from hicache.core.redact import Redactor
from hicache.storage import StorageBackend, open_storage
from hicache.core.types import PageHash

log = logging.getLogger(__name__)
T = TypeVar("T")

# Longest path a Unix socket address can hold on Linux (sun_path minus NUL).
MAX_SOCKET_PATH = 107
# Frames up to this size are decoded on the loop (tens of µs); larger ones
# (up to service.max_request_bytes: ~1-2 s for 8 MiB of small arrays) on a
# worker thread, so other clients are answered meanwhile.
UNPACK_INLINE_BYTES = 256 << 10


class Refusal(NamedTuple):
    """Why a new connection is refused: an error kind and its message."""

    kind: str
    message: str


def client_key(cred: PeerCred) -> ClientKey:
    """The client a peer's connections and pages count against: its process, or its uid when
    the server cannot see its pid (0: a pid namespace the server's does not map)."""
    return f"pid {cred.pid} (uid {cred.uid})" if cred.pid else f"uid {cred.uid}"


# KV events the server keeps for ``take_events`` beyond the L2 pages (at least this
# many): the REST app takes them every few tens of ms, so this is a burst allowance.
MIN_KEPT_EVENTS = 65536


class NodeServer:
    """The service. Build, ``start()`` (or ``run_forever()``), ``stop()``.

    Owns the shared segment and the socket file: both are removed on stop.
    ``storage`` (optional) is the node's L3; the server uses it but does not
    close it. KV events (pages entering and leaving L2, pages written to L3)
    are pulled with ``take_events()``.

    KV events are pulled, never pushed: after every request the server takes the
    L2 index's events (``L2Index.take_events``), queues the STORED ones for its
    L3 writer and keeps all of them in a bounded log; ``take_events()`` (any
    thread; the REST app polls it) returns those and the L3 writer's, in the
    order they happened.

    Concurrency: one asyncio event loop owns every piece of state. ``start()``
    runs it in a thread (tests, embedding next to a REST app), ``run_forever()``
    in the calling thread (the CLI). ``stats()`` and ``check_integrity()`` may be
    called from any thread; they run on the loop.

    Run it: ``python -m hicache.node.server [--config FILE] [--set k=v ...]``.
    """

    def __init__(self, config: HiCacheConfig, layout: KVLayout | None = None,
                 storage: StorageBackend | None = None):
        self.config = config
        self.storage = storage
        self.layout = layout if layout is not None else config.layout()
        svc = config.service
        self.socket_path = svc.socket_path
        self.shm_name = svc.shm_name
        self.max_request_bytes = svc.max_request_bytes
        self.num_pages = config.pool.host_pages
        self.max_connections = svc.max_connections
        self.max_client_connections = svc.max_connections_per_client
        self.handshake_timeout_s = svc.handshake_timeout_s
        self.idle_timeout_s = svc.idle_timeout_s or None
        self.socket_gid = resolve_group(svc.socket_group)
        self.policy = PeerPolicy(os.geteuid(), frozenset(svc.allowed_uids), self.socket_gid)
        self._log = LogLimiter(log)
        if len(os.fsencode(self.socket_path)) > MAX_SOCKET_PATH:
            raise ConfigError(f"service.socket_path={self.socket_path!r} is longer than "
                              f"{MAX_SOCKET_PATH} bytes; choose a shorter path")
        self.segment: L2Segment | None = None
        self.segment_origin = ""  # "created", "adopted" or "recreated" (see hicache.node.l2_segment)
        self.pool: HostPool | None = None
        self.index: L2Index | None = None
        self.l3: L3Tier | None = None
        self._expected: set[asyncio.Task[int]] = set()  # background fetches started by ``expect``
        self._events: EventLog | None = None  # L2 events taken from the index, until take_events()
        self.dispatcher: Dispatcher | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._thread: threading.Thread | None = None  # start()'s thread; None under run_forever()
        self._loop_thread: int | None = None  # ident of the thread running the loop (either way)
        self._next_client = 0
        self._conns: dict[int, asyncio.StreamWriter] = {}
        self._client_conns: Counter[ClientKey] = Counter()  # open connections per client
        self._bound = False  # this server bound socket_path (so removes it on stop)

    # -------------------------------------------------------------- lifecycle
    def start(self, timeout: float = 30.0) -> None:
        """Serve in a background thread; returns once the socket accepts."""
        if self._thread is not None:
            raise ServiceError("already_started", "NodeServer.start() called twice; build a new server")
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
            assert self._loop is not None and self._stop is not None, "_main sets loop and stop before on_ready"
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
            sock = bind_unix_socket(self.socket_path, self.config.service.socket_mode_bits, self.socket_gid)
            self._bound = True
            server = await asyncio.start_unix_server(self._serve_client, sock=sock)
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
        self.config.check_host_memory(self.layout)
        share = self.config.service.client_page_share
        opened = L2Segment.open_for_server(self.shm_name, self.layout, self.num_pages, self.socket_gid)
        self.segment, self.segment_origin = opened.segment, opened.action
        if opened.action == "created":
            log.info("L2 segment %s created", self.shm_name)
        else:
            log.warning("L2 segment %s %s (%d cached pages kept): %s", self.shm_name, opened.action,
                        opened.restored, opened.reason)
        try:
            self.pool = self.segment.pool
            self.index = L2Index(self.pool.allocator, journal=self.segment,
                                 client_pages=None if share >= 1 else max(1, int(share * self.num_pages)),
                                 share_setting=f"service.client_page_share={share}")
            self._events = EventLog(max(MIN_KEPT_EVENTS, 4 * self.num_pages))
            if opened.restored:
                self.index.restore(self.segment.entries())
            if self.storage is not None:
                st = self.config.storage
                # A fetch makes two L3 calls (prefix_hits, get), each bounded by
                # timeout_ms per attempt; wait for no longer than both.
                wait_s = 2 * (1 + st.max_retries) * st.timeout_ms / 1000.0
                self.l3 = L3Tier(self.storage, self.index, self.pool, max_wait_s=wait_s,
                                 queue_pages=self.num_pages)
            self.dispatcher = Dispatcher(self.layout, self.index, self.segment.info, lambda: self._snapshot().to_dict(),
                                         self.l3, WriteMarks(self.pool))
        except BaseException:
            self._close_state()
            raise

    def _close_state(self) -> None:
        self.pool = None  # drop the segment's views before unmapping it
        if self.segment is not None:
            self.segment.close()
        if self._bound:  # only the socket this server bound; never a file found under the path
            self._bound = False
            try:
                os.unlink(self.socket_path)
            except FileNotFoundError:
                pass

    def _remove_stale_socket(self) -> None:
        """Remove a socket file no server answers on; ``ConfigError`` for a live server or
        for anything that is not a socket (never deleted: see ``check_socket_path``)."""
        check = check_socket_path(self.socket_path)
        if check.problem:
            raise ConfigError(check.problem)
        if check.stale:
            log.warning("removing stale socket %s", self.socket_path)
            os.unlink(self.socket_path)

    # ------------------------------------------------------------ connections
    async def _serve_client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        client = self._admit(writer)
        if isinstance(client, Refusal):
            await self._refuse(writer, *client)
            return
        cid = self._next_client
        self._next_client += 1
        self._conns[cid] = writer
        self._client_conns[client] += 1
        assert self.dispatcher is not None and self.index is not None, "clients are served only after _open_state"
        d, registered = self.dispatcher, False
        try:
            while True:
                # Before the handshake a connection has handshake_timeout_s to
                # say hello; afterwards it may idle for idle_timeout_s.
                req = await self._read_request(reader, writer, registered)
                if req is None:
                    break
                if isinstance(req, ServiceError):
                    reply = d.error(req.kind, req.detail)
                elif registered:
                    reply = await d.handle_async(cid, req)
                else:
                    reply = d.hello(cid, req, client)
                    registered = reply.body["ok"]
                self._pump_events()
                writer.write(pack(reply.body))
                await writer.drain()
                if reply.close:
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass  # the client went away; reclaim below
        finally:
            del self._conns[cid]
            self._client_conns[client] -= 1
            if not self._client_conns[client]:
                del self._client_conns[client]
            if registered:
                got = d.drop(cid)
                if got.reserved or got.acquired:
                    self._log.info("reclaimed", "client %d closed holding %d reserved pages and %d "
                                   "acquisitions; reclaimed", cid, got.reserved, got.acquired)
            writer.close()

    def _admit(self, writer: asyncio.StreamWriter) -> ClientKey | Refusal:
        """The client a new connection belongs to, or why it is refused."""
        if len(self._conns) >= self.max_connections:
            return Refusal("busy", f"the service already serves {len(self._conns)} connections "
                           f"(service.max_connections={self.max_connections}); close idle clients or raise it")
        sock = writer.get_extra_info("socket")
        try:
            cred = peer_cred(sock)
        except OSError as e:
            return Refusal("forbidden", f"cannot read the peer's credentials ({e.strerror}); refusing")
        if not self.policy.allows(cred):
            return Refusal("forbidden", f"uid {cred.uid} (pid {cred.pid}) may not use this socket; allowed: "
                           f"{self.policy.describe()} (service.allowed_uids, service.socket_group)")
        client = client_key(cred)
        if self._client_conns[client] >= self.max_client_connections:
            return Refusal("busy", f"client {client} already holds {self._client_conns[client]} connections "
                           f"(service.max_connections_per_client={self.max_client_connections}); reuse them, "
                           "close idle ones or raise the setting")
        return client

    async def _refuse(self, writer: asyncio.StreamWriter, kind: str, message: str) -> None:
        assert self.dispatcher is not None, "connections are accepted only after _open_state"
        self._log.warning(kind, "refused a connection (%s): %s", kind, message)
        try:
            writer.write(pack(self.dispatcher.error(kind, message).body))
            async with asyncio.timeout(self.handshake_timeout_s):
                await writer.drain()
        except (ConnectionError, TimeoutError):
            pass
        finally:
            writer.close()

    async def _read_request(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                            handshaken: bool) -> dict[str, Any] | ServiceError | None:
        """The next request; a ``ServiceError`` to answer; None to hang up (framing lost, or timed out).

        The first byte must arrive within idle_timeout_s (handshaken) or
        handshake_timeout_s (not yet); once a frame has begun, the rest of it
        must arrive within handshake_timeout_s.
        """
        assert self.dispatcher is not None, "connections are accepted only after _open_state"
        try:
            async with asyncio.timeout(self.idle_timeout_s if handshaken else self.handshake_timeout_s):
                first = await reader.readexactly(1)
        except TimeoutError:
            if not handshaken:
                await self._hang_up(writer, "timeout", f"no hello within {self.handshake_timeout_s}s "
                                    "(service.handshake_timeout_s); connect when ready to talk")
            return None  # an idle handshaken client: close quietly, it reconnects when needed
        try:
            async with asyncio.timeout(self.handshake_timeout_s):
                header = first + await reader.readexactly(HEADER_BYTES - 1)
                try:
                    n = body_length(header, self.max_request_bytes, hello=not handshaken)
                except ServiceError as e:
                    # The stream cannot be resynchronised: answer, then hang up.
                    await self._hang_up(writer, e.kind, e.detail)
                    return None
                body = await reader.readexactly(n)
        except TimeoutError:
            await self._hang_up(writer, "timeout", f"a frame was not completed within {self.handshake_timeout_s}s "
                                "(service.handshake_timeout_s); send whole frames")
            return None
        try:
            if len(body) > UNPACK_INLINE_BYTES:  # decoding MiBs takes the loop for 100s of ms: not on it
                return await asyncio.to_thread(unpack, body)
            return unpack(body)
        except ServiceError as e:
            return e

    async def _hang_up(self, writer: asyncio.StreamWriter, kind: str, message: str) -> None:
        assert self.dispatcher is not None, "connections are accepted only after _open_state"
        writer.write(pack(self.dispatcher.error(kind, message).body))
        try:
            async with asyncio.timeout(self.handshake_timeout_s):
                await writer.drain()
        except TimeoutError:
            pass

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
            return self._serving().peek(hashes)
        return self._on_loop(peek)

    def expect(self, hashes: list[PageHash]) -> int:
        """A router sends the request of ``hashes`` here: its L2 pages go to the most
        recently used end (evicted last) and the L3 pages continuing them start loading
        into L2 (a background fetch, not waited for). Returns the leading pages L2 holds.
        Any thread."""
        def expect() -> int:
            n = len(self._serving().lookup(hashes))
            if self.l3 is not None and n < len(hashes):
                try:
                    loop = asyncio.get_running_loop()
                except RuntimeError:  # not serving on a loop (a bare start in tests): no fetch
                    return n
                task = loop.create_task(self.l3.fetch(hashes[n:], self.l3.max_wait_s))
                self._expected.add(task)
                task.add_done_callback(self._expected.discard)
            return n
        return self._on_loop(expect)

    def flush_l2(self) -> int:
        """Drop every unlocked committed L2 page; returns how many. Any thread."""
        def flush() -> int:
            n = self._serving().flush()
            self._pump_events()
            return n
        return self._on_loop(flush)

    def take_events(self) -> Taken:
        """KV events since the previous call, in the order they happened: L2 STORED
        (a commit, ``owner`` the client) and REMOVED (evicted, flushed), L3 STORED
        (written behind); and how many were dropped meanwhile (a bounded log was
        full: a reader resynchronises). Clears them. Any thread."""
        def take() -> Taken:
            self._serving()
            self._pump_events()
            assert self._events is not None, "_open_state builds the index and the event log together"
            return merge(self._events.take(), *([self.l3.take_events()] if self.l3 is not None else []))
        return self._on_loop(take)

    def _pump_events(self) -> None:
        """On the loop: take the index's events, queue its new pages for L3, keep them all."""
        if self.index is None or self._events is None:
            return
        taken = self.index.take_events()
        if taken.events and self.l3 is not None:
            self.l3.queue_writes(taken.events)
        if taken.events or taken.dropped:
            self._events.extend(taken.events, taken.dropped)

    def check_integrity(self) -> None:
        """Index, allocator and pool invariants, then the L3 side (off the loop:
        it may scan the backend); callable from any thread."""
        def check() -> None:
            index = self._serving()
            if self.pool is None or self.segment is None:  # _close_state drops them on stop
                raise ServiceError("not_serving", "engine server was stopped; its pool and segment are gone")
            index.check_integrity()
            if self._events is not None:
                self._events.check_integrity()
            self.pool.check_integrity()
            bad = self.segment.check_against(index.committed_pages())
            if bad:
                raise IntegrityError(f"L2 segment page table disagrees with the index: {bad}")
        self._on_loop(check)
        if self.l3 is not None:
            self.l3.check_integrity()

    def _serving(self) -> L2Index:
        """The index; ``ServiceError`` when the server is not serving (not started, or stopped)."""
        if self.index is None:
            raise ServiceError("not_serving", "engine server is not serving: start() it first (or it was stopped)")
        return self.index

    def _snapshot(self) -> ServiceStats:
        idx, d = self._serving(), self.dispatcher
        assert d is not None, "_open_state sets index and dispatcher together"
        c, a = idx.counters, idx.allocator
        return ServiceStats(
            capacity_pages=a.capacity, page_bytes=self.layout.page_bytes,
            segment_bytes=self.segment.size if self.segment else 0,
            used_pages=a.num_used, free_pages=a.num_free, committed_pages=idx.num_committed,
            reserved_pages=idx.num_reserved, locked_pages=idx.num_locked, lookups=c.lookups,
            hits=c.hits, misses=c.misses, evictions=c.evictions, reservations=c.reservations,
            commits=c.commits, acquired=c.acquired, flushed=c.flushed, duplicates=c.duplicates,
            cancelled=c.cancelled, reclaimed=c.reclaimed, draft_cut_pages=c.draft_cut_pages,
            draft_upgraded=c.draft_upgraded, segment_origin=self.segment_origin,
            clients=idx.num_owners - (self.l3 is not None), clients_total=self._next_client,
            errors=dict(d.errors), l3=self.l3.stats().to_dict() if self.l3 is not None else {},
            engines={str(o): dataclasses.asdict(r) for o, r in sorted(d.reports.items())},
            reported_misses=d.misses_total.as_dict())


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
    from hicache.storage.capacity import backend_options
    return open_storage(st.url, fingerprint=layout.fingerprint(), layout=layout, timeout_ms=st.timeout_ms,
                        max_retries=st.max_retries, auth_key=st.resolved_auth_key(), **backend_options(st))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m hicache.node.server", description=__doc__,
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
            NodeServer(cfg, layout, storage=storage).run_forever()
        finally:
            if storage is not None:
                storage.close()
    except HiCacheError as e:
        print(f"hicache engine server: error: {Redactor().text(str(e))}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())


if TYPE_CHECKING:  # mypy (pyproject [tool.mypy] files) checks that the REST routes' view fits
    _VIEW: type[ServiceView] = NodeServer
