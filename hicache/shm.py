"""POSIX shared-memory segment that holds the service's L2 host pool.

The segment is a file under ``/dev/shm`` mapped with ``mmap``; the server
creates and unlinks it, engines attach by name. We do not use
``multiprocessing.shared_memory`` because before Python 3.13 every attaching
process registers the segment with its resource tracker, which unlinks it when
that process exits, pulling the segment from under the server.

``tensor`` is a 1-D uint8 view of the whole mapping, suitable as the
``buffer=`` of ``hicache.pools.HostPool``. With CUDA present, ``pin()``
page-locks the mapping (``cudaHostRegister``) so GPU kernels can address it.
"""
from __future__ import annotations

import errno
import logging
import mmap
import os
import re

import torch

from hicache.errors import PoolError

log = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,200}$")


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
    """

    def __init__(self, name: str, size: int, mm: mmap.mmap, owner: bool):
        self.name = name
        self.size = size
        self.owner = owner
        self._mm: mmap.mmap | None = mm
        self._pinned_ptr: int | None = None
        self.tensor: torch.Tensor | None = torch.frombuffer(mm, dtype=torch.uint8, count=size)

    @classmethod
    def create(cls, name: str, size: int) -> "SharedSegment":
        """Create a new zero-filled segment, its memory reserved up front.

        Raises ``PoolError`` if ``name`` exists or ``/dev/shm`` cannot hold ``size`` bytes.
        """
        if size < 1:
            raise PoolError(f"shared segment size must be >= 1 byte, got {size}")
        path = shm_path(name)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            raise PoolError(f"shared memory segment {path} already exists; another server uses "
                            f"service.shm_name={name!r}, or a crashed one left it: pick another "
                            f"name or remove {path}") from None
        try:
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
        except BaseException:
            os.unlink(path)
            raise
        finally:
            os.close(fd)
        return cls(name, size, mm, owner=True)

    @classmethod
    def attach(cls, name: str, size: int) -> "SharedSegment":
        """Map an existing segment of at least ``size`` bytes; ``PoolError`` otherwise."""
        path = shm_path(name)
        try:
            fd = os.open(path, os.O_RDWR)
        except FileNotFoundError:
            raise PoolError(f"shared memory segment {path} does not exist; is the server "
                            "running on this host?") from None
        try:
            have = os.fstat(fd).st_size
            if have < size:
                raise PoolError(f"shared memory segment {path} holds {have} bytes, expected {size}")
            mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        return cls(name, size, mm, owner=False)

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
