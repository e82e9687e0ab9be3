"""The byte cap of a ``file://`` directory shared by several processes.

Layout under the root: ``<root>/<prefix dir>/<xx>/<hash hex>`` (one prefix dir
per layout, see ``hicache.storage.file``), plus two files of ours:

- ``.hicache-usage``: the ledger, 24 bytes ``(total, added, objects)`` as
  little-endian int64, read and written under ``flock(LOCK_EX)`` of that
  file. ``total`` is the bytes the directory holds (an estimate that never
  falls below the truth); ``added`` only grows, by every byte any process
  accounted; ``objects`` counts files (an estimate, exact after a scan).
- ``.hicache-trim.lock``: held (non-blocking ``flock``) by the one process
  trimming; the others skip the trim. The trimmer reads the ledger again after
  releasing the lock and trims again while it is over the cap, so a writer that
  found the lock busy is seen either by that read or by its own next try.

Why the estimate never falls below the truth, across processes: a writer
first ``os.replace``s an object into place, then adds its size to the ledger.
A rewrite adds only what its object grew by (the size it replaced is read just
before the rename) to ``total``, and its whole size to ``added``, so a trim
running meanwhile counts it twice, never zero times.
A trim reads ``added`` *before* it scans, deletes the oldest objects down to
``TRIM_TO`` of the cap, then sets ``total = what is left + (added now -
added before the scan)``. An object renamed before the scan began was added
before too, or later (counted twice); one renamed after is in the increment.
So once every writer has returned from its put, the bytes on disk are at
most ``total``, and the last put left ``total <= cap`` or trimmed. (Two
gaps, closed by every trim and by opening: a process killed between rename and
accounting leaves its bytes uncounted until the next scan; and a trim that
deletes an object in the instant between a rewriter's size check and its
rename, and finishes before that rewriter accounts, leaves the new object
uncounted. ``check_integrity`` finds either and rescans.)

Trust (as for the shared segment, ``hicache.memory.shm``): the ledger and the
trim lock are opened with ``O_NOFOLLOW | O_NONBLOCK`` and used only when they
are regular files with one link, owned by this uid (or, with
``storage.file_group``, of that group) and writable by no one else. Repair:
one that is not (planted by another user, a FIFO, a directory, a symlink) is
renamed aside to ``.hicache-usage.untrusted.*`` with a warning naming it, and
a fresh ledger is rebuilt from a scan, so a bad ledger never takes L3 down.
Where it cannot be moved (a directory this user may not write), the error
names the file and says to remove it: the next open rebuilds it the same way.

Deleting is ``unlink``: a reader that has the file open keeps reading the
whole old object (POSIX keeps the inode until closed); a reader that has not
opened it yet gets a miss. Reads verify checksums anyway.
"""
from __future__ import annotations
from dataclasses import dataclass
import errno
import fcntl
import logging
import os
import secrets
import stat
import struct
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, NamedTuple
from hicache.core.errors import IntegrityError, StorageError
from hicache.storage.capacity import TRIM_TO
import grp
from hicache.core.errors import ConfigError


LEDGER = ".hicache-usage"
TRIM_LOCK = ".hicache-trim.lock"
_FMT = struct.Struct("<qqq")
_TMP = ".tmp."
_TRIM_ROUNDS = 8  # a put trims this many rounds at most, however fast others write
STALE_TMP_S = 600.0  # a temp file this old is a crashed writer's: the trim removes it
_HEX_LEN = 32
_OPEN = os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK
_NOT_A_FILE = {errno.ELOOP: "a symbolic link", errno.EISDIR: "a directory", errno.ENXIO: "a socket or device",
               errno.ENODEV: "a device", errno.ENOTDIR: "not a file"}
log = logging.getLogger(__name__)


class LedgerError(StorageError, OSError):
    """The ledger or trim lock of a capped ``file://`` root cannot be used; the
    message names the file and the fix. An ``OSError`` too: inside a put it is
    an L3 outage (counted, retried), not a crash."""


class StoredFile(NamedTuple):
    mtime_ns: int
    path: str
    size: int


class TrimResult(NamedTuple):
    deleted: int  # objects (and stale temp files) removed
    deleted_bytes: int
    remaining_bytes: int  # what the scan left on disk


_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
_NOFOLLOW_DIR = _DIR | os.O_NOFOLLOW


class Entry(NamedTuple):
    """One file two levels under a prefix dir, seen through the fan-out dir's descriptor."""
    prefix: str  # the prefix dir's name
    dir_fd: int  # the fan-out dir, open only while the walk is at this entry
    name: str
    stat: os.stat_result  # not followed
    path: str  # for messages and identity; never opened by it


def walk(root: Path, prefix: str | None = None) -> Iterator[Entry]:
    """Every file under ``root``'s prefix dirs (``prefix``: that one only), by name order.

    Each directory below ``root`` is opened by descriptor with ``O_NOFOLLOW``
    relative to its parent, so a fan-out dir swapped for a symlink mid-walk is
    skipped, never followed: what a caller unlinks with ``dir_fd`` is inside the store.
    """
    rfd = _open_dir(str(root), None, _DIR)  # the root itself may be a symlink the operator chose
    if rfd is None:
        return
    try:
        for pname in _names(rfd):
            if prefix is not None and pname != prefix:
                continue
            pfd = _open_dir(pname, rfd)
            if pfd is None:  # a file of ours (ledger, lock), a symlink, or gone
                continue
            try:
                for sname in _names(pfd):
                    sfd = _open_dir(sname, pfd) if len(sname) == 2 else None
                    if sfd is None:
                        continue
                    try:
                        for name in _names(sfd):
                            try:
                                st = os.stat(name, dir_fd=sfd, follow_symlinks=False)
                            except FileNotFoundError:  # deleted meanwhile
                                continue
                            yield Entry(pname, sfd, name, st, f"{root}/{pname}/{sname}/{name}")
                    finally:
                        os.close(sfd)
            finally:
                os.close(pfd)
    finally:
        os.close(rfd)


def scan(root: Path, now: float | None = None) -> tuple[list[StoredFile], list[StoredFile]]:
    """``(objects, stale temp files)`` under ``root``, every layout's; skips what is not ours."""
    objs: list[StoredFile] = []
    stale: list[StoredFile] = []
    now = time.time() if now is None else now
    for e in walk(root):
        st = e.stat
        if _TMP in e.name:
            if now - st.st_mtime > STALE_TMP_S:
                stale.append(StoredFile(st.st_mtime_ns, e.path, st.st_size))
        elif len(e.name) == _HEX_LEN and stat.S_ISREG(st.st_mode):
            objs.append(StoredFile(st.st_mtime_ns, e.path, st.st_size))
    return objs, stale


class FileCap:
    """The cap of one ``file://`` root, shared through the ledger. Thread-safe
    (every step holds a ``flock``); one per ``FileBackend``."""

    def __init__(self, root: Path, max_bytes: int, gid: int | None = None):
        """``gid``: the group (``storage.file_group``) whose members share this root; None: this uid only."""
        self.root = Path(root)
        self.max_bytes = max_bytes
        self.gid = gid
        self.root.mkdir(parents=True, exist_ok=True)
        self._ledger_path = self.root / LEDGER
        self._trim_path = self.root / TRIM_LOCK
        with self._ledger():  # the first opener (or the repair) counts what is there
            pass

    @contextmanager
    def _ledger(self, check_only: bool = False) -> Iterator[tuple[int, int | None, int, int]]:
        """Hold the ledger's lock; yields ``(fd, total, added, objects)``. A ledger never written
        (new, or just rebuilt by the repair) is first set to a scan. ``check_only``: no repair,
        no scan (``total`` None: never written)."""
        fill = not check_only
        fd = self._open(self._ledger_path, repair=fill)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            raw = os.pread(fd, _FMT.size, 0)
            total, added, objects = _FMT.unpack(raw) if len(raw) == _FMT.size else (None, 0, 0)
            if total is None and fill:  # writers wait for the scan: a rename before it is counted twice, never 0
                objs, _ = scan(self.root)
                total, objects = sum(f.size for f in objs), len(objs)
                self._write(fd, total, added, objects)
            yield fd, total, added, objects
        finally:
            os.close(fd)  # releases the flock

    def _open(self, path: Path, repair: bool = True) -> int:
        """A descriptor on ``path`` (created if absent) once it passes the trust rules;
        an untrusted one is set aside and replaced (the module docstring). Raises ``LedgerError``."""
        for _ in range(2):
            try:
                fd = os.open(path, _OPEN, 0o660 if self.gid is not None else 0o600)
            except OSError as e:
                if e.errno in (errno.EACCES, errno.EPERM):
                    raise self._not_ours(path, e) from None
                if e.errno not in _NOT_A_FILE:
                    raise self._unusable(path, f"cannot be opened ({e.strerror})") from None
                why = f"is {_NOT_A_FILE[e.errno]}"
            else:
                st = os.fstat(fd)
                why = _untrusted(st, self.gid)
                if why is None:
                    if self.gid is not None and st.st_uid == os.geteuid() and (
                            st.st_gid != self.gid or stat.S_IMODE(st.st_mode) != 0o660):
                        os.fchown(fd, -1, self.gid)  # the group's members account and trim too
                        os.fchmod(fd, 0o660)
                    return fd
                os.close(fd)
            if not repair:
                raise self._unusable(path, why)
            self._set_aside(path, why)
        raise self._unusable(path, "was replaced again while being repaired")

    def _set_aside(self, path: Path, why: str) -> None:
        aside = path.with_name(f"{path.name}.untrusted.{os.getpid()}.{secrets.token_hex(4)}")
        try:
            os.rename(path, aside)
        except FileNotFoundError:
            return
        except OSError as e:
            raise self._unusable(path, f"{why}, and this user cannot move it aside ({e.strerror})") from None
        log.warning("file:// L3 %s: %s %s (not a file this uid may trust); moved it to %s and rebuilt it from a "
                    "scan of the directory. Remove the moved file once looked at.", self.root, path, why, aside)

    def _not_ours(self, path: Path, e: OSError) -> LedgerError:
        try:
            owner = f"uid {os.lstat(path).st_uid}"
        except OSError:
            owner = "another user"
        return LedgerError(f"file:// L3 {self.root} is capped (storage.max_bytes) and its ledger {path} belongs to "
                           f"{owner}; uid {os.geteuid()} cannot open it ({e.strerror}). Run as that user, give each "
                           "user its own storage.url, or share the directory through a group (storage.file_group)")

    def _unusable(self, path: Path, why: str) -> LedgerError:
        return LedgerError(f"file:// L3 {self.root} is capped (storage.max_bytes) and its file {path} {why}. "
                           f"Remove it as its owner or root (`rm -r {path}`): the next open rebuilds it from a "
                           "scan. Processes of several users share a capped directory only with "
                           "storage.file_group set; otherwise give each user its own storage.url")

    @staticmethod
    def _write(fd: int, total: int, added: int, objects: int) -> None:
        os.pwrite(fd, _FMT.pack(max(0, total), added, max(0, objects)), 0)

    def account(self, nbytes: int, objects: int, replaced: int = 0) -> int:
        """Add ``nbytes`` just renamed into place, ``objects`` new files among them (the
        rest replaced files of ``replaced`` bytes, counted up to their new size, which the
        total does not add again); returns the new total. ``added`` grows by all of
        ``nbytes``: a trim running meanwhile counts a rewrite twice, never zero times."""
        with self._ledger() as (fd, total, added, n):
            total = (total or 0) + nbytes - replaced
            self._write(fd, total, added + nbytes, n + objects)
        return total

    def release(self, nbytes: int, objects: int) -> None:
        """Subtract files this process deleted (``added`` is untouched: a trim's scan
        may have counted them, and an overestimate is the safe side)."""
        with self._ledger() as (fd, total, added, n):
            self._write(fd, (total or 0) - nbytes, added, n - objects)

    def usage(self) -> tuple[int, int]:
        """The ledger's ``(bytes, objects)``: bytes never below the truth (see the module docstring)."""
        with self._ledger() as (_, total, _added, n):
            return total or 0, n

    def over(self) -> bool:
        return self.usage()[0] > self.max_bytes

    def rescan(self) -> int:
        """Set the ledger to the bytes on disk now (a scan); returns them."""
        with self._ledger() as (_, _total, added0, _n):
            pass
        objs, _ = scan(self.root)
        size = sum(f.size for f in objs)
        with self._ledger() as (fd, _total, added1, _n):
            total = size + (added1 - added0)
            self._write(fd, total, added1, len(objs))
        return total

    def trim(self, *, force: bool = False, to_bytes: int | None = None) -> TrimResult | None:
        """Delete the oldest objects (by mtime: ``lru`` refreshes it on reads) until the
        bytes on disk are at most ``to_bytes`` (default ``TRIM_TO`` of the cap); repeats
        while writers pushed the total past the cap meanwhile (a few rounds at most).

        Runs only when the total exceeds the cap (or ``force``). Returns None
        when another process is trimming or nothing was due. The trimmer reads the
        ledger again *after* releasing the trim lock and goes on while it is over the
        cap: a writer whose trim found the lock busy accounted before that read (and
        so is seen) or tries the lock after the release (and so trims itself).
        """
        target = int(self.max_bytes * TRIM_TO) if to_bytes is None else to_bytes
        done: TrimResult | None = None
        for _ in range(_TRIM_ROUNDS):
            held, r = self._trim_locked(force, target)
            if not held:  # another process holds the lock: it re-checks after its release
                break
            force = False
            if r is not None:
                done = r if done is None else TrimResult(done.deleted + r.deleted,
                                                         done.deleted_bytes + r.deleted_bytes, r.remaining_bytes)
            if not self.over():
                break
        return done

    def _trim_locked(self, force: bool, target: int) -> tuple[bool, TrimResult | None]:
        """One round under the trim lock: whether this process got it, and what it
        deleted (None: nothing was due, the total within the cap and not ``force``)."""
        fd = self._open(self._trim_path)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return False, None
            due, added0 = self._due(force)
            return True, (self._trim_once(target, added0) if due else None)
        finally:
            os.close(fd)  # releases the trim lock

    def _due(self, force: bool) -> tuple[bool, int]:
        """Whether a trim is due (over the cap, or ``force``), and the ledger's ``added`` now."""
        with self._ledger() as (_, total, added, _n):
            return force or (total or 0) > self.max_bytes, added

    def _trim_once(self, target: int, added0: int) -> TrimResult:
        objs, stale = scan(self.root)
        size = sum(f.size for f in objs)
        n, freed = 0, 0
        for f in stale:
            if _unlink(self.root, f.path) == "deleted":
                n += 1
                freed += f.size
        objs.sort()
        kept = len(objs)
        for f in objs:
            if size <= target:
                break
            how = _unlink(self.root, f.path)
            if how == "kept":  # not ours to delete (another user's file): it stays counted
                continue
            if how == "deleted":
                n += 1
                freed += f.size
            size -= f.size  # gone either way (deleted by us or by someone else)
            kept -= 1
        with self._ledger() as (fd, _total, added1, _n):
            self._write(fd, size + (added1 - added0), added1, kept)
        return TrimResult(n, freed, size)

    def checked_usage(self) -> int:
        """The ledger's bytes, read without repairing anything. Raises ``IntegrityError``
        naming a ledger that is missing or untrusted (a check never mutates)."""
        try:
            with self._ledger(check_only=True) as (_, total, _added, _n):
                if total is None:
                    raise IntegrityError(f"file:// ledger {self._ledger_path} was never written")
        except LedgerError as e:
            raise IntegrityError(str(e)) from None
        return total

    def check_integrity(self) -> None:
        """The ledger covers the bytes on disk (its promise), and exists. Call it
        while no process is inside a put (a rename not yet accounted is the
        one legitimate, momentary gap)."""
        total = self.checked_usage()
        objs, _ = scan(self.root)
        on_disk = sum(f.size for f in objs)
        if on_disk > total:
            raise IntegrityError(f"file:// {self.root}: {on_disk} bytes on disk exceed the ledger's {total} "
                                 "(a writer died between rename and accounting?); `hicache storage fsck --repair` rescans it")


def _untrusted(st: os.stat_result, gid: int | None) -> str | None:
    """Why a ledger or lock file with stat ``st`` is not to be trusted; None when it is."""
    if not stat.S_ISREG(st.st_mode):
        return f"is not a regular file (mode {stat.filemode(st.st_mode)})"
    if st.st_nlink != 1:
        return f"has {st.st_nlink} hard links, expected 1"
    if st.st_uid != os.geteuid() and (gid is None or st.st_gid != gid):
        return f"is owned by uid {st.st_uid}, not uid {os.geteuid()}" + (f" nor of gid {gid}" if gid is not None else "")
    bits = stat.S_IMODE(st.st_mode)
    if bits & (0o7002 if gid is not None else 0o7022):
        return f"has mode {bits:04o}: writable by {'others' if bits & 0o002 else 'its group'} or with special bits"
    return None


def _names(fd: int) -> list[str]:
    """A directory's entry names, sorted; none when it cannot be read (another user's)."""
    try:
        return sorted(os.listdir(fd))
    except OSError:
        return []


def _open_dir(name: str, dir_fd: int | None, flags: int = _NOFOLLOW_DIR) -> int | None:
    """A directory's descriptor; None for a symlink, a non-directory, or one gone or not ours."""
    try:
        return os.open(name, flags, dir_fd=dir_fd)
    except OSError:
        return None


def _unlink(root: Path, path: str) -> str:
    """Unlink ``path`` (a file two levels under one of ``root``'s prefix dirs) through
    descriptors opened with ``O_NOFOLLOW``, never through a symlink swapped in for
    one of its directories. ``"deleted"``, ``"gone"`` (someone else deleted it) or
    ``"kept"`` (not allowed, or a directory on the way is no longer one of ours)."""
    parts = os.path.relpath(path, root).split(os.sep)
    if len(parts) != 3 or ".." in parts:
        raise StorageError(f"{path!r} is not an object path under {str(root)!r}: nothing was unlinked")
    fd = _open_dir(str(root), None, _DIR)
    try:
        for part in parts[:-1]:
            nfd = None if fd is None else _open_dir(part, fd)
            if fd is not None:
                os.close(fd)
            fd = nfd
        if fd is None:
            return "kept"
        os.unlink(parts[-1], dir_fd=fd)
        return "deleted"
    except FileNotFoundError:
        return "gone"
    except OSError:
        return "kept"
    finally:
        if fd is not None:
            os.close(fd)


def rescan_ledger(root: Path, gid: int | None = None) -> None:
    """After deleting from outside a backend (``hicache storage clear``): set the
    ledger of ``root`` to what is on disk, if the directory has one (a capped store)."""
    if os.path.lexists(Path(root) / LEDGER):
        FileCap(Path(root), max_bytes=1, gid=gid).rescan()


@dataclass(frozen=True, slots=True)
class FilePerms:
    gid: int | None  # the sharing group; None: this uid only

    @classmethod
    def of(cls, group: str, where: str) -> "FilePerms":
        """``storage.file_group`` (a name, a numeric gid or "") resolved. Raises ``ConfigError``."""
        if not group:
            return cls(None)
        if str(group).isdigit():
            return cls(int(group))
        try:
            return cls(grp.getgrnam(group).gr_gid)
        except KeyError:
            raise ConfigError(f"storage url {where!r}: storage.file_group={group!r}: no such group on this "
                              "machine; create it, give a numeric gid, or leave it empty (this user only)") from None

    @property
    def file_mode(self) -> int:
        return 0o600 if self.gid is None else 0o640

    @property
    def dir_mode(self) -> int:
        return 0o700 if self.gid is None else 0o2770

    def make_dir(self, path: Path, tighten: bool = False) -> None:
        """Create ``path`` (and missing parents) with ``dir_mode``; ``tighten``: also an existing
        one of ours whose mode lets more in than ``dir_mode``. Raises ``OSError``."""
        try:
            try:
                os.mkdir(path, 0o700)
            except FileNotFoundError:  # a missing parent: made, then one more try (refused again: raised)
                path.parent.mkdir(parents=True, exist_ok=True)
                os.mkdir(path, 0o700)
        except FileExistsError:
            if not tighten:
                return
        st = os.lstat(path)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
            return  # not ours to change (the write path refuses what is not a directory)
        if self.gid is not None and st.st_gid != self.gid:
            os.chown(path, -1, self.gid)
        if stat.S_IMODE(st.st_mode) != self.dir_mode:
            os.chmod(path, self.dir_mode)
