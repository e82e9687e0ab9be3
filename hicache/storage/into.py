"""Reads straight into the caller's buffer: the pieces of ``StorageBackend.get_into``.

A backend's ``_raw_get_into`` answers, per key, what ``_raw_get`` answers (``None``,
an exception, or the whole object, which the base decodes and copies once), or
``InPlace(header)``: the payload was read into the destination itself (file:// with one
``preadv``, redis:// from an MGET) and ``header`` holds what precedes it. Verification
happens in place, in the backend's thread right after each read (``Verifier``), while
the bytes are in that core's cache.

Contract: a destination whose page is reported missing (absent, unreadable, corrupt,
another layout's, a bad MAC, L3 down) may hold garbage; after a call that timed out,
a file:// worker may still finish the one page it was reading (``wait_late_reads``).
Callers treat such a page as free space and never expose it; the adapters report it
as not loaded and zero it (``wipe_unloaded``), the engines recompute it.
"""
from __future__ import annotations
import hmac
from typing import NamedTuple, Sequence
import numpy as np
from hicache.storage import codec
from hicache.storage.codec import Buffer, Decoded, ReadStatus
import logging
import threading
from typing import Iterator
from hicache.core.errors import IntegrityError
from hicache.core.redact import LogLimiter
from typing import Callable


# Beyond this, what precedes the payload is not a header of ours (a header is
# ~100 bytes plus a few per plane): the object is read whole and rejected by decode.
MAX_SPLIT_HEADER = 64 << 10


class InPlace(NamedTuple):
    """The payload lies in the destination; ``header`` is the object's bytes before it."""

    header: Buffer


Dest = Buffer | Sequence[Buffer]  # one buffer, or the payload's segments in order (scatter)


def dest_views(dests: Sequence[Dest], nbytes: int, n_keys: int) -> list[list[memoryview]]:
    """Per destination, its flat writable byte views (segments, in payload order),
    ``nbytes`` in all. Raises ``ValueError`` naming the offending destination
    (misuse, never data)."""
    if len(dests) != n_keys:
        raise ValueError(f"get_into: {n_keys} keys but {len(dests)} destinations")
    out = []
    for i, d in enumerate(dests):
        if type(d) is list and len(d) == 1:  # a page_first L2 page (HostPool.page_buffers): checked in place
            mv = d[0]
            if type(mv) is memoryview and mv.format == "B" and mv.ndim == 1 and not mv.readonly \
                    and mv.nbytes == nbytes:
                out.append(d)
                continue
        segs = [codec.as_bytes_view(x) for x in d] if isinstance(d, (list, tuple)) else [codec.as_bytes_view(d)]
        if any(mv.readonly for mv in segs):
            raise ValueError(f"get_into: destination {i} is read-only; pass a writable buffer (a row, a bytearray)")
        got = sum(mv.nbytes for mv in segs)
        if got != nbytes:
            raise ValueError(f"get_into: destination {i} has {got} bytes, the page payload {nbytes}")
        out.append(segs)
    return out


def scatter(payload: memoryview, segs: list[memoryview]) -> None:
    """Copy a verified payload into a destination's segments."""
    pos = 0
    for mv in segs:
        mv[:] = payload[pos:pos + mv.nbytes]
        pos += mv.nbytes


def header_of(fingerprint: str, page_hash: bytes, t: codec.HeaderTemplate, segs: list[memoryview],
              auth_key: bytes = b"") -> bytes:
    """``codec.encode_header`` of the payload that ``segs`` hold in order (no join)."""
    return codec.header_of_segments(t, page_hash, segs, auth_key)


def verify_into(header: Buffer, segs: list[memoryview], page_hash: bytes, fingerprint: str,
                template: codec.HeaderTemplate, auth_key: bytes = b"") -> ReadStatus | Decoded:
    """Verify an object split as ``header`` + the payload already in ``segs``.

    Fast path: the header is byte for byte what our writer builds for this
    page and these payload bytes (checksum and, with a key, MAC computed over
    the destination); compared in constant time. Anything else (an object of an
    older writer, damage, another layout) is judged by ``codec.decode`` over a
    joined copy, so statuses and reasons are exactly those of ``get``. Returns
    ``ReadStatus.OK`` or the failed ``Decoded``. Never raises on bad data;
    mutates nothing.
    """
    claimed = codec.claimed_checksum(template, page_hash, header) if auth_key else None
    want = codec.header_of_segments(template, page_hash, segs, auth_key, claimed)
    if hmac.compare_digest(header, want):
        return ReadStatus.OK
    d = codec.decode(bytes(header) + b"".join(segs), page_hash, fingerprint, template.sizes, auth_key, template)
    # OK here means decode found the payload at the split point, so ``segs`` hold it.
    return ReadStatus.OK if d.status is ReadStatus.OK else d


def wipe_unloaded(direct_io: bool, dests: Sequence[Buffer | Sequence[Buffer]], got: Sequence[object]) -> int:
    """Zero the destination of each page ``get_into`` did not load (``got[i]`` falsy), so
    what a refused read left there (a bad MAC's payload, a partial object) is not kept.
    Only a ``DIRECT_IO`` store (``direct_io``) reads into destinations before verifying;
    the others copy verified payloads only, so nothing is wiped for them (an outage
    leaves the memory as it was). ``dests``: per page, one writable buffer or a list
    of them. Mutates them; returns the pages wiped."""
    if not direct_io:
        return 0
    n = 0
    for dest, ok in zip(dests, got):
        if ok:
            continue
        for buf in dest if isinstance(dest, (list, tuple)) else (dest,):
            np.frombuffer(buf, dtype=np.uint8)[:] = 0
        n += 1
    return n


class Verifier:
    """Judges what a backend read for page ``i`` of one ``get_into`` call: ``ReadStatus.OK``
    (the payload is in ``views[i]``), the failed ``Decoded``, or what was read when it is
    ``None`` or an exception. Called by the backend's workers, any thread; it writes
    only into ``views[i]`` (the copy of an object read whole)."""

    __slots__ = ("keys", "views", "fingerprint", "template", "auth_key", "header_bytes", "_plain")

    def __init__(self, keys: list[bytes], views: list[list[memoryview]], fingerprint: str,
                 template: codec.HeaderTemplate, auth_key: bytes):
        self.keys, self.views, self.fingerprint = keys, views, fingerprint
        self.template, self.auth_key = template, auth_key
        # What a reader expects before each payload (``codec.header_bytes``); other lengths
        # are read and judged too, by a slower path.
        self.header_bytes = codec.header_bytes(template, bool(auth_key))
        self._plain = codec.PlainHeaders(template)

    def landed(self, i: int, header: Buffer) -> ReadStatus | Decoded:
        """``self(i, InPlace(header))``, the common case of a read: the payload is in
        ``views[i]`` and ``header`` precedes it."""
        segs = self.views[i]
        if not self.auth_key and len(segs) == 1:  # one pass of xxh3, one header built
            ck = codec.checksum(segs[0])
            want = self._plain(self.keys[i], ck) or codec.header_of_digests(self.template, self.keys[i], ck, None)
            if hmac.compare_digest(header, want):
                return ReadStatus.OK
        return verify_into(header, segs, self.keys[i], self.fingerprint, self.template, self.auth_key)

    def __call__(self, i: int, obj: object) -> ReadStatus | Decoded | BaseException | None:
        if obj is None or isinstance(obj, BaseException):
            return obj
        segs = self.views[i]
        if isinstance(obj, InPlace):
            return self.landed(i, obj.header)
        # The whole object (too short or too odd to split): decoded, then one copy.
        d = codec.decode(obj, self.keys[i], self.fingerprint, self.template.sizes, self.auth_key, self.template)
        if d.status is not ReadStatus.OK:
            return d
        scatter(d.payload, segs)  # type: ignore[arg-type]
        return ReadStatus.OK


class ObjectWarnings:
    """A backend's warnings about single calls and objects: per-object problems
    rate-limited (a few lines per kind and minute), per-call kinds once. Thread-safe."""

    def __init__(self, log: logging.Logger):
        self._log = log
        self._limited = LogLimiter(log)
        self._lock = threading.Lock()
        self._warned: set[str] = set()

    def object(self, kind: str, msg: str, *args: object) -> None:
        """A problem with one object (corrupt, unreadable): rate-limited per ``kind``."""
        self._limited.warning(kind, msg, *args)

    def once(self, kind: str, msg: str, *args: object) -> None:
        """A kind of problem worth one line per backend (another layout's objects, a failing call)."""
        with self._lock:
            if kind in self._warned:
                return
            self._warned.add(kind)
        self._log.warning(msg, *args)


class ReadTally:
    """The ``StorageStats`` increments of one read batch, and the corrupt objects'
    full keys (to delete). Logs each problem through ``warnings``. Not thread-safe:
    one per call."""

    __slots__ = ("name", "warnings", "counts", "corrupt_keys")

    def __init__(self, name: str, warnings: ObjectWarnings):
        self.name = name
        self.warnings = warnings
        self.counts = dict(hits=0, misses=0, corrupt=0, fingerprint_mismatch=0, errors=0, bytes_read=0)
        self.corrupt_keys: list[bytes] = []

    def hit(self, nbytes: int) -> None:
        self.counts["hits"] += 1
        self.counts["bytes_read"] += nbytes

    def absent(self) -> None:
        self.counts["misses"] += 1

    def failed(self, full_key: bytes, exc: BaseException) -> None:
        """One item's read raised (e.g. WRONGTYPE: another program's key under our prefix): a miss."""
        self.counts["misses"] += 1
        self.counts["errors"] += 1
        self.warnings.object(f"get:{type(exc).__name__}", "L3 %s: reading object %r failed (%s: %s); counted as "
                             "a miss", self.name, full_key, type(exc).__name__, str(exc)[:200])

    def rejected(self, full_key: bytes, d: codec.Decoded) -> None:
        """An object that did not verify: another layout's (left in place) or corrupt (to delete)."""
        self.counts["misses"] += 1
        if d.status is ReadStatus.FINGERPRINT:
            self.counts["fingerprint_mismatch"] += 1
            self.warnings.once("fingerprint", "L3 %s: object %r belongs to another layout (%s); "
                               "give each layout its own key_prefix", self.name, full_key, d.why)
        else:
            self.counts["corrupt"] += 1
            self.corrupt_keys.append(full_key)
            self.warnings.object("corrupt", "L3 %s: corrupt object %r (%s); deleted, counted as a miss",
                                 self.name, full_key, d.why)


def failing_objects(name: str, scan: Iterator[tuple[bytes, Buffer]], key_prefix: bytes, fingerprint: str,
                    auth_key: bytes) -> list[str]:
    """What is wrong with each listed object of backend ``name`` that does not verify
    (format, fingerprint, key, length, checksum, MAC). Raises ``IntegrityError`` for a
    key outside ``key_prefix``."""
    bad = []
    for fk, obj in scan:
        if not fk.startswith(key_prefix):
            raise IntegrityError(f"L3 backend {name} listed key {fk!r} outside its prefix {key_prefix!r}")
        d = obj if isinstance(obj, Decoded) else codec.decode(obj, fk[len(key_prefix):], fingerprint, None, auth_key)
        if d.status is not ReadStatus.OK:
            bad.append(f"{fk!r}: {d.status.value}: {d.why}")
    return bad


# A page put: (page hash, payload in canonical plane order, plane sizes).
PutItem = tuple[bytes, Buffer, Sequence[int]]
Row = tuple[bytes, bytes, memoryview, codec.PlaneSizes]  # (full key, page hash, payload, plane sizes)


def put_rows(items: Sequence[PutItem], full: Callable[[bytes], bytes]) -> list[Row]:
    """One row per item, its key made full by ``full`` (which checks it). Raises
    ``ValueError`` for a bad key or a payload whose length is not the sum of its plane sizes."""
    rows = []
    last: tuple[object, codec.PlaneSizes | None] = (None, None)
    for key, payload, sizes in items:
        if sizes is not last[0]:  # callers pass one plane-sizes list for a whole batch
            last = (sizes, codec.plane_sizes(sizes))
        mv = codec.as_bytes_view(payload)
        codec.check_length(mv, last[1])
        rows.append((full(key), key, mv, last[1]))
    return rows


class PutBatch(Sequence[tuple[bytes, bytes, memoryview]]):
    """``(full key, header, payload)`` per page, the header built on first access.

    Building a header reads the whole payload (checksum); a backend that
    handles pages one by one (file) builds it just before writing the payload,
    while the payload is still in cache. Headers are kept once built.
    """

    __slots__ = ("_fingerprint", "_rows", "_headers", "_auth_key", "_templates")

    def __init__(self, fingerprint: str, rows: list[Row], auth_key: bytes = b""):
        self._fingerprint = fingerprint
        self._auth_key = auth_key
        self._rows = rows  # (full key, page hash, payload, plane sizes), lengths already checked
        self._headers: list[bytes | None] = [None] * len(rows)
        self._templates: dict[int, codec.HeaderTemplate] = {}  # per plane-sizes object (one per batch, usually)

    def __len__(self) -> int:
        return len(self._rows)

    def payload_bytes(self, i: int) -> int:
        """Payload size of page ``i`` (builds no header)."""
        return self._rows[i][2].nbytes

    def __getitem__(self, i):  # type: ignore[override]
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        row = self._rows[i]
        return row[0], self.header(i), row[2]

    def key_payload(self, i: int) -> tuple[bytes, memoryview]:
        """Full key and payload of page ``i`` (builds no header)."""
        row = self._rows[i]
        return row[0], row[2]

    def header_ahead(self, i: int, nbytes: int) -> bytes:
        """Page ``i``'s header; if it is not built yet, the headers of the pages
        after it are built with it, up to ``nbytes`` of payload in all (a group
        that the send following it still finds in cache)."""
        if self._headers[i] is None:
            acc, j = 0, i
            while j < len(self._rows) and acc < nbytes:
                self.header(j)
                acc += self._rows[j][2].nbytes
                j += 1
        return self.header(i)

    def header(self, i: int) -> bytes:
        """Page ``i``'s header, built (checksum over the payload) on the first call."""
        hdr = self._headers[i]
        if hdr is None:
            _, key, mv, sizes = self._rows[i]
            t = self._templates.get(id(sizes))
            if t is None:
                t = self._templates[id(sizes)] = codec.header_template(self._fingerprint, sizes)
            hdr = self._headers[i] = codec.encode_header(self._fingerprint, key, sizes, mv, self._auth_key, t)
        return hdr
