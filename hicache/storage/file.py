"""``file:///abs/dir`` and ``file://./rel/dir``: one file per page on a local
(or shared) file system; the embedded default, survives restarts.

Path of a page: ``<dir>/<prefix dir>/<hash[0:2]>/<hash hex>`` where the prefix
dir is the key prefix with ``:`` turned into ``-`` (``hicache-1a2b3c4d``), so
layouts never share files. Writes go to a temp file in the same directory
(header and payload with one ``writev``, never joined in memory) and are
``os.replace``d into place, so a reader sees a whole old object, a whole new
one, or none; a crash leaves at most a ``*.tmp.*`` file behind, which readers
ignore. ``fsync=True`` also makes a written page survive power loss.

Safety against other local users who can write the directory: temp files
are created with ``O_CREAT | O_EXCL | O_NOFOLLOW`` under a random name (a
symlink planted at a temp name is never followed), fan-out directories must
be real directories, and objects are opened with ``O_NOFOLLOW | O_NONBLOCK``
(a FIFO, directory or device at an object path is a counted error or a
corrupt object, never a hang). A read never sizes a buffer from a file's size
alone: ``get_into`` reads at most a page and ``MAX_SPLIT_HEADER``, ``get`` an
object whose size its header and the page's planes declare (else it is corrupt,
unread). Every batch runs on the worker threads
(a batch of large pages split among them, as many as the load leaves cores for,
each page hashed by the worker that read or wrote it)
and the caller waits at most ``health.call_budget``: ``timeout_ms`` per page
plus the bytes at a slow disk's rate, times ``1 + max_retries``, scaled by the
load average: a hung file system turns into an outage, a loaded box does not.

Byte cap (``max_bytes``, 0 = unbounded; ``storage.max_bytes``): the whole
root directory (every layout in it, every process writing it) stays at most
``max_bytes`` once each put has returned, through a ledger shared by the
processes and trims that delete the oldest objects (``hicache.storage.file_cap``).
``eviction="lru"`` refreshes an object's mtime when it is read, ``"fifo"``
does not. The put that crosses the cap pays the trim (a directory scan), on
the caller's thread (the L3 worker's, never the scheduler's), outside the
per-call I/O deadline. A put's bytes are accounted by the worker that wrote
them, so a put whose caller stopped waiting still counts (and trims).
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import os
import re
import secrets
import stat
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator

from hicache.core.errors import ConfigError, IntegrityError
from hicache.core.hashing import HASH_BYTES
from hicache.core.redact import redact_url
from hicache.storage.base import StorageBackend
from hicache.storage.capacity import StorageOptions
from hicache.storage.into import PutBatch
from hicache.storage.capacity import StorageUsage, check_eviction
from hicache.storage import codec
from hicache.storage.codec import HEAD_BYTES, Buffer, Decoded, ReadStatus
from hicache.storage.file_cap import FileCap, scan
from hicache.storage.file_cap import FilePerms
from hicache.storage.health import FLOOR_BYTES_PER_S, LoadFactor, _cpus, call_budget
from hicache.storage.into import MAX_SPLIT_HEADER, InPlace, Verifier

_TMP = ".tmp."
# Worker threads for file I/O (syscalls and hashing release the GIL). 4 lets
# vLLM's and SGLang's several I/O threads overlap on a page cache / tmpfs; more
# bought nothing on the 2-core dev box (bench/RESULTS.md, file:// I/O workers).
IO_WORKERS = 4
IOV_MAX = 1024  # Linux's limit on buffers per preadv; more segments take several calls
USAGE_SCAN_S = 30.0
LATE_WAIT_S = 30.0  # check_integrity waits this long at most for calls still on the workers  # unbounded directories: how long one usage() scan is reused
# Calls of at least this many payload bytes per worker are split among the
# workers, each reading (or writing) and hashing its pages while they are hot.
SPLIT_MIN_BYTES = 1 << 20
_HEX_NAME = re.compile(r"^[0-9a-f]{%d}$" % (2 * HASH_BYTES))


def parse_file_url(url: str) -> Path:
    """``file:///abs`` -> ``/abs``; ``file://./rel`` or ``file://rel`` -> ``rel``."""
    rest = url.split("://", 1)[1]
    if not rest:
        raise ConfigError(f"storage url {redact_url(url)!r}: needs a directory, e.g. file:///var/cache/hicache "
                          "or file://./.hicache/l3")
    if rest.startswith("localhost/"):
        rest = rest[len("localhost"):]
    return Path(rest)


class FileBackend(StorageBackend):
    scheme = "file"
    BOUNDED_LOOKUPS = False  # its own per-page deadline bounds a hung file system
    DIRECT_IO = True  # preadv into the caller's rows; puts skip present files in the same hand-off

    def __init__(self, options: StorageOptions, root: str | os.PathLike, *, fsync: bool = False,
                 name: str = "", max_bytes: int = 0, eviction: str = "lru", group: str = ""):
        super().__init__(options, name or f"file://{root}")
        prefix_dir = re.sub(r"[^A-Za-z0-9_.-]", "-", options.key_prefix.decode("utf-8", "replace")).strip("-.")
        self.root = Path(root)
        self.dir = self.root / (prefix_dir or "default")
        self.fsync = bool(fsync)
        self._perms = FilePerms.of(group, self.name)
        self._dir_s, self._prefix_len = os.fspath(self.dir), len(options.key_prefix)
        try:
            self._perms.make_dir(self.root)
            self._perms.make_dir(self.dir, tighten=True)
        except OSError as e:
            raise ConfigError(f"storage url {self.name!r}: cannot create directory {e.filename or str(self.dir)!r} "
                              f"({e.strerror or e}); pick a writable directory, or share the store with "
                              "storage.file_group") from None
        self._made: set[str] = set()  # fan-out directories known to exist
        self._mu = threading.Lock()
        # IO_WORKERS workers: independent calls (an engine's several I/O threads)
        # overlap; each page is written to a private temp file and renamed, and
        # read through one descriptor, so calls never share mutable state but the
        # fan-out set (under _mu) and the cap's ledger (flock). Calls stuck in
        # the kernel keep their workers; once all are stuck, later calls fail
        # their deadline (an outage), as with one worker.
        self._pool = concurrent.futures.ThreadPoolExecutor(IO_WORKERS, thread_name_prefix="hicache-file-l3")
        self._pending = 0  # worker tasks not finished, late ones included (under _mu)
        self._idle = threading.Condition(self._mu)
        self._late_parts = 0  # parts of calls given up, still running (a read may still land)
        self._load = LoadFactor()
        if not isinstance(max_bytes, int) or isinstance(max_bytes, bool) or max_bytes < 0:
            raise ConfigError(f"storage url {self.name!r}: max_bytes={max_bytes!r} must be an integer >= 0 "
                              "(0 = unbounded)")
        self.max_bytes = max_bytes
        self.eviction = check_eviction(eviction, f"storage url {self.name!r}:")
        self._cap = FileCap(self.root, max_bytes, self._perms.gid) if max_bytes else None
        self._scanned: tuple[float, StorageUsage] | None = None  # unbounded: the last usage scan
        if self._cap is not None:
            self._trim()  # a cap lowered since the last run holds from the start

    @classmethod
    def from_url(cls, url: str, options: StorageOptions, **opts) -> "FileBackend":
        return cls(options, parse_file_url(url), name=redact_url(url), **opts)

    # ------------------------------------------------------------------ paths
    def _path(self, full_key: bytes) -> tuple[str, str]:
        h = full_key[self._prefix_len:].hex()
        d = f"{self._dir_s}/{h[:2]}"  # (os.path.join per page was a third of a 16 KiB read's Python time)
        return d, f"{d}/{h}"

    def _ensure_dir(self, d: str, again: bool = False) -> None:
        if again or d not in self._made:
            self._perms.make_dir(Path(d))
            if not stat.S_ISDIR(os.lstat(d).st_mode):  # a symlink planted in place of a fan-out dir
                raise NotADirectoryError(f"{d} is not a directory (a symlink?); refusing to write through it")
            with self._mu:
                self._made.add(d)

    def _budget(self, n: int, nbytes: int) -> float:
        """How long a call of ``n`` pages and ``nbytes`` waits before it counts as an outage."""
        return call_budget(self.options.timeout_s, self.options.max_retries, n, nbytes, self._load())

    def _deadline(self, fn, n: int, *args):
        """``fn(*args)`` on the worker thread, waiting at most ``_budget(n, 0)``.

        Raises ``TimeoutError`` (an outage for the base class) when it takes longer.
        """
        budget = self._budget(n, 0)
        fut = self._submit(fn, *args)
        try:
            return fut.result(budget)
        except concurrent.futures.TimeoutError:
            raise self._late(budget) from None

    def _submit(self, fn, *args) -> concurrent.futures.Future:
        with self._mu:
            self._pending += 1
        try:
            fut = self._pool.submit(fn, *args)
        except RuntimeError:  # closed
            self._task_done()
            raise
        fut.add_done_callback(self._task_done)
        return fut

    def _task_done(self, _fut: Any = None) -> None:
        with self._idle:
            self._pending -= 1
            if not self._pending:
                self._idle.notify_all()

    def _late(self, budget: float) -> TimeoutError:
        return TimeoutError(f"file I/O on {self.dir} took longer than {budget:.3f}s (storage.timeout_ms per "
                            f"page and {FLOOR_BYTES_PER_S / 1e6:.0f} MB/s per attempt, scaled by the load average)")

    def _in_parts(self, part, n: int, nbytes: int, *args) -> list[Any]:
        """``part(range, given_up, *args)`` over ``range(n)`` split among the workers when
        the pages are large (each worker reads or writes its pages and hashes them while
        they are in its cache), results concatenated in order; waits at most
        ``_budget(n, nbytes)``, else sets ``given_up`` (an Event) and raises
        ``TimeoutError``. Parts still running finish on their own: a late put still
        accounts its bytes, a late read stops before its next page."""
        k = self._parts(n, nbytes)
        bounds = [n * j // k for j in range(k + 1)]
        given_up = threading.Event()
        futs = [self._submit(part, range(bounds[j], bounds[j + 1]), given_up, *args) for j in range(k)]
        budget = self._budget(n, nbytes)
        _, pending = concurrent.futures.wait(futs, timeout=budget)
        if pending:
            given_up.set()
            with self._mu:
                self._late_parts += len(pending)
            for f in pending:
                f.add_done_callback(self._late_done)
            raise self._late(budget)
        return [x for f in futs for x in f.result()]

    def _late_done(self, _fut: Any = None) -> None:
        with self._idle:
            self._late_parts -= 1
            self._idle.notify_all()
        self._trim_if_over()

    def wait_late_reads(self, timeout: float | None = None) -> bool:
        with self._idle:
            return self._idle.wait_for(lambda: self._late_parts == 0, timeout=timeout)

    def _parts(self, n: int, nbytes: int) -> int:
        """Workers a call of ``n`` pages and ``nbytes`` splits among: one per
        ``SPLIT_MIN_BYTES``, at most ``IO_WORKERS``, and no more than the cores the load
        average leaves (on a saturated box, threads only take turns at the GIL)."""
        return max(1, min(IO_WORKERS, n, nbytes // SPLIT_MIN_BYTES, int(_cpus() / self._load())))

    def _trim_if_over(self, _fut: Any = None) -> None:
        if self._cap is not None and self._cap.over():
            self._trim()

    # ------------------------------------------------------------- primitives
    def _raw_get(self, keys: list[bytes]) -> list[Buffer | None | BaseException | Decoded]:
        return self._deadline(self._get_all, len(keys), keys, None)

    def _raw_get_sized(self, keys: list[bytes], payload_bytes: int) -> list[Buffer | None | BaseException | Decoded]:
        return self._deadline(self._get_all, len(keys), keys, payload_bytes)

    def _get_all(self, keys: list[bytes], payload: int | None) -> list[Buffer | None | BaseException | Decoded]:
        return self._read_each(keys, range(len(keys)), lambda path, i: self._read(path, payload))

    def _raw_get_into(self, keys: list[bytes], dests: list[list[memoryview]], verify: Verifier) -> list[Any]:
        nbytes = sum(mv.nbytes for mv in dests[0]) * len(keys) if keys else 0
        return self._in_parts(self._get_into_part, len(keys), nbytes, keys, dests, verify)

    def _raw_get_into_settled(self, keys: list[bytes], dests: list[list[memoryview]],
                              verify: Verifier) -> list[Any]:
        # The caller reads the first part itself (no hand-off: on a loaded box, waking a worker
        # and then the caller cost more than the reads) and waits for the other parts, if the
        # pages are large and cores idle. Every part stops before its next page once the
        # budget is spent; the call then raises TimeoutError (an outage), with nothing left
        # reading into ``dests``.
        n = len(keys)
        nbytes = sum(mv.nbytes for mv in dests[0]) * n if n else 0
        k, budget = self._parts(n, nbytes), self._budget(n, nbytes)
        stop = _Deadline(time.monotonic() + budget)
        bounds = [n * j // k for j in range(k + 1)]
        futs = [self._submit(self._get_into_part, range(bounds[j], bounds[j + 1]), stop, keys, dests, verify)
                for j in range(1, k)]
        try:
            out = self._get_into_part(range(bounds[0], bounds[1]), stop, keys, dests, verify)
        finally:
            concurrent.futures.wait(futs)  # settled, whatever happened here
        for f in futs:
            out += f.result()
        if stop.stopped:
            raise self._late(budget)
        return out

    def _get_into_part(self, idx: range, given_up: threading.Event | _Deadline, keys: list[bytes],
                       dests: list[list[memoryview]], verify: Verifier) -> list[Any]:
        # Verified right after its read, on this worker, while its bytes are in cache.
        # Headers are read into one buffer per part, reused: each is judged before the next read.
        # Once the caller has given up, the destinations are the engine's again: no more reads.
        # One loop, few calls per page besides the syscalls, the hash and the header's: at
        # 128 KiB the per-page Python had cost as much as the read itself.
        # An object of ours takes one ``preadv`` of header, payload and ``spare`` (one byte,
        # left unfilled at the end of a regular file) and no ``fstat``; nothing is ever sized
        # from the file's size (at most a page and MAX_SPLIT_HEADER are read: ``_read_odd``).
        # A page is read whole, then hashed: reading a 2 MiB page as 256 KiB blocks, each hashed
        # as it landed, cost 0.69-0.79x of a raw read against 0.79-1.05x whole (8 MiB: even).
        hdr, spare = memoryview(bytearray(verify.header_bytes)), memoryview(bytearray(1))
        whole = verify.header_bytes + verify.template.sizes.total  # what one preadv brings of an object of ours
        touch = self._cap is not None and self.eviction == "lru"
        out: list[Any] = []
        for i in idx:
            if given_up.is_set():
                out.extend([None] * (len(idx) - len(out)))
                break
            path = self._path(keys[i])[1]
            try:
                fd = _open_object(path)
            except FileNotFoundError:
                out.append(None)
                continue
            except OSError as e:
                out.append(e)
                continue
            try:
                segs = dests[i]
                if len(segs) + 2 <= IOV_MAX and os.preadv(fd, [hdr, *segs, spare], 0) == whole:
                    out.append(verify.landed(i, hdr))  # a regular file ends exactly there
                else:
                    out.append(verify(i, _read_odd(fd, path, segs, hdr)))
            except OSError as e:
                out.append(e)
                continue
            finally:
                os.close(fd)
            if touch:
                _touch(path)
        return out

    def _read_each(self, keys: list[bytes], idx: range, read: Callable[[str, int], Any],
                   given_up: threading.Event | None = None) -> list[Any]:
        """``read(path, i)`` for each key's file: None where the file is absent, the
        ``OSError`` where reading failed (and after ``given_up`` is set, nothing more is
        read). Under an ``lru`` cap a file read is made young."""
        out: list[Any] = []
        touch = self._cap is not None and self.eviction == "lru"
        for i in idx:
            if given_up is not None and given_up.is_set():
                out.extend([None] * (len(idx) - len(out)))
                break
            try:
                path = self._path(keys[i])[1]
                out.append(read(path, i))
                if touch:
                    _touch(path)
            except FileNotFoundError:
                out.append(None)
            except OSError as e:
                out.append(e)
        return out

    def _raw_put_new(self, items: PutBatch) -> list[bool | BaseException | None]:
        return self._put(items, skip_present=True)

    def _raw_put(self, items: PutBatch) -> list[bool | BaseException]:
        return self._put(items, skip_present=False)  # type: ignore[return-value]

    def _put(self, items: PutBatch, skip_present: bool) -> list[bool | BaseException | None]:
        n = len(items)
        out = self._in_parts(self._put_part, n, sum(items.payload_bytes(i) for i in range(n)), items, skip_present)
        self._trim_if_over()
        return out

    def _put_part(self, idx: range, _given_up: threading.Event, items: PutBatch,
                  skip_present: bool) -> list[bool | BaseException | None]:
        """Write pages ``idx`` (None: skipped as present) and account them in the cap's
        ledger here, on the worker, so a put whose caller stopped waiting still counts."""
        out: list[bool | BaseException | None] = []
        written, replaced, rewrites = 0, 0, 0  # bytes written; of those, bytes and objects that replaced one
        for i in idx:
            k, payload = items.key_payload(i)
            d, path = self._path(k)
            try:
                if skip_present and _is_object(path):
                    out.append(None)
                    continue
                hdr = items.header(i)
                old = self._write(d, path, hdr, payload)
                out.append(True)
            except OSError as e:
                out.append(e)
                continue
            new = len(hdr) + payload.nbytes
            written += new
            if old is not None:
                replaced, rewrites = replaced + min(old, new), rewrites + 1
        if self._cap is not None and written:
            self._cap.account(written, sum(r is True for r in out) - rewrites, replaced=replaced)
        return out

    def _read(self, path: str, payload: int | None = None) -> bytearray | Decoded:
        """The whole object at ``path``, or why it is refused unread (``_refuse``: a size its
        header does not declare, a payload not of ``payload`` bytes, another layout's, no
        header of ours)."""
        fd, size = _open_regular(path)
        try:
            head = read_head(fd, size)
            bad = _refuse(head, size, self.fingerprint, payload)
            if bad is not None:
                return bad
            buf = bytearray(size)
            buf[:len(head)] = head
            got = len(head) + _preadv_full(fd, [memoryview(buf)[len(head):]], len(head))
            return buf if got == size else buf[:got]  # shrank under us: the checksum rejects it
        finally:
            os.close(fd)

    def _trim(self) -> None:
        r = self._cap.trim() if self._cap is not None else None
        if r is not None and r.deleted:
            self._count(evicted=r.deleted)

    def _write(self, d: str, path: str, hdr: bytes, payload: memoryview) -> int | None:
        """Write one object in place of any at ``path``; with a cap, the size of the one it
        replaced (None: none; the ledger counts each object once)."""
        self._ensure_dir(d)
        # A fresh random name, created exclusively and never through a symlink.
        tmp = f"{path}{_TMP}{os.getpid()}.{secrets.token_hex(8)}"
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        try:
            fd = os.open(tmp, flags, self._perms.file_mode)
        except FileNotFoundError:  # the directory was removed under us
            self._ensure_dir(d, again=True)
            fd = os.open(tmp, flags, self._perms.file_mode)
        try:
            bufs, total = [memoryview(hdr), payload], len(hdr) + payload.nbytes
            done = 0
            while done < total:
                n = os.writev(fd, bufs)
                done += n
                _consume(bufs, n)
            if self.fsync:
                os.fsync(fd)
        except BaseException:
            os.close(fd)
            os.unlink(tmp)
            raise
        os.close(fd)
        old = _size_of(path) if self._cap is not None else None  # just before the rename: the gap stays small
        os.replace(tmp, path)
        return old

    def _raw_exists(self, keys: list[bytes]) -> list[bool]:
        return self._deadline(lambda: [_is_object(self._path(k)[1]) for k in keys], len(keys))

    def _raw_delete(self, keys: list[bytes]) -> int:
        return self._deadline(self._delete_all, len(keys), keys)

    def _delete_all(self, keys: list[bytes]) -> int:
        n, freed = 0, 0
        for k in keys:
            path = self._path(k)[1]
            try:
                size = os.lstat(path).st_size if self._cap is not None else 0
                os.unlink(path)
                n += 1
                freed += size
            except FileNotFoundError:
                pass
        if self._cap is not None and n:
            self._cap.release(freed, n)
        return n

    def _raw_ping(self) -> bool:
        return os.access(self.dir, os.W_OK)

    def _raw_close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _raw_scan(self) -> Iterator[tuple[bytes, Buffer]]:
        for sub in sorted(os.scandir(self.dir), key=lambda e: e.name):
            if not sub.is_dir():
                continue
            for f in sorted(os.scandir(sub.path), key=lambda e: e.name):
                if _TMP in f.name:
                    continue
                if not _HEX_NAME.match(f.name) or f.name[:2] != sub.name:
                    yield self.key_prefix + b"?" + f.name.encode(), b""  # stray file: reported bad
                    continue
                try:
                    obj = self._read(f.path)
                except OSError:  # not a regular file, a symlink, unreadable: reported bad
                    yield self.key_prefix + b"?" + f.name.encode(), b""
                    continue
                yield self.key_prefix + bytes.fromhex(f.name), obj  # type: ignore[misc]  (a Decoded: refused)

    def _raw_usage(self) -> StorageUsage:
        if self._cap is not None:
            nbytes, objects = self._cap.usage()
            return StorageUsage(objects, nbytes, self.max_bytes, self.eviction, exact=False)
        # Unbounded: no ledger, so a scan; /v1/stats asks every second, a scan is
        # reused for USAGE_SCAN_S (and then reported as not exact).
        now = time.monotonic()
        cached = self._scanned
        if cached is not None and now - cached[0] < USAGE_SCAN_S:
            return dataclasses.replace(cached[1], exact=False)
        objs, _ = scan(self.root)
        u = StorageUsage(len(objs), sum(f.size for f in objs), None, self.eviction)
        self._scanned = (now, u)
        return u

    def check_integrity(self) -> None:
        """The base checks, and with a cap: the ledger covers the bytes on disk and
        those are within the cap. Waits (up to ``LATE_WAIT_S``) for this backend's
        late calls first; a ledger that under-counts (a put that outlived its caller
        elsewhere, a writer that died between rename and accounting) is rescanned and
        trimmed, with one warning, rather than reported: it is the cache's own
        bookkeeping, and ``hicache storage fsck --repair`` does the same offline."""
        super().check_integrity()
        if self._cap is None:
            return
        with self._idle:
            self._idle.wait_for(lambda: self._pending == 0, timeout=LATE_WAIT_S)
        total = self._cap.checked_usage()  # an untrusted ledger is reported, not repaired, by a check
        on_disk = sum(f.size for f in scan(self.root)[0])
        if on_disk > total:
            self._warnings.once("ledger", "L3 %s: the size ledger counted %d bytes but %d are on disk (a put that "
                                "outlived its caller, or a writer that died between rename and accounting); "
                                "rescanned it (`hicache storage fsck --url %s --repair` does this offline)",
                                self.name, total, on_disk, self.name)
            self._cap.rescan()
            self._trim_if_over()
        self._cap.check_integrity()
        on_disk = sum(f.size for f in scan(self.root)[0])
        if on_disk > self.max_bytes:
            raise IntegrityError(f"{self.name}: {on_disk} bytes on disk exceed max_bytes={self.max_bytes} after a "
                                 f"trim (objects it may not delete?); run `hicache storage fsck --url {self.name}`")

    def path_of(self, key: bytes) -> Path:
        """Where the object of a page hash lives (for tools and corruption tests)."""
        return Path(self._path(self.key_prefix + key)[1])


class _Deadline:
    """``threading.Event``'s ``is_set`` for a call's parts: True once the monotonic clock is
    past ``at``; ``stopped`` records that a part was told so (it then read no further page)."""

    __slots__ = ("at", "stopped")

    def __init__(self, at: float):
        self.at, self.stopped = at, False

    def is_set(self) -> bool:
        if time.monotonic() <= self.at:
            return False
        self.stopped = True
        return True


def _is_object(path: str) -> bool:
    """A regular file (not followed) at ``path``: a directory, FIFO or symlink planted there is no object."""
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return False


def _size_of(path: str) -> int | None:
    """The size of the regular file at ``path`` (not followed); None when there is none."""
    try:
        st = os.lstat(path)
    except OSError:
        return None
    return st.st_size if stat.S_ISREG(st.st_mode) else None


def _touch(path: str) -> None:
    """LRU: a read makes the object the newest (its mtime); best effort (another
    user's file, a read-only mount: the object then ages as under fifo)."""
    try:
        os.utime(path)
    except OSError:
        pass


_READ_FLAGS = os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK  # O_NONBLOCK: a FIFO never waits


def _open_regular(path: str) -> tuple[int, int]:
    """(fd, size) of a regular file, never through a symlink; raises OSError otherwise."""
    fd = os.open(path, _READ_FLAGS)
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise OSError(f"{path} is not a regular file (mode {st.st_mode:o}); refusing to read it")
    return fd, st.st_size


def _open_object(path: str) -> int:
    """A descriptor for reading the object at ``path``: never through a symlink, and a FIFO
    never blocks the open (``_READ_FLAGS``)."""
    return os.open(path, _READ_FLAGS)


def _read_odd(fd: int, path: str, segs: list[memoryview], hdr: memoryview) -> InPlace | bytes:
    """The read of an object whose length is not the expected one: a header of
    another length (an older writer, a checksum that encodes shorter) split off by the
    file's size, or (too short, too long, not a regular file) what a page and
    ``MAX_SPLIT_HEADER`` hold of it, whole, for ``decode`` to reject."""
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        raise OSError(f"{path} is not a regular file (mode {st.st_mode:o}); refusing to read it")
    payload = sum(mv.nbytes for mv in segs)
    hlen = st.st_size - payload
    if 0 < hlen <= MAX_SPLIT_HEADER:
        head = hdr if hlen == hdr.nbytes else memoryview(bytearray(hlen))
        got = _preadv_full(fd, [head, *segs])
        if got == st.st_size:
            return InPlace(head)
        return (bytes(head) + b"".join(segs))[:got]  # shrank under us: decode rejects it
    buf = bytearray(min(st.st_size, payload + MAX_SPLIT_HEADER + 1))
    return bytes(buf[:_preadv_full(fd, [memoryview(buf)])])


def read_head(fd: int, size: int) -> bytes:
    """The first bytes of the object of ``size`` bytes open on ``fd``: its prefix and
    header (``HEAD_BYTES``, more only for a longer header, at most 1 MiB), or all of it."""
    head = os.pread(fd, min(size, HEAD_BYTES), 0)
    end = codec.head_end(head)
    return os.pread(fd, end, 0) if len(head) < end <= size else head


def _refuse(head: bytes, size: int, fingerprint: str, payload: int | None) -> Decoded | None:
    """Why an object of ``size`` bytes starting with ``head`` is not read whole, judged
    before any allocation for it: no hicache header (corrupt), another layout's (kept), a
    size its header does not declare (corrupt: a sparse or grown file), or a payload that
    is not the page's ``payload`` bytes (corrupt). None when its header declares exactly
    ``size`` bytes for ``fingerprint`` (and ``payload`` where given)."""
    h = codec.parse_head(head)
    if isinstance(h, Decoded):
        return h
    if h.fingerprint != fingerprint:
        return Decoded(ReadStatus.FINGERPRINT, None, f"fingerprint {h.fingerprint!r} != ours {fingerprint!r}")
    if h.size != size:
        return Decoded(ReadStatus.CORRUPT, None, f"object is {size:,} bytes but its header declares {h.size:,}")
    if payload is not None and h.size - h.header_bytes != payload:
        return Decoded(ReadStatus.CORRUPT, None, f"payload of {h.size - h.header_bytes:,} bytes, the page's "
                       f"is {payload:,}")
    return None


def _preadv_full(fd: int, bufs: list[memoryview], at: int = 0) -> int:
    """Fill ``bufs`` from offset ``at`` (several ``preadv`` only if the kernel returns short); bytes read."""
    done = 0
    while bufs:
        n = os.preadv(fd, bufs[:IOV_MAX], at + done)
        if n == 0:  # end of file
            return done
        done += n
        _consume(bufs, n)
    return done


def _consume(bufs: list[memoryview], n: int) -> None:
    """Drop the first ``n`` bytes of ``bufs`` (an iovec a short ``writev``/``preadv`` moved): whole
    buffers leave the list, a partly moved one is cut to its rest."""
    while bufs and n >= bufs[0].nbytes:
        n -= bufs[0].nbytes
        bufs.pop(0)
    if bufs and n:
        bufs[0] = bufs[0][n:]
