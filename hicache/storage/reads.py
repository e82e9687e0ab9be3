"""Judging what a read brought back: the counts of one read batch, the warnings
about single objects, and the check of every stored object.

``StorageBackend.get`` and ``get_into`` hand each object's verdict (absent, a
per-item error, verified, another layout's, corrupt) to a ``ReadTally``; the
backend then adds its counts to ``StorageStats`` and deletes the corrupt
objects it collected.
"""
from __future__ import annotations

import logging
import threading
from typing import Iterator

from hicache.core.errors import IntegrityError
from hicache.core.ratelimit import LogLimiter
from hicache.storage import codec
from hicache.storage.codec import Buffer, ReadStatus


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
        d = codec.decode(obj, fk[len(key_prefix):], fingerprint, None, auth_key)
        if d.status is not ReadStatus.OK:
            bad.append(f"{fk!r}: {d.status.value}: {d.why}")
    return bad
