"""``StorageBackend``: the L3 interface, with verification and failure handling
done once here; a backend only implements a handful of raw batch primitives.

Concurrency model: synchronous calls, safe to make from several threads (the
tier controller calls from a worker thread). Counters and outage state sit
behind one lock; raw I/O runs outside it.

Failure model: L3 is a cache. Raw primitives raise the backend's
``OUTAGE_ERRORS`` when L3 is unreachable or slow; the base turns that into
misses / ``False`` / 0 and dropped writes, logs one warning per outage, and
opens a circuit breaker: every call then answers at once, without touching
the network, while a background thread pings L3 with redis-py's
``ExponentialBackoff`` (up to ``probe_max_ms`` apart). The first ping that
succeeds closes the circuit; callers never probe a dead L3 themselves. Only
misuse (a key that is not a 16-byte page hash, a payload that does not match
its plane sizes) raises, as ``ValueError``.

Bounded lookups: ``prefix_hits(keys, budget_s=...)`` runs on a worker
thread and answers 0 (a miss) when L3 has not answered within ``budget_s``;
the late answer is discarded. A scheduler passes its prefetch policy's
budget, so a slow L3 never holds a scheduler step longer than the policy
allows.

Pieces beside it: ``capacity`` (``StorageOptions`` and the byte cap), ``health``
(the circuit breaker and probe backoff), and ``into`` (what ``_raw_put`` receives,
reads into the caller's buffers, and judging what a read brought back).
"""
from __future__ import annotations

import abc
import concurrent.futures
import dataclasses
import logging
import threading
from typing import Any, Callable, ClassVar, Iterator, Sequence

from hicache.core.errors import IntegrityError, StorageError
from hicache.core.hashing import HASH_BYTES
from hicache.core.stats import StorageStats
from hicache.storage import codec, into
from hicache.storage.capacity import StorageUsage
from hicache.storage.codec import Buffer, ReadStatus
from hicache.storage.health import DOWN, Health
from hicache.storage.capacity import StorageOptions
from hicache.storage.into import PutBatch, PutItem, put_rows
from hicache.storage.into import ObjectWarnings, ReadTally, failing_objects

log = logging.getLogger(__name__)


class StorageBackend(abc.ABC):
    """One L3 store. Keys are 16-byte page hashes; values are verified page payloads.

    Subclasses implement the ``_raw_*`` primitives on full keys
    (``key_prefix + page hash``) and list the exceptions that mean "L3 is
    down" in ``OUTAGE_ERRORS`` and those that fail only one call in
    ``CALL_ERRORS``. A primitive may return an exception instance in place of
    one item's result to fail that item only.
    """

    scheme: ClassVar[str] = ""
    OUTAGE_ERRORS: ClassVar[tuple[type[BaseException], ...]] = (OSError,)
    CALL_ERRORS: ClassVar[tuple[type[BaseException], ...]] = ()
    PREFIX_CHUNK: ClassVar[int] = 8  # first prefix_hits() batch; grows 4x up to 256
    # prefix_hits(budget_s=...) hops to a worker thread only where a call can
    # block on another machine; in-process and local-file stores answer inline
    # (deterministic, and the file store bounds its own I/O).
    BOUNDED_LOOKUPS: ClassVar[bool] = True
    # The backend implements _raw_get_into (reads payloads into the caller's
    # buffers) and _raw_put_new (skips present objects itself, one call); others
    # get get_into / put_new built on get / exists + put.
    DIRECT_IO: ClassVar[bool] = False

    def __init__(self, options: StorageOptions, name: str):
        self.options = options
        self.fingerprint = options.fingerprint
        self.key_prefix = options.key_prefix
        self.name = name
        self._lock = threading.Lock()
        self._stats = StorageStats()
        # StorageStats.errors split by operation (get, put, exists, delete, scan, ping); the
        # keys are those fixed op names, so the dict stays small. Sums to stats.errors.
        self._op_errors: dict[str, int] = {}
        self._health = Health(name, options.probe_max_ms, options.timeout_s)
        self._closed = False
        self._warnings = ObjectWarnings(log)  # per-object: rate-limited; per kind of call problem: once
        self._wake = threading.Event()  # set by close(): the pinger stops
        self._lookups: concurrent.futures.ThreadPoolExecutor | None = None  # bounded prefix_hits
        self._lookup_busy = False
        self._inflight: dict[int, float] = {}  # raw calls in progress: id -> start (health clock)
        self._next_call = 0

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r}, prefix={self.key_prefix!r})"

    # ------------------------------------------------------------ primitives
    @abc.abstractmethod
    def _raw_get(self, keys: list[bytes]) -> list[Buffer | None | BaseException | codec.Decoded]:
        """Per key the stored object, None when absent, an exception when its read failed,
        or a ``codec.Decoded`` when the backend refused it unread (judged by its header)."""

    def _raw_get_sized(self, keys: list[bytes], payload_bytes: int) -> list[Any]:
        """``_raw_get`` told the payload size every object must have: a backend that can size
        an object before reading it refuses one of another size unread (a ``Decoded``)."""
        return self._raw_get(keys)

    @abc.abstractmethod
    def _raw_put(self, items: "PutBatch") -> list[bool | BaseException]:
        """Store ``header + payload`` under each full key; the payload must not be kept."""

    @abc.abstractmethod
    def _raw_exists(self, keys: list[bytes]) -> list[bool]: ...

    @abc.abstractmethod
    def _raw_delete(self, keys: list[bytes]) -> int: ...

    @abc.abstractmethod
    def _raw_ping(self) -> bool: ...

    @abc.abstractmethod
    def _raw_close(self) -> None: ...

    def _raw_scan(self) -> Iterator[tuple[bytes, Buffer]] | None:
        """Every stored (full key, object) under our prefix, or None if the backend cannot list."""
        return None

    def _raw_usage(self) -> StorageUsage | None:
        """What the store holds now, or None if the backend cannot tell."""
        return None

    def _raw_keys(self) -> Iterator[bytes] | None:
        """Every stored full key under our prefix, or None if the backend cannot list.

        The default walks ``_raw_scan``; backends that can list keys without
        reading objects override it.
        """
        scan = self._raw_scan()
        return None if scan is None else (k for k, _ in scan)

    # --------------------------------------------------------------- plumbing
    def _full(self, key: bytes) -> bytes:
        if type(key) is not bytes or len(key) != HASH_BYTES:
            raise ValueError(f"L3 key {key!r}: must be a {HASH_BYTES}-byte page hash from hicache.core.hashing")
        return self.key_prefix + key

    def _count(self, op: str = "", **deltas: int) -> None:
        with self._lock:
            s = self._stats
            for k, v in deltas.items():
                setattr(s, k, getattr(s, k) + v)
            if deltas.get("errors"):
                self._op_error(op, deltas["errors"])

    def _op_error(self, op: str, n: int = 1) -> None:
        """Attribute ``n`` errors to ``op`` (caller holds the lock and counts ``stats.errors`` itself)."""
        self._op_errors[op] = self._op_errors.get(op, 0) + n

    def _call(self, op: str, fn: Callable[..., Any], *args: Any, probe: bool = False) -> Any:
        """Run one raw primitive; ``DOWN`` when skipped (outage) or failed."""
        with self._lock:
            if self._closed or (not probe and not self._health.allow()):
                return DOWN
            call = self._next_call
            self._next_call += 1
            self._inflight[call] = self._health.clock()
        try:
            out = self._timed(call, fn, *args)
        except self.OUTAGE_ERRORS as e:
            with self._lock:
                self._stats.errors += 1
                self._op_error(op)
                opened = self._health.failed(op, e)
            if opened:
                threading.Thread(target=self._ping_until_up, name=f"hicache-l3-ping-{self.name}",
                                 daemon=True).start()
            return DOWN
        except self.CALL_ERRORS as e:
            self._count(op, errors=1)
            self._warnings.once(f"{op}:{type(e).__name__}", "L3 %s: %s failed: %s: %s (further such "
                                "failures are only counted)", self.name, op, type(e).__name__, e)
            return DOWN
        with self._lock:
            if self._health.succeeded():
                self._stats.reconnects += 1
        return out

    def _timed(self, call: int, fn: Callable[..., Any], *args: Any) -> Any:
        try:
            return fn(*args)
        finally:
            with self._lock:
                del self._inflight[call]

    def stalled(self) -> bool:
        """L3 is not answering now: the circuit is open, or (a store on another
        machine, ``BOUNDED_LOOKUPS``) a call has been waiting longer than one
        attempt's timeout (``timeout_ms``, the socket timeout), i.e. it is failing
        or retrying against an L3 that stopped answering (a SIGSTOPped Redis)
        before the circuit opened. In-process and local-file stores bound their
        own calls, and only an open circuit counts. Pure; any thread. A scheduler
        stops waiting for L3 work when this turns True (``HiCache.drain``)."""
        with self._lock:
            if self._health.down:
                return True
            if not self._inflight or not self.BOUNDED_LOOKUPS:
                return False
            oldest = min(self._inflight.values())
            return self._health.clock() - oldest > self.options.timeout_s

    def _ping_until_up(self) -> None:
        """The circuit breaker's probe: ping on the backoff schedule until L3 answers (or close)."""
        while True:
            with self._lock:
                if self._closed or not self._health.down:
                    return
                wait = max(0.0, self._health.probe_at - self._health.clock())
            if self._wake.wait(wait):
                return
            try:
                ok, exc = bool(self._raw_ping()), None
            except (*self.OUTAGE_ERRORS, *self.CALL_ERRORS) as e:
                ok, exc = False, e
            with self._lock:
                if self._closed:
                    return
                if ok:
                    if self._health.succeeded():
                        self._stats.reconnects += 1
                    return
                self._stats.errors += 1
                self._op_error("ping")
                self._health.failed("ping", exc or ConnectionError("ping answered False"))

    # ------------------------------------------------------------ public API
    def get(self, keys: Sequence[bytes], plane_sizes: Sequence[int]) -> list[memoryview | None]:
        """Verified payloads of ``keys`` (``None`` for a miss), in key order.

        Does not mutate stored data except that objects found corrupt are
        deleted. A returned memoryview is a read-only view the caller owns: it
        stays valid for as long as it is referenced, whatever happens to L3.
        """
        full = [self._full(k) for k in keys]
        if not full:
            return []
        sizes = codec.plane_sizes(plane_sizes)
        raw = self._call("get", self._raw_get_sized, full, sizes.total)
        if raw is DOWN:
            self._count(gets=len(full), misses=len(full))
            return [None] * len(full)
        if len(raw) != len(full):
            raise StorageError(f"L3 backend {self.name}: get of {len(full)} keys returned {len(raw)} results")
        template = codec.header_template(self.fingerprint, sizes)
        out: list[memoryview | None] = []
        tally = ReadTally(self.name, self._warnings)
        for key, fk, obj in zip(keys, full, raw):
            if isinstance(obj, codec.Decoded):  # refused before it was read whole (a size its header denies)
                tally.rejected(fk, obj)
                out.append(None)
                continue
            if obj is None or isinstance(obj, BaseException):
                if obj is None:
                    tally.absent()
                else:  # e.g. WRONGTYPE: another program's key under our prefix
                    tally.failed(fk, obj)
                out.append(None)
                continue
            d = codec.decode(obj, key, self.fingerprint, sizes, self.options.auth_key, template)
            if d.status is ReadStatus.OK:
                tally.hit(d.payload.nbytes)
                out.append(d.payload.toreadonly())
            else:
                tally.rejected(fk, d)
                out.append(None)
        self._settle_read(len(full), tally)
        return out

    def _settle_read(self, asked: int, tally: ReadTally) -> None:
        """Count one read batch and delete the corrupt objects it found."""
        self._count("get", gets=asked, **tally.counts)
        if tally.corrupt_keys:
            self._call("delete", self._raw_delete, tally.corrupt_keys)

    def get_into(self, keys: Sequence[bytes], plane_sizes: Sequence[int], dests: Sequence[into.Dest]) -> list[bool]:
        """Read each page's verified payload straight into ``dests[i]``; per key, whether it did.

        ``dests``: per page a writable contiguous buffer of exactly the payload's
        bytes (an engine's row), or a list of such buffers that the payload fills
        in order (a host pool's K and V segments). Counts and deletes corrupt
        objects like ``get``. A page answered ``False`` may have left garbage
        in its destination (see ``hicache.storage.into``): never use it. Raises
        ``ValueError`` for a bad key or destination (count, size, read-only).
        """
        return self._get_into(keys, plane_sizes, dests, self._raw_get_into)

    def get_into_settled(self, keys: Sequence[bytes], plane_sizes: Sequence[int],
                         dests: Sequence[into.Dest]) -> list[bool]:
        """``get_into`` for a caller that reuses a page answered ``False`` at once (L2 pages:
        ``TransferController.storage_get``, the node's L3 tier): returns only once no read of
        the call can land in ``dests`` any more, i.e. ``get_into`` then ``wait_late_reads``.
        A call over its budget still counts as an outage (when it returns); a store that hangs
        holds the caller as long as it hangs. Since the caller waits anyway, a backend may read
        on the calling thread (file://: no hand-off to a worker, which on a loaded box cost more
        than the read). Same answers, counters and ``ValueError`` as ``get_into``."""
        return self._get_into(keys, plane_sizes, dests, self._raw_get_into_settled)

    def _get_into(self, keys: Sequence[bytes], plane_sizes: Sequence[int], dests: Sequence[into.Dest],
                  raw: Callable[..., list[Any]]) -> list[bool]:
        sizes = codec.plane_sizes(plane_sizes)
        views = into.dest_views(dests, sizes.total, len(keys))
        if not self.DIRECT_IO:  # verified by get(), then one copy (a Redis reply, a service page)
            payloads = self.get(keys, plane_sizes)
            for segs, payload in zip(views, payloads):
                if payload is not None:
                    into.scatter(payload, segs)
            return [p is not None for p in payloads]
        full = [self._full(k) for k in keys]
        if not full:
            return []
        verify = into.Verifier(list(keys), views, self.fingerprint, codec.header_template(self.fingerprint, sizes),
                               self.options.auth_key)
        judged = self._call("get", raw, full, views, verify)
        if judged is DOWN:
            self._count(gets=len(full), misses=len(full))
            return [False] * len(full)
        if len(judged) != len(full):
            raise StorageError(f"L3 backend {self.name}: get_into of {len(full)} keys returned {len(judged)} results")
        return self._tally_into(full, judged, sizes.total)

    def wait_late_reads(self, timeout: float | None = None) -> bool:
        """Block until no ``get_into`` this backend gave up on (a timeout: its pages were
        answered ``False``) can still write into its destinations; True once none can,
        False when ``timeout`` passed first. A caller that reuses a page answered ``False``
        for other data calls it first (L2 pages). Immediate where reads land only on the
        caller's thread (every store but ``DIRECT_IO`` ones that read on workers)."""
        return True

    def _raw_get_into(self, keys: list[bytes], dests: list[list[memoryview]],
                      verify: "into.Verifier") -> list[Any]:
        """``DIRECT_IO`` backends: per key ``verify(i, what was read)``, called in the
        thread that read it right after the read (its bytes still in cache), where what
        was read is ``None``, an exception, the whole object, or ``into.InPlace`` when
        the payload was read into ``dests[i]``'s segments."""
        raise NotImplementedError(f"{type(self).__name__} sets DIRECT_IO but does not implement _raw_get_into")

    def _raw_get_into_settled(self, keys: list[bytes], dests: list[list[memoryview]],
                              verify: "into.Verifier") -> list[Any]:
        """``_raw_get_into`` that returns (or raises) only once none of its reads can still
        land (``get_into_settled``)."""
        try:
            return self._raw_get_into(keys, dests, verify)
        finally:
            self.wait_late_reads()

    def _tally_into(self, full: list[bytes], judged: list[ReadStatus | codec.Decoded | BaseException | None],
                    nbytes: int) -> list[bool]:
        tally = ReadTally(self.name, self._warnings)
        for fk, d in zip(full, judged):
            if d is ReadStatus.OK:
                tally.hit(nbytes)
            elif isinstance(d, BaseException):
                tally.failed(fk, d)
            elif isinstance(d, codec.Decoded):
                tally.rejected(fk, d)
            else:
                tally.absent()
        self._settle_read(len(full), tally)
        return [d is ReadStatus.OK for d in judged]

    def put_new(self, items: Sequence[PutItem]) -> list[bool]:
        """Store the pages L3 does not hold yet, in one call to L3 (one hand-off to
        the file worker); per item, whether L3 holds it afterwards.

        Like ``put``, minus the rewrite of pages already stored (``exists``
        semantics: present, not verified). Pages skipped as present count as
        neither ``put_ok`` nor ``put_dropped``. All ``False`` while L3 is down.
        """
        if not self.DIRECT_IO:  # two calls: exists, then put of the rest
            items = list(items)
            present = self.exists([k for k, _, _ in items])
            todo = [i for i, p in enumerate(present) if not p]
            if todo and self.put([items[i] for i in todo]) != len(todo):
                return self.exists([k for k, _, _ in items])
            return [True] * len(items)
        rows = put_rows(items, self._full)
        if not rows:
            return []
        prepared = PutBatch(self.fingerprint, rows, self.options.auth_key)
        res = self._call("put", self._raw_put_new, prepared)
        if res is DOWN:
            self._count(put_dropped=len(prepared))
            return [False] * len(prepared)
        if len(res) != len(prepared):
            raise StorageError(f"L3 backend {self.name}: put_new of {len(prepared)} objects returned {len(res)} results")
        wrote = [r for r in res if r is not None]
        failed = [r for r in wrote if isinstance(r, BaseException)]
        if failed:
            self._warnings.once(f"put:{type(failed[0]).__name__}", "L3 %s: put of a page failed: %r "
                                "(further such failures are only counted)", self.name, failed[0])
        stored = sum(r is True for r in wrote)
        self._count("put", put_ok=stored, put_dropped=len(wrote) - stored, errors=len(failed),
                    bytes_written=sum(r[2].nbytes for r, x in zip(rows, res) if x is True))
        return [r is None or r is True for r in res]

    def _raw_put_new(self, items: "PutBatch") -> list[bool | BaseException | None]:
        """``DIRECT_IO`` backends: per item ``None`` when already present (not written),
        else what ``_raw_put`` answers for it."""
        raise NotImplementedError(f"{type(self).__name__} sets DIRECT_IO but does not implement _raw_put_new")

    def put(self, items: Sequence[PutItem]) -> int:
        """Store pages ``(page hash, payload, plane sizes)``; returns how many were stored.

        Overwrites existing objects. The payload is read during the call only.
        Drops (and counts) what L3 cannot take; raises ``ValueError`` only for
        a bad key or a payload whose length is not the sum of its plane sizes.
        """
        rows = put_rows(items, self._full)
        if not rows:
            return 0
        prepared = PutBatch(self.fingerprint, rows, self.options.auth_key)
        res = self._call("put", self._raw_put, prepared)
        if res is DOWN:
            self._count(put_dropped=len(prepared))
            return 0
        if len(res) != len(prepared):
            raise StorageError(f"L3 backend {self.name}: put of {len(prepared)} objects returned {len(res)} results")
        ok = [r is True for r in res]
        failed = [r for r in res if isinstance(r, BaseException)]
        if failed:
            self._warnings.once(f"put:{type(failed[0]).__name__}", "L3 %s: put of a page failed: %r "
                                "(further such failures are only counted)", self.name, failed[0])
        stored = sum(ok)
        self._count("put", put_ok=stored, put_dropped=len(ok) - stored, errors=len(failed),
                    bytes_written=sum(r[2].nbytes for r, good in zip(rows, ok) if good))
        return stored

    def exists(self, keys: Sequence[bytes]) -> list[bool]:
        """Whether each key is stored (not verified: ``get`` verifies). All False when L3 is down."""
        full = [self._full(k) for k in keys]
        if not full:
            return []
        res = self._call("exists", self._raw_exists, full)
        return [False] * len(full) if res is DOWN else [bool(r) for r in res]

    def prefix_hits(self, keys: Sequence[bytes], budget_s: float | None = None) -> int:
        """How many leading keys are stored; stops at the first absent one.

        Keys are chained page hashes, so the answer is the L3 prefix hit in
        pages. Asks in growing batches so a short hit costs one round trip.
        ``budget_s``: answer 0 unless L3 answers within it (the lookup runs
        on a worker thread; one at a time, a second meanwhile answers 0).
        """
        full = [self._full(k) for k in keys]
        if budget_s is None or not full or not self.BOUNDED_LOOKUPS:
            return self._prefix_hits(full)
        with self._lock:
            if self._closed or not self._health.allow():
                return 0
            if self._lookup_busy:
                self._stats.lookup_timeouts += 1
                return 0
            self._lookup_busy = True
            if self._lookups is None:
                self._lookups = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="hicache-l3-lookup")
            pool = self._lookups
        try:
            fut = pool.submit(self._prefix_hits_then_free, full)
        except RuntimeError:  # closed in between
            with self._lock:
                self._lookup_busy = False
            return 0
        try:
            return fut.result(max(0.0, budget_s))
        except concurrent.futures.TimeoutError:
            self._count(lookup_timeouts=1)
            return 0

    def _prefix_hits_then_free(self, full: list[bytes]) -> int:
        try:
            return self._prefix_hits(full)
        finally:
            with self._lock:
                self._lookup_busy = False

    def _prefix_hits(self, full: list[bytes]) -> int:
        done, chunk = 0, self.PREFIX_CHUNK
        while done < len(full):
            res = self._call("exists", self._raw_exists, full[done:done + chunk])
            if res is DOWN:
                return done
            for r in res:
                if not r:
                    return done
                done += 1
            chunk = min(chunk * 4, 256)
        return done

    def delete(self, keys: Sequence[bytes]) -> int:
        """Delete objects; returns how many existed (0 when L3 is down)."""
        full = [self._full(k) for k in keys]
        if not full:
            return 0
        res = self._call("delete", self._raw_delete, full)
        return 0 if res is DOWN else int(res)

    def clear(self) -> int | None:
        """Delete every object under this backend's key prefix (this layout's pages only).

        Returns how many were deleted (0 when L3 is down), or None when the
        backend cannot list its keys. Other layouts' objects are untouched.
        """
        keys = self._call("scan", lambda: None if (it := self._raw_keys()) is None else list(it), probe=True)
        if keys is DOWN:
            return 0
        if keys is None:
            return None
        n = 0
        for i in range(0, len(keys), 512):
            res = self._call("delete", self._raw_delete, keys[i:i + 512])
            n += 0 if res is DOWN else int(res)
        return n

    def usage(self) -> StorageUsage | None:
        """Bytes and objects the store holds now and its cap (see ``StorageUsage``);
        None when the backend cannot tell or L3 is down. Mutates nothing. Cheap
        enough for every ``/v1/stats`` call (a ledger read, one Redis INFO)."""
        out = self._call("usage", self._raw_usage)
        return None if out is DOWN else out

    def ping(self) -> bool:
        """True when L3 answers now. Always tries (ignores the probe schedule)."""
        return self._call("ping", self._raw_ping, probe=True) is True

    @property
    def down(self) -> bool:
        """True while an outage is in progress (calls answer misses at once)."""
        return self._health.down

    def stats(self) -> StorageStats:
        """A snapshot copy of the counters."""
        with self._lock:
            return dataclasses.replace(self._stats)

    def errors_by_op(self) -> dict[str, int]:
        """``stats().errors`` split by operation (``get``, ``put``, ``exists``, ``delete``,
        ``scan``, ``ping``): a copy; only operations that failed appear."""
        with self._lock:
            return dict(self._op_errors)

    def close(self) -> None:
        """Release connections / handles. Later calls answer misses; idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            pool, self._lookups = self._lookups, None
        self._wake.set()
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)
        self._raw_close()

    def check_integrity(self) -> None:
        """Counters agree; where the backend can list its objects, every one
        verifies (format, fingerprint, key, length, checksum). Raises ``IntegrityError``."""
        with self._lock:
            stats, by_op = dataclasses.replace(self._stats), dict(self._op_errors)
        stats.check()
        if sum(by_op.values()) != stats.errors:
            raise IntegrityError(f"L3 {self.name}: errors by operation {by_op} do not sum to errors={stats.errors}")
        scan = None if self._closed else self._raw_scan()
        if scan is None:
            return
        bad = failing_objects(self.name, scan, self.key_prefix, self.fingerprint, self.options.auth_key)
        if bad:
            raise IntegrityError(f"L3 {self.name}: {len(bad)} stored object(s) fail verification: "
                                 + "; ".join(bad[:5]))

    def __enter__(self) -> "StorageBackend":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
