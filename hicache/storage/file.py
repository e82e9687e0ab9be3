"""``file:///abs/dir`` and ``file://./rel/dir``: one file per page on a local
(or shared) file system; the embedded default, survives restarts.

Path of a page: ``<dir>/<prefix dir>/<hash[0:2]>/<hash hex>`` where the prefix
dir is the key prefix with ``:`` turned into ``-`` (``hicache-1a2b3c4d``), so
layouts never share files. Writes go to a temp file in the same directory
(header and payload with one ``writev``, never joined in memory) and are
``os.replace``d into place, so a reader sees a whole old object, a whole new
one, or none; a crash leaves at most a ``*.tmp.*`` file behind, which readers
ignore. ``fsync=True`` also makes a written page survive power loss.
"""
from __future__ import annotations

import os
import re
import threading
from pathlib import Path
from typing import Iterator

from hicache.errors import ConfigError
from hicache.hashing import HASH_BYTES
from hicache.storage.base import PutBatch, StorageBackend, StorageOptions
from hicache.storage.codec import Buffer

_TMP = ".tmp."
_HEX_NAME = re.compile(r"^[0-9a-f]{%d}$" % (2 * HASH_BYTES))


def parse_file_url(url: str) -> Path:
    """``file:///abs`` -> ``/abs``; ``file://./rel`` or ``file://rel`` -> ``rel``."""
    rest = url.split("://", 1)[1]
    if not rest:
        raise ConfigError(f"storage url {url!r}: needs a directory, e.g. file:///var/cache/hicache "
                          "or file://./.hicache/l3")
    if rest.startswith("localhost/"):
        rest = rest[len("localhost"):]
    return Path(rest)


class FileBackend(StorageBackend):
    scheme = "file"

    def __init__(self, options: StorageOptions, root: str | os.PathLike, *, fsync: bool = False,
                 name: str = ""):
        super().__init__(options, name or f"file://{root}")
        prefix_dir = re.sub(r"[^A-Za-z0-9_.-]", "-", options.key_prefix.decode("utf-8", "replace")).strip("-.")
        self.root = Path(root)
        self.dir = self.root / (prefix_dir or "default")
        self.fsync = bool(fsync)
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ConfigError(f"storage url {self.name!r}: cannot create directory {str(self.dir)!r}: "
                              f"{e}; pick a writable directory") from None
        self._made: set[str] = set()  # fan-out directories known to exist
        self._mu = threading.Lock()

    @classmethod
    def from_url(cls, url: str, options: StorageOptions, **opts) -> "FileBackend":
        return cls(options, parse_file_url(url), name=url, **opts)

    # ------------------------------------------------------------------ paths
    def _path(self, full_key: bytes) -> tuple[str, str]:
        h = full_key[len(self.key_prefix):].hex()
        d = os.path.join(self.dir, h[:2])
        return d, os.path.join(d, h)

    def _ensure_dir(self, d: str, again: bool = False) -> None:
        if again or d not in self._made:
            os.makedirs(d, exist_ok=True)
            with self._mu:
                self._made.add(d)

    # ------------------------------------------------------------- primitives
    def _raw_get(self, keys: list[bytes]) -> list[Buffer | None | BaseException]:
        out: list[Buffer | None | BaseException] = []
        for k in keys:
            try:
                out.append(self._read(self._path(k)[1]))
            except FileNotFoundError:
                out.append(None)
            except OSError as e:
                out.append(e)
        return out

    @staticmethod
    def _read(path: str) -> bytearray:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            size = os.fstat(fd).st_size
            buf = bytearray(size)
            mv, got = memoryview(buf), 0
            while got < size:
                n = os.readv(fd, [mv[got:]])
                if n == 0:  # shrank under us; the checksum will reject it
                    return buf[:got]
                got += n
            return buf
        finally:
            os.close(fd)

    def _raw_put(self, items: PutBatch) -> list[bool | BaseException]:
        out: list[bool | BaseException] = []
        for k, hdr, payload in items:
            d, path = self._path(k)
            try:
                self._write(d, path, hdr, payload)
                out.append(True)
            except OSError as e:
                out.append(e)
        return out

    def _write(self, d: str, path: str, hdr: bytes, payload: memoryview) -> None:
        self._ensure_dir(d)
        tmp = f"{path}{_TMP}{os.getpid()}.{threading.get_ident()}"
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC
        try:
            fd = os.open(tmp, flags, 0o644)
        except FileNotFoundError:  # the directory was removed under us
            self._ensure_dir(d, again=True)
            fd = os.open(tmp, flags, 0o644)
        try:
            bufs, total = [memoryview(hdr), payload], len(hdr) + payload.nbytes
            done = 0
            while done < total:
                n = os.writev(fd, bufs)
                done += n
                while bufs and n >= bufs[0].nbytes:
                    n -= bufs[0].nbytes
                    bufs.pop(0)
                if bufs and n:
                    bufs[0] = bufs[0][n:]
            if self.fsync:
                os.fsync(fd)
        except BaseException:
            os.close(fd)
            os.unlink(tmp)
            raise
        os.close(fd)
        os.replace(tmp, path)

    def _raw_exists(self, keys: list[bytes]) -> list[bool]:
        return [os.path.exists(self._path(k)[1]) for k in keys]

    def _raw_delete(self, keys: list[bytes]) -> int:
        n = 0
        for k in keys:
            try:
                os.unlink(self._path(k)[1])
                n += 1
            except FileNotFoundError:
                pass
        return n

    def _raw_ping(self) -> bool:
        return os.access(self.dir, os.W_OK)

    def _raw_close(self) -> None:
        pass

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
                yield self.key_prefix + bytes.fromhex(f.name), self._read(f.path)

    def path_of(self, key: bytes) -> Path:
        """Where the object of a page hash lives (for tools and corruption tests)."""
        return Path(self._path(self.key_prefix + key)[1])
