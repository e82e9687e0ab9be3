"""POSIX shared-memory segment that holds the service's L2 host pool.

The segment is a file under ``/dev/shm`` mapped with ``mmap``; the server
creates and unlinks it, engines attach by name. We do not use
``multiprocessing.shared_memory`` because before Python 3.13 every attaching
process registers the segment with its resource tracker, which unlinks it when
that process exits, pulling the segment from under the server.

``tensor`` is a 1-D uint8 view of the whole mapping, suitable as the
``buffer=`` of ``hicache.memory.pools.HostPool``. With CUDA present, ``pin()``
page-locks the mapping (``cudaHostRegister``) so GPU kernels can address it.
"""
from __future__ import annotations

import errno
import fcntl
import logging
import mmap
import os
import re
import stat
import struct

import torch

from hicache.core.errors import PoolError

log = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,200}$")
OWNER_BYTE, MAPPER_BYTE = 0, 1
# struct flock on Linux (x86-64 and aarch64): l_type, l_whence, l_start, l_len, l_pid, then padding.
_FLOCK = struct.Struct("hhqqi4x")


def _lock(fd: int, byte: int, kind: int) -> bool:
    """Take (or change to) an OFD lock of ``kind`` on one byte without waiting; False if held."""
    try:
        fcntl.fcntl(fd, fcntl.F_OFD_SETLK, _FLOCK.pack(kind, os.SEEK_SET, byte, 1, 0))
    except OSError as e:
        if e.errno in (errno.EAGAIN, errno.EACCES):
            return False
        raise
    return True


# O_NOFOLLOW: a symlink under the name is refused (ELOOP), never followed to
# another file; O_NONBLOCK: a FIFO under the name cannot hang the open.
_OPEN_FLAGS = os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
DEFAULT_MODE = 0o600


def segment_mode(gid: int | None) -> int:
    """The mode a segment is created with: ``0600``, or ``0660`` when shared with group ``gid``."""
    return DEFAULT_MODE if gid is None else 0o660


def _untrusted(path: str, why: str) -> PoolError:
    return PoolError(f"shared memory segment {path} is not this server's to use: {why}. It may have been "
                     f"planted by another local user; refusing to map it. Remove it (`rm {path}`, as its "
                     "owner or root) or choose another service.shm_name")


def check_trusted(fd: int, path: str, *, uid: int, mode: int | None, gid: int | None = None) -> os.stat_result:
    """``fstat(fd)`` when the open file is a segment ``uid`` made; ``PoolError`` otherwise.

    Accepted: a regular file owned by ``uid``, one link, mode bits exactly
    ``mode`` (None: any mode that no one but the owner and group may write)
    and group ``gid`` (None: any group).
    """
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        raise _untrusted(path, f"it is not a regular file (mode {stat.filemode(st.st_mode)})")
    if st.st_uid != uid:
        raise _untrusted(path, f"it is owned by uid {st.st_uid}, not uid {uid}")
    if st.st_nlink != 1:
        raise _untrusted(path, f"it has {st.st_nlink} hard links, expected 1")
    bits = stat.S_IMODE(st.st_mode)
    if (mode is not None and bits != mode) or (mode is None and bits & 0o7002):
        want = f"{mode:04o}" if mode is not None else "no other-write and no setuid/setgid/sticky bits"
        raise _untrusted(path, f"its mode is {bits:04o}, expected {want}")
    if gid is not None and st.st_gid != gid:
        raise _untrusted(path, f"its group is gid {st.st_gid}, expected gid {gid} (service.socket_group)")
    return st


def _open_existing(path: str) -> int | None:
    """An fd on the existing segment file ``path``; None when absent; ``PoolError`` for a symlink."""
    try:
        return os.open(path, _OPEN_FLAGS)
    except FileNotFoundError:
        return None
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise _untrusted(path, "it is a symbolic link") from None
        if e.errno in (errno.EACCES, errno.EPERM):
            raise _untrusted(path, f"this user cannot open it ({e.strerror})") from None
        if e.errno in (errno.EISDIR, errno.ENXIO, errno.ENODEV):
            raise _untrusted(path, f"it is not a regular file ({e.strerror})") from None
        raise


def live_owner_message(name: str) -> str:
    path = os.path.join(SHM_DIR, name)
    return (f"shared memory segment {path} already exists and a live server owns it (service.shm_name="
            f"{name!r}): stop that server or pick another name")


def probe_segment(name: str, gid: int | None = None) -> None:
    """Whether a server could open segment ``name`` now; changes nothing that outlives the call.

    Raises ``PoolError``: the name is invalid, the file under it is not this
    user's (``check_trusted``), or a live server owns it (``live_owner_message``).
    An orphan (no live owner) or no file at all is fine.
    """
    path = shm_path(name)
    fd = _open_existing(path)
    if fd is None:
        return
    try:
        check_trusted(fd, path, uid=os.geteuid(), mode=segment_mode(gid), gid=gid)
        if not _lock(fd, OWNER_BYTE, fcntl.F_WRLCK):
            raise PoolError(live_owner_message(name))
    finally:
        os.close(fd)  # drops the probe's lock with its open file description


def shm_path(name: str) -> str:
    if not _NAME.match(name) or name in (".", ".."):
        raise PoolError(f"shared memory name {name!r} must be 1-200 chars of [A-Za-z0-9_.-] "
                        "(no slashes); fix service.shm_name")
    return os.path.join(SHM_DIR, name)


class SharedSegment:
    """One mapped segment. ``create`` (owner: unlinks on ``close``) or ``attach``.

    ``tensor`` stays valid until ``close()``; views taken from it must be dropped
    before ``close()`` for the mapping to be released (otherwise it is released
    when the last view dies).

    Liveness travels with the file, as open-file-description locks (``F_OFD_*``:
    the kernel drops them when the holder dies, SIGKILL included): the owner
    holds a write lock on byte 0 for as long as it serves, and every process that
    maps the segment (owner included) holds a read lock on byte 1. So a segment
    whose byte 0 can be locked has no live owner (``take_orphan``), and one whose
    byte 1 can be write-locked is mapped by nobody else. A new segment gets its
    locks before its name appears (created unnamed, then linked), so no process
    ever sees a named segment without its owner's lock.

    Trust: ``/dev/shm`` is writable by every local user, so a name found there
    proves nothing. A segment is created ``0600`` (``0660`` and handed to a
    group when the server shares its socket with one) under an unnamed file
    that only then gets its name, never replacing one. A segment found under
    the name is adopted or mapped only when ``check_trusted`` accepts it: a
    regular file (never followed through a symlink), owned by the server's
    uid, with exactly the expected mode and group, and no other hard link.
    Anything else is refused with a message that says how to remove it,
    instead of serving (or overwriting) bytes another user planted.
    """

    def __init__(self, name: str, size: int, mm: mmap.mmap, owner: bool, fd: int):
        self.name = name
        self.size = size
        self.owner = owner
        self.mapped_elsewhere = False  # take_orphan: other processes still map it
        self._fd: int | None = fd  # holds this process's locks (see the class docstring)
        self._mm: mmap.mmap | None = mm
        self._pinned_ptr: int | None = None
        self.tensor: torch.Tensor | None = torch.frombuffer(mm, dtype=torch.uint8, count=size)

    @classmethod
    def create(cls, name: str, size: int, gid: int | None = None) -> "SharedSegment":
        """Create a new zero-filled segment, its memory reserved up front, owned
        (locked) by this process until ``close``; mode ``segment_mode(gid)``.

        Raises ``PoolError`` if ``name`` exists or ``/dev/shm`` cannot hold ``size`` bytes.
        """
        if size < 1:
            raise PoolError(f"shared segment size must be >= 1 byte, got {size}")
        path = shm_path(name)
        fd, tmp = _unnamed_file()
        try:
            if gid is not None:
                os.fchown(fd, -1, gid)
            os.fchmod(fd, segment_mode(gid))  # exactly, whatever the umask
            if not (_lock(fd, OWNER_BYTE, fcntl.F_WRLCK) and _lock(fd, MAPPER_BYTE, fcntl.F_RDLCK)):
                raise PoolError(f"cannot lock the new segment for {path}")  # nobody else knows the file
            os.ftruncate(fd, size)
            # Back every page now: tmpfs hands out pages on first touch, and a
            # touch beyond /dev/shm's capacity is a SIGBUS in whichever process
            # (server or engine) writes that page first, not an error here.
            try:
                os.posix_fallocate(fd, 0, size)
            except OSError as e:
                if e.errno != errno.ENOSPC:
                    raise
                raise PoolError(f"shared memory segment {path} needs {size} bytes but {SHM_DIR} has no "
                                "room for it; enlarge /dev/shm (Docker: shm_size) or lower "
                                "pool.host_pages") from None
            mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            try:
                _link(fd, tmp, path)  # atomic, never replaces
            except FileExistsError:
                mm.close()
                raise PoolError(f"shared memory segment {path} already exists; another server uses "
                                f"service.shm_name={name!r}: pick another name") from None
        except BaseException:
            os.close(fd)
            raise
        finally:
            if tmp:
                os.unlink(tmp)
        return cls(name, size, mm, owner=True, fd=fd)

    @classmethod
    def take_orphan(cls, name: str, gid: int | None = None) -> "SharedSegment | None":
        """Own the existing segment ``name`` if no live server does; None if it does not exist.

        Raises ``PoolError``: ``live_owner_message`` when a live server owns it;
        naming the file and how to remove it when ``check_trusted`` refuses it
        (another owner, mode other than ``segment_mode(gid)``, a link, not a file).
        The result is mapped whole and owned (``close`` unlinks it);
        ``mapped_elsewhere`` says whether other processes still map it.
        """
        path = shm_path(name)
        fd = _open_existing(path)
        if fd is None:
            return None
        try:
            check_trusted(fd, path, uid=os.geteuid(), mode=segment_mode(gid), gid=gid)
            if not _lock(fd, OWNER_BYTE, fcntl.F_WRLCK):
                raise PoolError(live_owner_message(name))
            elsewhere = not _lock(fd, MAPPER_BYTE, fcntl.F_WRLCK)
            _lock(fd, MAPPER_BYTE, fcntl.F_RDLCK)  # can't fail: read locks share
            size = os.fstat(fd).st_size
            if size < 1:
                raise PoolError(f"shared memory segment {path} is empty; remove it")
            mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            raise
        seg = cls(name, size, mm, owner=True, fd=fd)
        seg.mapped_elsewhere = elsewhere
        return seg

    @classmethod
    def attach(cls, name: str, size: int, owner_uid: int | None = None) -> "SharedSegment":
        """Map an existing segment of at least ``size`` bytes; ``PoolError`` otherwise.

        ``owner_uid``: the server's uid (``SO_PEERCRED`` of its socket); the
        segment must be a regular file it owns that no one else may write
        (``check_trusted``). None: the caller's own uid.
        """
        path = shm_path(name)
        fd = _open_existing(path)
        if fd is None:
            raise PoolError(f"shared memory segment {path} does not exist; is the server "
                            "running on this host?")
        try:
            check_trusted(fd, path, uid=os.geteuid() if owner_uid is None else owner_uid, mode=None)
            have = os.fstat(fd).st_size
            if have < size:
                raise PoolError(f"shared memory segment {path} holds {have} bytes, expected {size}")
            _lock(fd, MAPPER_BYTE, fcntl.F_RDLCK)  # read locks share: always granted
            mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            raise
        return cls(name, size, mm, owner=False, fd=fd)

    def pin(self) -> bool:
        """Page-lock the mapping for direct GPU access; False (no-op) without CUDA."""
        if self._pinned_ptr is not None:
            return True
        if not torch.cuda.is_available() or self.tensor is None:
            return False
        ptr = self.tensor.data_ptr()
        err = torch.cuda.cudart().cudaHostRegister(ptr, self.size, 0)
        if int(err) != 0:
            raise PoolError(f"cudaHostRegister of {self.size} bytes of {self.name!r} failed: {err}")
        self._pinned_ptr = ptr
        return True

    def close(self) -> None:
        """Unmap (and unlink, when owner). Idempotent; never raises for busy views."""
        if self._pinned_ptr is not None:
            torch.cuda.cudart().cudaHostUnregister(self._pinned_ptr)
            self._pinned_ptr = None
        self.tensor = None
        if self.owner:
            try:
                os.unlink(shm_path(self.name))
            except FileNotFoundError:
                pass
            self.owner = False
        if self._fd is not None:
            os.close(self._fd)  # drops the locks
            self._fd = None
        if self._mm is not None:
            try:
                self._mm.close()
            except BufferError:
                # Views of the tensor are still alive; the mapping goes when they do.
                log.debug("segment %s still has live views; unmapped when they are freed", self.name)
            self._mm = None

    def __enter__(self) -> "SharedSegment":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _unnamed_file() -> tuple[int, str]:
    """A new file in ``/dev/shm`` no other process can open: ``O_TMPFILE`` (then
    ``tmp`` is ""), else a uniquely named one that the caller unlinks."""
    try:
        return os.open(SHM_DIR, os.O_TMPFILE | os.O_RDWR | os.O_CLOEXEC, 0o600), ""
    except (AttributeError, OSError):
        tmp = os.path.join(SHM_DIR, f".hicache-new-{os.getpid()}-{os.urandom(6).hex()}")
        return os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600), tmp


def _link(fd: int, tmp: str, path: str) -> None:
    if tmp:
        os.link(tmp, path)
        return
    # linkat(AT_SYMLINK_FOLLOW) of /proc/self/fd/N names an O_TMPFILE file; os.link
    # uses linkat (and honours follow_symlinks) only when a dir fd is given.
    d = os.open(os.path.dirname(path), os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.link(f"/proc/self/fd/{fd}", os.path.basename(path), dst_dir_fd=d, follow_symlinks=True)
    finally:
        os.close(d)
