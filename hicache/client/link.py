"""Engine-side client of the node-local service (``hicache.node.server``):
the one client module, for both ways an engine uses the service.

* **As L2** (``hicache.tiers.l2.shared``; an embedded ``HiCache`` whose
  ``storage.url`` is ``hicache+unix:///path.sock``): the engine maps the
  service's shared segment (``ServiceClient.pool``) and the page-copy kernels
  move pages between its L1 and the segment directly; the socket carries only
  the index calls below. ``HiCache`` then keeps no private L2 and opens no L3
  of its own: the service's L3 sits behind the segment (``fetch``).
* **As L3** (``hicache.storage.service.ServiceBackend``, what ``open_storage``
  returns for that URL: the vLLM and SGLang connectors, which keep their own
  host tier): payloads are copied by the CPU into and out of the segment.
"""
from __future__ import annotations

import os
import socket
import struct
from typing import Any, NamedTuple, Sequence

from hicache.core.config import DEFAULT_SOCKET_PATH
from hicache.core.errors import ConfigError, ContractMismatch, ForeignPage, OutOfPages, ServiceError
from hicache.core.redact import redact_url
from hicache.core.layout import KVLayout
from hicache.memory.pools import HostPool
from hicache.client.protocol import HEADER_BYTES, CommitResult, body_length, hello_request, pack, unpack
from hicache.memory.shm import SharedSegment
from hicache.core.stats import HiCacheStats
from hicache.core.types import HostPageId, PageHash

# Page ids arrive as plain ints: ``HostPageId`` is a NewType (static typing
# only), and wrapping 512 of them per lookup would cost ~25 us for nothing.

# Replies are small except ``lookup``/``acquire`` of long prompts; this bounds
# what the client will accept from a confused peer.
MAX_REPLY_BYTES = 64 << 20

SCHEME = "hicache+unix"  # the storage.url scheme that names the service's socket
# A healthy node-local service answers in microseconds; the socket timeout
# only catches a hung one, and a spurious timeout costs a reconnect, so it
# is generous: the fetch wait plus this.
SOCKET_SLACK_S = 2.0


def socket_path_of(url: str) -> str:
    """The socket path of a ``hicache+unix:///abs/path.sock`` URL (``ConfigError`` otherwise)."""
    scheme, sep, path = url.partition("://")
    if scheme.lower() != SCHEME or not sep or not path.startswith("/"):
        raise ConfigError(f"storage url {redact_url(url)!r}: expected {SCHEME}:///absolute/path/to/hicache.sock "
                          "(three slashes: the socket path is absolute)")
    return path


_CONNECT_HINTS = {
    FileNotFoundError: "start `hicache serve` first, or pass the socket it listens on (its "
                       "service.socket_path, default " + DEFAULT_SOCKET_PATH + ", printed on its first line)",
    ConnectionRefusedError: "the socket file is there but no server listens (a stopped or crashed "
                            "`hicache serve`); start it again",
    PermissionError: "this user may not open it: the service's service.socket_mode / service.socket_group "
                     "decide who may",
}


class LookupResult(NamedTuple):
    num_pages: int  # leading pages of the query present in L2
    host_page_ids: list[HostPageId]  # their pages, in query order (valid until evicted)


class FetchResult(NamedTuple):
    num_pages: int  # leading pages of the query present in L2 after the fetch
    host_page_ids: list[HostPageId]  # their pages, in query order (valid until evicted)
    fetched: int  # of those, pages this call loaded from the service's L3


def _req(op: str, hashes: Sequence[PageHash], need_draft: bool) -> dict[str, Any]:
    req: dict[str, Any] = {"op": op, "hashes": list(hashes)}
    if need_draft:
        req["need_draft"] = True
    return req


class Link:
    """One blocking Unix-socket connection to the service: framing and error
    mapping, one request in flight. ``ServiceClient`` and
    ``hicache.client.consensus.ServiceConsensus`` build on it. Not thread-safe."""

    _sock: socket.socket | None
    _rbuf: bytearray

    def _connect(self, socket_path: str, timeout: float | None) -> None:
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._rbuf = bytearray()  # received bytes not yet consumed as a reply
        self._sock.settimeout(timeout)
        try:
            self._sock.connect(socket_path)
        except (FileNotFoundError, ConnectionRefusedError, PermissionError) as e:
            # Same exception class (callers retry on it), with the path and what to do.
            raise type(e)(e.errno, f"{e.strerror}: no hicache service answers on the engine socket "
                          f"{socket_path!r}; {_CONNECT_HINTS[type(e)]}", socket_path) from None

    def _call(self, req: dict[str, Any]) -> dict[str, Any]:
        if self._sock is None:
            raise ServiceError("closed", "client is closed")
        frame = pack(req)  # a request msgpack refuses fails here, with the stream intact
        try:
            try:
                self._sock.sendall(frame)
            except (BrokenPipeError, ConnectionResetError):
                pass  # the server hung up first (e.g. refused the connection): its reason is the next frame
            rep = unpack(self._read_body())
        except OSError as e:
            self.close(send_bye=False)
            raise ServiceError("closed", f"connection to the engine server failed: {e}") from None
        except ServiceError as e:
            # A reply we cannot read: the stream is out of step with our requests.
            self.close(send_bye=False)
            raise ServiceError("closed", f"unreadable reply from the engine server ({e.kind}: {e.detail}); "
                               "connection closed") from None
        except BaseException:
            # Interrupted between request and reply (e.g. KeyboardInterrupt): that
            # reply is still coming and would be read as the next call's; hang up.
            self.close(send_bye=False)
            raise
        if rep.get("ok"):
            return rep
        kind, msg = rep.get("kind", "internal"), rep.get("message", repr(rep))
        if kind == "contract":
            # The server lists (field, server's, ours); report from this side.
            raise ContractMismatch("engine server refused this client's layout (ours = client)",
                                   [(d[0], d[2], d[1]) for d in rep.get("differences", [])])
        if kind == "out_of_pages":
            raise OutOfPages(msg)
        if kind == "foreign_page":
            raise ForeignPage(msg)
        raise ServiceError(kind, msg)

    def _read_body(self) -> bytes:
        """The next reply frame's body; one ``recv`` per reply in the common case."""
        buf = self._rbuf
        while len(buf) < HEADER_BYTES:
            self._fill()
        n = body_length(bytes(buf[:HEADER_BYTES]), MAX_REPLY_BYTES)
        end = HEADER_BYTES + n
        while len(buf) < end:
            self._fill()
        body = bytes(buf[HEADER_BYTES:end])
        del buf[:end]
        return body

    def _fill(self) -> None:
        assert self._sock is not None
        chunk = self._sock.recv(1 << 16)
        if not chunk:
            raise ConnectionResetError(f"server closed the connection ({len(self._rbuf)} bytes of a "
                                       "reply received)")
        self._rbuf += chunk

    def close(self, send_bye: bool = True) -> None:
        """Say bye (the server reclaims what this connection still holds). Idempotent."""
        if self._sock is not None and send_bye:
            try:
                self._call({"op": "bye"})
            except (ServiceError, OSError):
                pass  # already gone: the server reclaims on disconnect anyway
        if self._sock is not None:
            self._sock.close()
            self._sock = None


class ServiceClient(Link):
    """Connects, handshakes, maps the shared L2 segment. Use as a context manager.

    ``pool`` is a ``HostPool`` view of the segment for ``write_page``/``read_page``
    and kernels; page ids come from the server (``reserve``/``lookup``/``acquire``),
    never from ``pool.allocator``, which is unused here. ``pool`` stays valid
    until ``close()``. ``pin`` page-locks the mapping for GPU kernels (default:
    when CUDA is available).

    Raises ``ContractMismatch`` when the server refuses the layout (it names
    every differing field), ``ServiceError`` for other refusals.

    Synchronous: one blocking Unix socket, one request in flight. Not thread-safe;
    give each engine thread its own client (they are cheap).

    Typical write of new pages::

        pages = c.reserve(len(hashes))
        for p, payload in zip(pages, payloads):
            c.pool.write_page(p, payload)        # or a GPU page-copy kernel
        c.commit(hashes, pages)                  # or c.cancel(pages) if the copy failed

    and read of a cached prefix::

        pages = c.acquire(hashes)                # the leading present pages, locked
        data = [c.pool.read_page(p) for p in pages]
        c.release(hashes[:len(pages)])

    A committed page must hold its bytes and a released page may be evicted and
    rewritten, so commit and release come after the copy landed. Everything a
    connection reserved and did not commit, and everything it acquired and did
    not release, is reclaimed by the server when it closes (even when the engine
    process dies).
    """

    def __init__(self, socket_path: str, layout: KVLayout, *, timeout: float | None = 30.0,
                 pin: bool | None = None):
        self.layout = layout
        self._sock = None
        self._segment: SharedSegment | None = None
        self.pool: HostPool | None = None
        try:
            self._connect(socket_path, timeout)
            self._handshake()
            if pin is None or pin:
                pinned = self._segment.pin()
                if pin and not pinned:
                    raise ServiceError("bad_args", "pin=True but CUDA is not available")
        except BaseException:
            self.close(send_bye=False)
            raise

    def _handshake(self) -> None:
        rep = self._call(hello_request(self.layout.to_dict(), self.layout.fingerprint(), os.getpid()))
        self.client_id: int = rep["client_id"]
        self.num_pages: int = rep["num_pages"]
        # The service persists to an L3 of its own (``fetch`` can load from it); a
        # service that does not say is assumed to.
        self.has_l3: bool = bool(rep.get("has_l3", True))
        pool_bytes, off = HostPool.nbytes_for(self.layout, self.num_pages), rep["pool_offset"]
        if rep["shm_size"] != off + pool_bytes:
            raise ServiceError("bad_layout", f"server segment holds {rep['shm_size']} bytes with its pool at "
                               f"{off}; this layout needs {pool_bytes} pool bytes for {self.num_pages} pages")
        # The segment must be the server's own file (the peer of this socket), not one planted under its name.
        assert self._sock is not None, "handshake runs on a connected socket"
        server_uid = struct.unpack("3i", self._sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))[1]
        self._segment = SharedSegment.attach(rep["shm_name"], rep["shm_size"], owner_uid=server_uid)
        self.pool = HostPool(self.layout, self.num_pages, buffer=self._segment.tensor[off:])

    # ------------------------------------------------------------------- ops
    def lookup(self, hashes: Sequence[PageHash], *, need_draft: bool = False) -> LookupResult:
        """How many leading pages of ``hashes`` L2 holds. Does not lock them.
        ``need_draft``: only pages whose draft rows are valid (the answer stops
        at the first that is not)."""
        pages = self._call(_req("lookup", hashes, need_draft))["pages"]
        return LookupResult(len(pages), pages)

    def fetch(self, hashes: Sequence[PageHash], wait_ms: int, *, need_draft: bool = False) -> FetchResult:
        """``lookup``, but pages missing from L2 are first loaded from the service's L3.

        Waits up to ``wait_ms`` (capped by the service) for L3; a load still
        running then lands in L2 later. Without an L3 it is ``lookup``. Does
        not lock the pages: ``acquire`` them to read. ``need_draft``: as ``lookup``.
        """
        rep = self._call({**_req("fetch", hashes, need_draft), "wait_ms": wait_ms})
        return FetchResult(len(rep["pages"]), rep["pages"], rep["fetched"])

    def reserve(self, n: int) -> list[HostPageId]:
        """``n`` pages to write into; raises ``OutOfPages`` if L2 cannot free them."""
        return self._call({"op": "reserve", "n": n})["pages"]

    def commit(self, hashes: Sequence[PageHash], host_page_ids: Sequence[int], *,
               draft_pages: int | None = None) -> CommitResult:
        """Make written reserved pages lookup-able under ``hashes`` (same order).

        ``draft_pages``: how many leading pages carry valid draft rows (layouts
        with draft planes; the server's default is none of them, the safe side).
        """
        req = {"op": "commit", "hashes": list(hashes), "pages": list(host_page_ids)}
        if draft_pages is not None:
            req["draft_pages"] = draft_pages
        rep = self._call(req)
        return CommitResult(rep["inserted"], rep["duplicates"])

    def cancel(self, host_page_ids: Sequence[int]) -> None:
        """Give back reserved pages that will not be committed."""
        self._call({"op": "cancel", "pages": list(host_page_ids)})

    def acquire(self, hashes: Sequence[PageHash], *, need_draft: bool = False) -> list[HostPageId]:
        """Lock the leading present pages of ``hashes`` for reading; may return fewer.

        Release exactly the returned prefix (``hashes[:len(result)]``).
        ``need_draft``: as ``lookup``.
        """
        return self._call(_req("acquire", hashes, need_draft))["pages"]

    def release(self, hashes: Sequence[PageHash]) -> None:
        """Undo one ``acquire`` of each listed hash."""
        self._call({"op": "release", "hashes": list(hashes)})

    def stats(self) -> dict[str, Any]:
        """The server's ``ServiceStats`` as a dict."""
        return self._call({"op": "stats"})["stats"]

    def report(self, name: str = "", **figures: int) -> None:
        """Push this engine's own L1/L2 figures (``EngineReport`` fields, totals
        since start; absent ones are 0) for the service's REST stats. Each call
        replaces the last; the service forgets them when this client disconnects."""
        self._call({"op": "report", "name": name, "figures": figures})

    def report_stats(self, stats: HiCacheStats, name: str = "") -> None:
        """``report`` an embedded cache's ``HiCache.stats()`` (its L1 and L2 hits)."""
        self.report(name, **report_figures(stats))

    def check_integrity(self) -> None:
        """Ask the server to run its ``check_integrity()``; raises ``ServiceError('integrity')``."""
        self._call({"op": "check"})

    def close(self, send_bye: bool = True) -> None:
        """Say bye (the server reclaims what this client still holds), unmap. Idempotent."""
        super().close(send_bye)
        self.pool = None
        if self._segment is not None:
            self._segment.close()
            self._segment = None

    def __enter__(self) -> "ServiceClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def report_figures(stats: HiCacheStats) -> dict[str, Any]:
    """An embedded cache's ``HiCache.stats()`` as ``report`` figures."""
    i = stats.index
    return {"requests": i.requests, "prompt_tokens": i.admitted_tokens,
            "l1_hit_tokens_exact": i.device_hit_exact_tokens, "l1_hit_tokens_visible": i.device_hit_tokens,
            "l2_hit_tokens_exact": i.host_hit_exact_tokens, "l2_hit_tokens_visible": i.host_hit_tokens,
            "l1_used_pages": i.device_pages_cached + i.device_pages_private,
            "l1_capacity_pages": stats.capacity_pages.get("L1", 0), "l1_evictions": i.device_evicted_pages,
            **_admission_figures(stats), "misses": stats.misses.as_dict()}


def _admission_figures(stats: HiCacheStats) -> dict[str, int]:
    a = stats.admission
    if a is None:
        return {}
    return {"admission_load": a.load, "admission_load_l2": a.load_l2, "admission_recompute": a.recompute,
            "admission_unmeasured": a.unmeasured,
            "admission_recomputed_tokens": a.recomputed_l2_tokens + a.recomputed_l3_tokens}
