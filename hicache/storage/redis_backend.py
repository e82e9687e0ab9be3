"""``redis://``, ``rediss://`` (one server) and ``redis+cluster://`` /
``rediss+cluster://`` (Redis Cluster through redis-py's ``RedisCluster``).

Every batch is one non-transactional pipeline (one round trip per server).
A page is SET as ``FramedValue(header, payload)`` so the payload is sent
without being joined to its header (see ``redis_wire``). ``get_into`` (one
server) sends MGETs whose values land in the caller's buffers and are verified
by the thread that received them, a large batch split over connections.
Timeouts: ``socket_timeout`` and ``socket_connect_timeout`` are
``timeout_ms``; a failed attempt is retried ``max_retries`` times by redis-py's
``Retry`` with ``EqualJitterBackoff`` (capped at ``timeout_ms``), so the worst
case of one call while Redis is down is about ``(max_retries + 1) * 2 *
timeout_ms``; after that the base class answers at once until its next probe.
redis-py reconnects a dropped connection by itself on the next use.

URL forms::

    redis://[[user]:password@]host[:port][/db][?option=value]
    rediss://...                                   (TLS)
    redis+cluster://[[user]:password@]host:port[,host:port...]
    rediss+cluster://...                           (TLS)
"""
from __future__ import annotations

import concurrent.futures
import os
import re
import threading
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from urllib.parse import urlsplit
from typing import Any, Callable, Iterator

import redis
from redis.backoff import EqualJitterBackoff
from redis.cluster import ClusterNode, RedisCluster
from redis.connection import ConnectionPool, SSLConnection, parse_url
from redis.exceptions import ClusterDownError, RedisClusterException, RedisError
from redis.retry import Retry

from hicache.core.errors import ConfigError
from hicache.core.redact import error_text
from hicache.core.redact import redact_url
from hicache.storage.base import StorageBackend
from hicache.storage.capacity import StorageOptions
from hicache.storage.into import PutBatch
from hicache.storage.capacity import StorageUsage
from hicache.storage.codec import Buffer
from hicache.storage.health import LoadFactor
from hicache.storage.into import MAX_SPLIT_HEADER, InPlace, Verifier
from hicache.storage.redis_wire import FramedConnection, FramedSSLConnection, FramedValue


def _retry(options: StorageOptions) -> Retry:
    t = options.timeout_s
    return Retry(EqualJitterBackoff(cap=t, base=t / 4), retries=options.max_retries)


# Overlapping checksums with sends pays only for batches of several MiB: each
# chunk is one more round trip. Chunks of at least this many payload bytes.
OVERLAP_CHUNK_BYTES = 4 << 20
# ... and only with cores to spare: on a 2-core box (client + a loopback
# server) the helper thread takes the server's core and the put is slower
# than the serial one (bench/RESULTS.md, L3 section, 2026-11-30).
OVERLAP_MIN_CPUS = 4
# Without the helper, headers are built in groups of about this many payload
# bytes (L2-sized), each just before the group is sent: page by page measured
# slower than all-first below ~512 KiB pages, and faster above (2-core box).
LAZY_GROUP_BYTES = 1 << 20


# get_into: a batch of at least READ_SPLIT_BYTES of payload per connection is split among
# up to READ_PARTS connections (one thread each), each receiving and verifying its pages;
# one MGET carries at most MGET_BYTES of payload (Redis builds each reply whole).
READ_PARTS = 4
READ_SPLIT_BYTES = 2 << 20
MGET_BYTES = 16 << 20


class _PageSink:
    """Where one MGET's values land: value ``j`` is page ``idx[j]``, received as its header
    (``verify.header_bytes``, or whatever precedes the payload) then straight into its
    destination's segments, and judged by ``verify`` as soon as it has landed. A value of
    an odd length is received whole, at most a page and ``MAX_SPLIT_HEADER`` of it, for
    ``decode`` to reject. Used by one thread."""

    __slots__ = ("idx", "dests", "verify", "hdr", "head", "odd", "payload")

    def __init__(self, idx: range, dests: list[list[memoryview]], verify: Verifier):
        self.idx, self.dests, self.verify = idx, dests, verify
        self.hdr = memoryview(bytearray(verify.header_bytes))
        self.payload = sum(mv.nbytes for mv in dests[idx.start]) if idx else 0
        self.head = self.hdr  # where the value being received puts what precedes its payload
        self.odd: memoryview | None = None  # the buffer of the value being received whole

    def buffers(self, j: int, n: int) -> list[memoryview]:
        hlen = n - self.payload
        if 0 < hlen <= MAX_SPLIT_HEADER:
            self.odd = None
            self.head = self.hdr if hlen == self.hdr.nbytes else memoryview(bytearray(hlen))
            return [self.head, *self.dests[self.idx[j]]]
        self.odd = memoryview(bytearray(min(n, self.payload + MAX_SPLIT_HEADER + 1)))
        return [self.odd]

    def landed(self, j: int, n: int | None | BaseException) -> Any:
        i = self.idx[j]
        if n is None or isinstance(n, BaseException):
            return self.verify(i, n)
        if self.odd is not None:
            return self.verify(i, bytes(self.odd))
        return self.verify(i, InPlace(self.head))


def _usable_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


class RedisBackend(StorageBackend):
    """One Redis server (``RedisClusterBackend`` below: a cluster).

    ``make_client`` builds the redis-py client; it is called lazily (on the
    first call, and again after a failed construction) so opening never
    blocks on, or fails because of, an unreachable server.
    """

    scheme = "redis"
    DIRECT_IO = True  # MGET values land in the caller's rows (redis_wire); put_new is SET NX
    OUTAGE_ERRORS = (redis.ConnectionError, redis.TimeoutError, ClusterDownError, RedisClusterException,
                     OSError)
    CALL_ERRORS = (RedisError,)
    # Large puts checksum the next chunk on a helper thread while this one is sent, where
    # there are cores for it (OVERLAP_MIN_CPUS); benchmarks set it to compare.
    overlap_checksums = _usable_cpus() >= OVERLAP_MIN_CPUS

    def __init__(self, options: StorageOptions, make_client: Callable[[], Any], name: str):
        super().__init__(options, name)
        self._make_client = make_client
        self._client_obj: Any = None
        self._hash_pool: ThreadPoolExecutor | None = None  # checksum helper for large puts, made on first use
        self._read_pool: ThreadPoolExecutor | None = None  # get_into's extra reading threads, made on first use
        self._load = LoadFactor()
        self._memory_checked = False  # the first successful put reads INFO memory once (maxmemory warning)
        self._mu = threading.Lock()

    # --------------------------------------------------------------- building
    @classmethod
    def from_url(cls, url: str, options: StorageOptions, **redis_kwargs: Any) -> "RedisBackend":
        """``redis://`` or ``rediss://``; ``redis_kwargs`` go to redis-py's ConnectionPool."""
        try:
            kw = parse_url(url)
        except ValueError as e:
            # redis-py's message may quote part of the password (``... as 'Pa55'``).
            why = error_text(e, url)
            raise ConfigError(f"storage url {redact_url(url)!r}: {why}; expected "
                              "a URL like redis://localhost:6379/0 (a user and password go before the host, "
                              "followed by @)") from None
        path = urlsplit(url).path.strip("/")
        if path and not path.isdigit():
            # redis-py silently falls back to db 0 for a non-numeric path.
            raise ConfigError(f"storage url {redact_url(url)!r}: database {path!r} is not a number; "
                              "use redis://host:port/N with N a database index (0 by default)")
        ssl = kw.pop("connection_class", None) is SSLConnection
        kw.setdefault("protocol", 2)  # RESP2: replies parsed by redis_wire.DirectReplyParser
        kw.update(redis_kwargs)
        kw.update(socket_timeout=options.timeout_s, socket_connect_timeout=options.timeout_s,
                  retry=_retry(options),
                  connection_class=FramedSSLConnection if ssl else FramedConnection)

        try:
            ConnectionPool(**kw).make_connection()  # builds a connection object; does not connect
        except TypeError as e:
            why = error_text(e, url)
            raise ConfigError(f"storage url {redact_url(url)!r}: an option is not supported here ({why}); "
                              "remove it (ssl_* options need rediss://)") from None

        def make() -> redis.Redis:
            return redis.Redis(connection_pool=ConnectionPool(**kw))
        return cls(options, make, redact_url(url))

    def _pipe(self) -> Any:
        return self._client().pipeline(transaction=False)

    def _client(self) -> Any:
        c = self._client_obj
        if c is None:
            with self._mu:
                if self._client_obj is None:
                    self._client_obj = self._make_client()
                c = self._client_obj
        return c

    # ------------------------------------------------------------- primitives
    def _raw_put(self, items: PutBatch, nx: bool = False) -> list[bool | BaseException | None]:
        out = self._put_all(items, nx)
        if not self._memory_checked:
            self._memory_checked = True
            try:
                self._raw_usage()  # warns when Redis has no maxmemory
            except (RedisError, RedisClusterException, OSError) as e:  # INFO refused (ACL), or down: the put stands; only the check is lost
                self._warnings.once("info", "L3 %s: INFO memory failed (%s); cannot check maxmemory", self.name, e)
        return out

    def _raw_put_new(self, items: PutBatch) -> list[bool | BaseException | None]:
        return self._raw_put(items, nx=True)

    def _put_all(self, items: PutBatch, nx: bool = False) -> list[bool | BaseException | None]:
        chunks = _put_chunks(items) if self.overlap_checksums else None
        if chunks is None:
            # One pipeline; headers are built (checksums read) group by group just
            # before the group is sent, so the send reads the payloads from cache.
            return self._put_pipeline(items, range(len(items)), nx, lazy=True)
        # Checksum chunk j+1 on the helper thread while chunk j is on the wire:
        # sendall releases the GIL, so the two run on two cores. Headers are
        # built once (PutBatch caches them) and only by the helper.
        pool = self._hasher()
        futs = [pool.submit(_build_headers, items, c) for c in chunks]
        out: list[bool | BaseException] = []
        try:
            for c, f in zip(chunks, futs):
                f.result()
                out += self._put_pipeline(items, c, nx)
        finally:
            for f in futs:
                f.cancel()  # after an outage: no hashing for chunks that will not be sent
        return out

    def _put_pipeline(self, items: PutBatch, idx: range, nx: bool,
                      lazy: bool = False) -> list[bool | BaseException | None]:
        """SET each page (``nx``: SET NX, None where the key was present); p.set() minus its option parsing."""
        p = self._pipe()
        for i in idx:
            k, payload = items.key_payload(i)
            hdr = partial(items.header_ahead, i, LAZY_GROUP_BYTES) if lazy else items.header(i)
            if nx:
                p.execute_command("SET", k, FramedValue(hdr, payload), "NX")
            else:
                p.execute_command("SET", k, FramedValue(hdr, payload))
        return [r if isinstance(r, BaseException) else None if (nx and r is None) else bool(r)
                for r in p.execute(raise_on_error=False)]

    def _hasher(self) -> ThreadPoolExecutor:
        with self._mu:
            if self._hash_pool is None:
                self._hash_pool = ThreadPoolExecutor(1, thread_name_prefix=f"hicache-l3-hash-{self.name}")
            return self._hash_pool

    def _raw_get(self, keys: list[bytes]) -> list[Buffer | None | BaseException]:
        # NEVER_DECODE: the reply parser receives each value straight into the
        # bytearray it returns (redis_wire.DirectReplyParser), no extra copies.
        p = self._pipe()
        for k in keys:
            p.execute_command("GET", k, NEVER_DECODE=[])
        return p.execute(raise_on_error=False)

    def _raw_get_into(self, keys: list[bytes], dests: list[list[memoryview]], verify: Verifier) -> list[Any]:
        """MGETs whose values land in ``dests`` (``redis_wire``'s ``read_into``), each page
        verified by the thread that received it; a batch of large pages is split among
        connections, one thread each (the caller's the first), all finished before this returns."""
        n = len(keys)
        payload = sum(mv.nbytes for mv in dests[0]) if n else 0
        k = max(1, min(READ_PARTS, n, payload * n // READ_SPLIT_BYTES, int(_usable_cpus() / self._load())))
        parts = [range(n * j // k, n * (j + 1) // k) for j in range(k)]
        futs = [self._readers().submit(self._mget_into, keys, idx, dests, verify) for idx in parts[1:]]
        try:
            first = self._mget_into(keys, parts[0], dests, verify)
        finally:
            concurrent.futures.wait(futs)  # no part may still write into dests once this returns
        return first + [x for f in futs for x in f.result()]

    def _mget_into(self, keys: list[bytes], idx: range, dests: list[list[memoryview]], verify: Verifier) -> list[Any]:
        """Pages ``idx`` on one connection: MGETs of at most ``MGET_BYTES`` of payload, pipelined."""
        per = max(1, MGET_BYTES // max(1, sum(mv.nbytes for mv in dests[idx.start]))) if idx else 1
        chunks = [range(a, min(a + per, idx.stop)) for a in range(idx.start, idx.stop, per)]
        pool = self._client().connection_pool
        conn = pool.get_connection()
        try:
            if not conn.reads_into:  # RESP3 asked for: whole values, each verified then copied
                return [verify(i, v) for i, v in zip(idx, self._raw_get([keys[i] for i in idx]))]

            def attempt() -> list[Any]:
                conn.send_packed_command(conn.pack_commands([("MGET", *(keys[i] for i in c)) for c in chunks]))
                return [x for c in chunks for x in conn.read_into(_PageSink(c, dests, verify))]
            return conn.retry.call_with_retry(attempt, lambda _e: conn.disconnect())
        finally:
            pool.release(conn)

    def _readers(self) -> ThreadPoolExecutor:
        with self._mu:
            if self._read_pool is None:
                self._read_pool = ThreadPoolExecutor(READ_PARTS - 1, thread_name_prefix=f"hicache-l3-read-{self.name}")
            return self._read_pool

    def _raw_exists(self, keys: list[bytes]) -> list[bool]:
        p = self._pipe()
        for k in keys:
            p.exists(k)
        return [r is not None and not isinstance(r, BaseException) and r > 0
                for r in p.execute(raise_on_error=False)]

    def _raw_delete(self, keys: list[bytes]) -> int:
        p = self._pipe()
        for k in keys:
            p.unlink(k)
        return sum(r for r in p.execute(raise_on_error=False) if isinstance(r, int))

    def _raw_ping(self) -> bool:
        return bool(self._client().ping())

    def _raw_usage(self) -> StorageUsage:
        """INFO memory (every primary of a cluster, summed) and DBSIZE: server-wide
        figures, other data included. Warns once per backend when no maxmemory is set."""
        info = self._memory_info()
        usage = StorageUsage(objects=info["keys"], used_bytes=info["used_memory"],
                             max_bytes=info["maxmemory"] or None, policy=info["maxmemory_policy"], scope="server")
        if not info["maxmemory"]:
            self._warnings.once("maxmemory", "L3 %s: Redis has no maxmemory set, so it grows until the host runs out "
                                "of memory (used_memory=%d bytes now); set maxmemory and maxmemory-policy "
                                "allkeys-lru (docs/storage.md: Operating L3)", self.name, info["used_memory"])
        return usage

    def _memory_info(self) -> dict[str, Any]:
        c = self._client()
        return _server_memory(c.info("memory"), c.dbsize())

    def _raw_keys(self) -> Iterator[bytes]:
        # SCAN (every primary of a cluster) with the prefix as a glob, escaped.
        pattern = re.sub(rb"([*?\[\]\\])", rb"\\\1", self.key_prefix) + b"*"
        return self._client().scan_iter(match=pattern, count=1000)

    def _raw_close(self) -> None:
        with self._mu:
            c, self._client_obj = self._client_obj, None
            pool, self._hash_pool = self._hash_pool, None
            readers, self._read_pool = self._read_pool, None
        for p in (pool, readers):
            if p is not None:
                p.shutdown(wait=True)
        if c is not None:
            c.close()


def _server_memory(info: dict[str, Any], dbsize: Any) -> dict[str, Any]:
    """``INFO memory`` of one server, or of a cluster (``{node: info}``; ``dbsize``
    summed by redis-py), as used_memory / maxmemory (0 when any primary is
    unbounded) / maxmemory_policy / keys."""
    per_node = [v for v in info.values() if isinstance(v, dict)] if "used_memory" not in info else [info]
    caps = [int(n.get("maxmemory", 0)) for n in per_node]
    policies = sorted({str(n.get("maxmemory_policy", "?")) for n in per_node})
    return {"used_memory": sum(int(n.get("used_memory", 0)) for n in per_node),
            "maxmemory": 0 if not caps or 0 in caps else sum(caps),
            "maxmemory_policy": ",".join(policies) or "?",
            "keys": int(dbsize) if isinstance(dbsize, int) else None}


def _put_chunks(items: PutBatch) -> list[range] | None:
    """Consecutive index ranges of >= OVERLAP_CHUNK_BYTES each, or None for one chunk."""
    out, start, acc = [], 0, 0
    for i in range(len(items)):
        acc += items.payload_bytes(i)
        if acc >= OVERLAP_CHUNK_BYTES:
            out.append(range(start, i + 1))
            start, acc = i + 1, 0
    if start < len(items):
        out.append(range(start, len(items)))
    return out if len(out) > 1 else None


def _build_headers(items: PutBatch, idx: range) -> None:
    for i in idx:
        items[i]  # builds and caches the header (reads the whole payload)


class RedisClusterBackend(RedisBackend):
    """A Redis Cluster through redis-py's ``RedisCluster``; its pipelines group
    a batch's commands by node (one round trip per node)."""

    scheme = "redis+cluster"
    DIRECT_IO = False  # an MGET spans one hash slot: gets are pipelined GETs, verified, then copied

    @classmethod
    def from_url(cls, url: str, options: StorageOptions, **cluster_kwargs: Any) -> "RedisClusterBackend":
        """``redis+cluster://`` or ``rediss+cluster://``; ``cluster_kwargs`` go to ``RedisCluster``."""
        scheme, rest = url.split("://", 1)
        userinfo, _, hosts = rest.rpartition("@")
        hosts, _, path = hosts.partition("/")
        if path not in ("", "0"):
            raise ConfigError(f"storage url {redact_url(url)!r}: a cluster has only db 0, got /{path}")
        nodes = []
        for hp in filter(None, hosts.split(",")):
            host, sep, port = hp.rpartition(":")
            if not sep or not host or not port.isdigit():
                raise ConfigError(f"storage url {redact_url(url)!r}: node {hp!r} must be host:port")
            nodes.append(ClusterNode(host.strip("[]"), int(port)))
        if not nodes:
            raise ConfigError(f"storage url {redact_url(url)!r}: list at least one host:port")
        # Passing the first node as a redis:// URL makes RedisCluster build each
        # node's ConnectionPool from the kwargs, which is what lets
        # connection_class (the framed packer) reach the node connections.
        tls = scheme.startswith("rediss")
        first = f"redis://{userinfo + '@' if userinfo else ''}{hosts.split(',')[0]}"
        kw: dict[str, Any] = dict(
            url=first, startup_nodes=nodes[1:], retry=_retry(options), socket_timeout=options.timeout_s,
            socket_connect_timeout=options.timeout_s, require_full_coverage=False,
            connection_class=FramedSSLConnection if tls else FramedConnection)
        kw.setdefault("protocol", 2)  # as in RedisBackend.from_url
        kw.update(cluster_kwargs)
        return cls(options, lambda: RedisCluster(**kw), redact_url(url))

    def _memory_info(self) -> dict[str, Any]:
        c = self._client()
        # Primaries only: a replica holds copies, counting it would double the bytes.
        return _server_memory(c.info("memory", target_nodes=RedisCluster.PRIMARIES),
                              c.dbsize(target_nodes=RedisCluster.PRIMARIES))


