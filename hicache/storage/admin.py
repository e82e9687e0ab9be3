"""Operating an L3 store from outside the cache: size it, list it, clear it
(``hicache storage du|ls|clear``), per key prefix, i.e. per layout fingerprint.

Every layout writes under its own key prefix (``hicache:<fingerprint[:8]>:``;
on ``file://`` the directory ``hicache-<fingerprint[:8]>``), so the prefix is
the unit: ``du`` sums objects and bytes per prefix and names the full
fingerprint read from one object's header. Namespaces (LoRA adapter, cache
salt) are folded into each page hash and not stored, so a store cannot be
split by namespace; clearing one namespace means clearing its layout's prefix.

``redis://`` is walked with ``SCAN`` (never ``KEYS``), sized with ``STRLEN``
and cleared with ``UNLINK``, in pipelined batches. ``file://`` is walked by
descriptor (never through a symlink); clearing resets the size ledger of a capped directory.
``memory://`` lives inside one process: from here it is always empty.
"""
from __future__ import annotations

import os
import re
import stat
import time
from pathlib import Path
from typing import Any, Iterator, NamedTuple

from hicache.core.errors import ConfigError, StorageError
from hicache.core.hashing import HASH_BYTES
from hicache.core.redact import error_text, redact_url
from hicache.storage.capacity import PrefixUsage
from hicache.storage import codec
from hicache.storage.codec import HEAD_BYTES
from hicache.storage.file_cap import Entry, walk

BATCH = 1000  # keys per SCAN step / pipeline


class ObjectInfo(NamedTuple):
    prefix: str  # key prefix (file: its directory name)
    page_hash: str  # hex
    bytes: int
    age_s: float | None  # since the last write (file: mtime; None where unknown)


class Cleared(NamedTuple):
    objects: int
    bytes: int
    foreign: int = 0  # keys under the prefix that are no hicache object (no header): left alone


def header_fingerprint(head: bytes) -> str | None:
    """The fingerprint in an object's header (its first bytes), or None if they do not parse."""
    h = codec.parse_head(head)
    return h.fingerprint if isinstance(h, codec.Head) else None


def redis_heads(client: Any, keys: list[bytes]) -> list[bytes | None]:
    """Each key's first bytes, enough for ``codec.parse_head`` / ``is_hicache_object``
    (a second round trip only for a header longer than ``HEAD_BYTES``); None for a value
    that is no string (a hash, a list: another program's) or gone."""
    pipe = client.pipeline(transaction=False)
    for k in keys:
        pipe.getrange(k, 0, HEAD_BYTES - 1)
    heads = [h if isinstance(h, bytes) else None for h in pipe.execute(raise_on_error=False)]
    longer = [i for i, h in enumerate(heads) if h is not None and codec.head_end(h) > len(h) == HEAD_BYTES]
    if longer:
        pipe = client.pipeline(transaction=False)
        for i in longer:
            pipe.getrange(keys[i], 0, codec.head_end(heads[i]) - 1)
        for i, h in zip(longer, pipe.execute(raise_on_error=False)):
            heads[i] = h if isinstance(h, bytes) else None
    return heads


def _dir_name(prefix: str) -> str:
    """A key prefix as ``FileBackend`` names its directory (``hicache:ab:`` -> ``hicache-ab``)."""
    return re.sub(r"[^A-Za-z0-9_.-]", "-", prefix).strip("-.")


class FileStore:
    def __init__(self, root: Path, group: str = ""):
        self.root = root
        self.group = group  # storage.file_group: a rebuilt ledger is shared with it
        if not root.is_dir():
            raise ConfigError(f"file:// L3 directory {str(root)!r} does not exist; check --url / storage.url")

    def _prefixes(self, prefix: str | None) -> list[str]:
        want = None if prefix is None else _dir_name(prefix)
        return sorted(e.name for e in os.scandir(self.root) if e.is_dir(follow_symlinks=False)
                      and (want is None or e.name == want))

    def _objects(self, prefix: str | None) -> Iterator[Entry]:
        """Objects by descriptor (``file_cap.walk``): a symlink swapped in is never followed."""
        want = None if prefix is None else _dir_name(prefix)
        for e in walk(self.root, want):
            if len(e.name) == 2 * HASH_BYTES and stat.S_ISREG(e.stat.st_mode):
                yield e

    def du(self, prefix: str | None) -> list[tuple[PrefixUsage, str | None]]:
        acc: dict[str, list] = {p: [0, 0, None] for p in self._prefixes(prefix)}
        for e in self._objects(prefix):
            g = acc.setdefault(e.prefix, [0, 0, None])
            g[0], g[1] = g[0] + 1, g[1] + e.stat.st_size
            if g[2] is None:
                head = _read_head(e.name, e.dir_fd)
                g[2] = None if head is None else header_fingerprint(head)
        return [(PrefixUsage(p, n, size), fp) for p, (n, size, fp) in sorted(acc.items())]

    def ls(self, prefix: str | None) -> Iterator[ObjectInfo]:
        now = time.time()
        for e in self._objects(prefix):
            yield ObjectInfo(e.prefix, e.name, e.stat.st_size, max(0.0, now - e.stat.st_mtime))

    def clear(self, prefix: str | None) -> Cleared:
        """Unlink the objects under ``prefix`` (every prefix dir: None) that start with a
        hicache object header (``codec.is_hicache_object``); any other file stays."""
        n, size, foreign = 0, 0, 0
        for e in self._objects(prefix):
            head = _read_head(e.name, e.dir_fd)
            if head is None or not codec.is_hicache_object(head):
                foreign += 1
                continue
            try:
                os.unlink(e.name, dir_fd=e.dir_fd)  # in the directory walked, whatever its path is now
            except FileNotFoundError:
                continue
            n, size = n + 1, size + e.stat.st_size
        from hicache.storage.file_cap import rescan_ledger
        from hicache.storage.file_cap import FilePerms
        rescan_ledger(self.root, FilePerms.of(self.group, str(self.root)).gid)
        return Cleared(n, size, foreign)


def _read_head(name: str, dir_fd: int) -> bytes | None:
    """A file's first bytes, enough for ``codec.parse_head`` (never through a symlink, never
    waiting on a FIFO); None when it cannot be read."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, dir_fd=dir_fd)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        head = os.pread(fd, HEAD_BYTES, 0)
        return os.pread(fd, codec.head_end(head), 0) if codec.head_end(head) > len(head) == HEAD_BYTES else head
    except OSError:
        return None
    finally:
        os.close(fd)


class RedisStore:
    def __init__(self, url: str, timeout_s: float):
        import redis
        from redis.cluster import RedisCluster
        from redis.exceptions import RedisClusterException
        self.url = url
        scheme, rest = url.split("://", 1)
        try:
            if scheme.lower().endswith("+cluster"):  # any one node finds the others
                userinfo, _, hosts = rest.rpartition("@")
                first = hosts.split("/")[0].split(",")[0]
                self.client: Any = RedisCluster.from_url(
                    f"{scheme.lower().removesuffix('+cluster')}://{userinfo + '@' if userinfo else ''}{first}",
                    socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
            else:
                self.client = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
            self.client.ping()
        except (redis.RedisError, RedisClusterException, ValueError, OSError) as e:
            raise StorageError(f"L3 {redact_url(url)}: cannot reach it ({error_text(e, url)}); check --url / "
                               "storage.url and that the server runs") from None

    def _keys(self, prefix: str | None) -> Iterator[list[bytes]]:
        p = (prefix or "hicache:").encode()
        pattern = re.sub(rb"([*?\[\]\\])", rb"\\\1", p) + b"*"
        batch: list[bytes] = []
        for k in self.client.scan_iter(match=pattern, count=BATCH):
            if len(k) > HASH_BYTES:
                batch.append(k)
            if len(batch) >= BATCH:
                yield batch
                batch = []
        if batch:
            yield batch

    def _sizes(self, keys: list[bytes]) -> list[int]:
        pipe = self.client.pipeline(transaction=False)
        for k in keys:
            pipe.strlen(k)
        return [r if isinstance(r, int) else 0 for r in pipe.execute(raise_on_error=False)]

    def du(self, prefix: str | None) -> list[tuple[PrefixUsage, str | None]]:
        acc: dict[bytes, list[int]] = {}
        first: dict[bytes, bytes] = {}
        for keys in self._keys(prefix):
            for k, n in zip(keys, self._sizes(keys)):
                g = acc.setdefault(k[:-HASH_BYTES], [0, 0])
                g[0] += 1
                g[1] += n
                first.setdefault(k[:-HASH_BYTES], k)
        out = []
        for p in sorted(acc):
            head = redis_heads(self.client, [first[p]])[0]
            out.append((PrefixUsage(p.decode("utf-8", "replace"), acc[p][0], acc[p][1]),
                        None if head is None else header_fingerprint(head)))
        return out

    def ls(self, prefix: str | None) -> Iterator[ObjectInfo]:
        for keys in self._keys(prefix):
            for k, n in zip(keys, self._sizes(keys)):
                yield ObjectInfo(k[:-HASH_BYTES].decode("utf-8", "replace"), k[-HASH_BYTES:].hex(), n, None)

    def clear(self, prefix: str | None) -> Cleared:
        """``UNLINK`` the keys under ``prefix`` whose value starts with a hicache object header
        (another application's ``user:session:...`` under a short ``--prefix`` stays)."""
        n, size, foreign = 0, 0, 0
        for keys in self._keys(prefix):
            heads = redis_heads(self.client, keys)
            ours = [k for k, h in zip(keys, heads) if h is not None and codec.is_hicache_object(h)]
            foreign += len(keys) - len(ours)
            if not ours:
                continue
            sizes = self._sizes(ours)
            pipe = self.client.pipeline(transaction=False)
            for k in ours:
                pipe.unlink(k)
            for r, s in zip(pipe.execute(raise_on_error=False), sizes):
                if r == 1:
                    n, size = n + 1, size + s
        return Cleared(n, size, foreign)

    def memory(self) -> dict[str, Any]:
        from hicache.storage.redis_backend import _server_memory
        return _server_memory(self.client.info("memory"), self.client.dbsize())


class MemoryStore:
    """``memory://`` lives inside one process; another process sees it empty."""

    def du(self, prefix: str | None) -> list[tuple[PrefixUsage, str | None]]:
        return []

    def ls(self, prefix: str | None) -> Iterator[ObjectInfo]:
        return iter(())

    def clear(self, prefix: str | None) -> Cleared:
        return Cleared(0, 0)


def open_store(url: str, timeout_s: float = 5.0, group: str = "") -> FileStore | RedisStore | MemoryStore:
    """The store behind an L3 URL, for the operator commands. Raises ``ConfigError``
    (bad or unsupported URL) or ``StorageError`` (unreachable)."""
    scheme = url.partition("://")[0].lower()
    if not url:
        raise ConfigError("no L3 configured (storage.url is empty); pass --url or set storage.url")
    if scheme == "file":
        from hicache.storage.file import parse_file_url
        return FileStore(parse_file_url(url), group)
    if scheme == "memory":
        return MemoryStore()
    if scheme in ("redis", "rediss", "redis+cluster", "rediss+cluster"):
        return RedisStore(url, timeout_s)
    raise ConfigError(f"storage url {redact_url(url)!r}: hicache storage works on file://, redis://, "
                      "redis+cluster:// and memory://; a hicache+unix:// service is cleared with "
                      "POST /v1/flush {\"tier\": \"L3\"}")
