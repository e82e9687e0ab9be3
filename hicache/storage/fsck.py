"""``hicache storage fsck``: verify every object of an L3 store offline and, with
``--repair``, delete the ones that fail, remove crashed writers' temp files and
set a capped ``file://`` directory's size ledger to what is on disk.

Each object is checked as a reader would (framing, version, header checksum,
page hash against its key, length, checksum; with ``storage.auth_key`` the
MAC), against the fingerprint its own header names, which must match its
prefix (``hicache:<fingerprint[:8]>:``, on ``file://`` the directory
``hicache-<fingerprint[:8]>``) where the prefix is a default one. Never
follows a symlink; deletes only objects that fail and temp files older than
``file_cap.STALE_TMP_S``.
"""
from __future__ import annotations

import os
import re
import stat
from pathlib import Path
from typing import Iterator, NamedTuple

from hicache.core.errors import ConfigError
from hicache.core.hashing import HASH_BYTES
from hicache.core.redact import redact_url
from hicache.storage import codec
from hicache.storage.codec import ReadStatus
from hicache.storage.file import parse_file_url
from hicache.storage.file_cap import LEDGER, FileCap, _unlink, scan

_DEFAULT_DIR = re.compile(r"^hicache-([0-9a-f]{8})$")
_DEFAULT_PREFIX = re.compile(rb"^hicache:([0-9a-f]{8}):$")
_HEX = re.compile(r"^[0-9a-f]{%d}$" % (2 * HASH_BYTES))
BATCH = 256  # redis: keys per SCAN step and GET pipeline


class Bad(NamedTuple):
    where: str  # file path, or the Redis key (repr)
    why: str


class FsckReport(NamedTuple):
    objects: int  # objects examined
    bad: list[Bad]  # those that fail verification
    deleted: int  # of those, deleted (--repair)
    stale_tmp: int  # crashed writers' temp files found (deleted with --repair)
    ledger: tuple[int, int] | None  # capped file://: (ledger bytes before, after); None: no ledger

    @property
    def clean(self) -> bool:
        return not self.bad and not self.stale_tmp and (self.ledger is None or self.ledger[0] >= self.ledger[1])


def judge(obj: codec.Buffer, page_hash: bytes, expect_fp8: str | None, auth_key: bytes) -> str:
    """Why the object fails verification ("" when it verifies), with the fingerprint its
    header names; ``expect_fp8``: the first 8 hex digits its prefix promises (None: any)."""
    hdr = codec._parse_header(codec.as_bytes_view(obj))
    if isinstance(hdr, codec.Decoded):
        return hdr.why
    fp = hdr.get("fingerprint")
    if not isinstance(fp, str):
        return f"fingerprint {fp!r} is not a string"
    if expect_fp8 is not None and not fp.startswith(expect_fp8):
        return f"fingerprint {fp!r} does not belong under the prefix of {expect_fp8!r}"
    d = codec.decode(obj, page_hash, fp, None, auth_key)
    return "" if d.status is ReadStatus.OK else d.why


def fsck_file(root: Path, auth_key: bytes = b"", repair: bool = False, prefix_dir: str | None = None) -> FsckReport:
    """Check (and with ``repair`` fix) a ``file://`` root; ``prefix_dir``: one layout's directory only."""
    n, bad, deleted = 0, [], 0
    for path, page_hash, expect in _file_objects(root, prefix_dir):
        n += 1
        try:
            why = judge(_read_regular(path), page_hash, expect, auth_key)
        except OSError as e:
            why = f"unreadable: {e}"
        if why:
            bad.append(Bad(path, why))
            if repair and _unlink(root, path) == "deleted":
                deleted += 1
    _, stale = scan(root)
    if repair:
        for f in stale:
            _unlink(root, f.path)
    ledger = None
    if (root / LEDGER).exists():
        cap = FileCap(root, max_bytes=1)
        before = cap.usage()[0]
        after = cap.rescan() if repair else sum(f.size for f in scan(root)[0])
        ledger = (before, after)
    return FsckReport(n, bad, deleted, len(stale), ledger)


def _file_objects(root: Path, only: str | None) -> Iterator[tuple[str, bytes, str | None]]:
    """``(path, page hash, fingerprint[:8] its directory promises)`` of every object file; names
    that are not a page hash's are yielded with an empty hash (they fail as strays)."""
    for pd in sorted(os.scandir(root), key=lambda e: e.name):
        if not pd.is_dir(follow_symlinks=False) or (only is not None and pd.name != only):
            continue
        m = _DEFAULT_DIR.match(pd.name)
        for sub in sorted(os.scandir(pd.path), key=lambda e: e.name):
            if len(sub.name) != 2 or not sub.is_dir(follow_symlinks=False):
                continue
            for f in sorted(os.scandir(sub.path), key=lambda e: e.name):
                if ".tmp." in f.name:
                    continue
                ok = _HEX.match(f.name) and f.name[:2] == sub.name
                yield f.path, bytes.fromhex(f.name) if ok else b"", m.group(1) if m else None


def _read_regular(path: str) -> bytes:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(f"{path} is not a regular file")
        chunks = []
        while chunk := os.read(fd, 8 << 20):
            chunks.append(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def fsck_redis(client, auth_key: bytes = b"", repair: bool = False, prefix: bytes | None = None) -> FsckReport:
    """Check (and with ``repair`` UNLINK the failing) objects under ``prefix`` (default:
    every ``hicache:`` key) of a redis-py client, in pipelined batches."""
    n, bad, deleted = 0, [], 0
    pattern = re.sub(rb"([*?\[\]\\])", rb"\\\1", prefix) + b"*" if prefix else b"hicache:*"
    keys: list[bytes] = []
    for k in client.scan_iter(match=pattern, count=1000):
        keys.append(k)
        if len(keys) >= BATCH:
            deleted += _redis_batch(client, keys, auth_key, repair, bad)
            n += len(keys)
            keys = []
    if keys:
        deleted += _redis_batch(client, keys, auth_key, repair, bad)
        n += len(keys)
    return FsckReport(n, bad, deleted, 0, None)


def _redis_batch(client, keys: list[bytes], auth_key: bytes, repair: bool, bad: list[Bad]) -> int:
    p = client.pipeline(transaction=False)
    for k in keys:
        p.get(k)
    failing = []
    for k, obj in zip(keys, p.execute(raise_on_error=False)):
        if obj is None:  # gone meanwhile
            continue
        pre, page_hash = k[:-HASH_BYTES], k[-HASH_BYTES:]
        m = _DEFAULT_PREFIX.match(pre)
        why = (f"not a page object ({obj!r:.60})" if not isinstance(obj, bytes)
               else judge(obj, page_hash, m.group(1).decode() if m else None, auth_key))
        if why:
            bad.append(Bad(repr(k), why))
            failing.append(k)
    if repair and failing:
        return int(client.unlink(*failing))
    return 0


def run(url: str, prefix: str | None, cfg, repair: bool) -> int:
    """``hicache storage fsck``: print the report; 0 when the store is clean (or was repaired), else 1."""
    key = cfg.storage.resolved_auth_key()
    mac = codec.mac_key(key) if key else b""
    shown = redact_url(url)
    if url.startswith("file:"):
        root = parse_file_url(url)
        if not root.is_dir():
            raise ConfigError(f"file:// L3 directory {str(root)!r} does not exist; check --url / storage.url")
        only = None if prefix is None else re.sub(r"[^A-Za-z0-9_.-]", "-", prefix).strip("-.")
        r = fsck_file(root, mac, repair, only)
    elif url.startswith(("redis://", "rediss://")):
        import redis
        client = redis.Redis.from_url(url, socket_timeout=max(1.0, cfg.storage.timeout_ms / 1000))
        try:
            r = fsck_redis(client, mac, repair, prefix.encode() if prefix else None)
        finally:
            client.close()
    else:
        raise ConfigError(f"hicache storage fsck: {shown!r} is not a file:// or redis:// URL "
                          "(memory:// lives inside one process; a cluster: fsck each node's URL)")
    _print(shown, r, repair, bool(mac))
    return 0 if r.clean or repair else 1


def _print(shown: str, r: FsckReport, repair: bool, mac: bool) -> None:
    did = "deleted" if repair else "kept; --repair deletes them"
    print(f"fsck {shown}: {r.objects:,} objects checked{' (with their MAC)' if mac else ''}, "
          f"{r.objects - len(r.bad):,} verify, {len(r.bad):,} fail" + (f" ({r.deleted:,} {did})" if r.bad and repair
                                                                         else f" ({did})" if r.bad else ""))
    for b in r.bad[:20]:
        print(f"  {b.where}: {b.why}")
    if len(r.bad) > 20:
        print(f"  ... and {len(r.bad) - 20:,} more")
    if r.stale_tmp:
        print(f"{r.stale_tmp:,} crashed writers' temp file(s) " + ("deleted" if repair else "found; --repair deletes them"))
    if r.ledger is not None:
        before, after = r.ledger
        if repair:
            print(f"size ledger: {before:,} -> {after:,} bytes (rescanned)")
        else:
            print(f"size ledger: {before:,} bytes, on disk {after:,}" +
                  ("" if before >= after else " (under-counts; --repair rescans it)"))
