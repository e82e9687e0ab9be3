"""``hicache storage fsck``: verify every object of an L3 store offline and, with
``--repair``, delete the ones that fail, remove crashed writers' temp files and
set a capped ``file://`` directory's size ledger to what is on disk.

Each object is checked as a reader would (framing, version, header checksum, page
hash against its key, length, checksum; with ``storage.auth_key`` the MAC), against
the fingerprint its header names, which must match a default prefix. Its size is
checked against its header before its payload is read (a file is mapped, a Redis
value read only once its size agrees). Never follows a symlink. Deletes only
failing objects that start with a hicache object header (``codec.is_hicache_object``,
the test ``clear`` applies too) and temp files older than ``file_cap.STALE_TMP_S``:
another program's file or key is reported and left alone.
"""
from __future__ import annotations

import mmap
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
from hicache.storage.admin import RedisStore, redis_heads
from hicache.storage.file import parse_file_url, read_head
from hicache.storage.file_cap import LEDGER, FileCap, _unlink, scan

_DEFAULT_DIR = re.compile(r"^hicache-([0-9a-f]{8})$")
_DEFAULT_PREFIX = re.compile(rb"^hicache:([0-9a-f]{8}):$")
_HEX = re.compile(r"^[0-9a-f]{%d}$" % (2 * HASH_BYTES))
BATCH = 256  # redis: keys per SCAN step and STRLEN / GETRANGE pipeline
PIPELINE_BYTES = 64 << 20  # redis: bytes of objects read whole per GET pipeline


class Bad(NamedTuple):
    where: str  # file path, or the Redis key (repr)
    why: str


class FsckReport(NamedTuple):
    objects: int  # hicache objects examined
    bad: list[Bad]  # those that fail verification
    deleted: int  # of those, deleted (--repair)
    stale_tmp: int  # crashed writers' temp files found (deleted with --repair)
    ledger: tuple[int, int] | None  # capped file://: (ledger bytes before, after); None: no ledger
    foreign: list[Bad] = []  # files / keys that are no hicache object: never deleted

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


def _judge_head(head: bytes, size: int) -> tuple[bool, str]:
    """(ours, why it fails before its payload is read: "" when it may be read whole) of an
    object of ``size`` bytes that starts with ``head``; ours only when
    ``codec.is_hicache_object`` says so (nothing else is ever deleted)."""
    if not codec.is_hicache_object(head):
        return False, codec.parse_head(head).why or "no hicache object header"  # type: ignore[union-attr]
    h = codec.parse_head(head)
    if isinstance(h, codec.Decoded):
        return True, h.why
    if h.size != size:
        return True, f"object is {size:,} bytes but its header declares {h.size:,}"
    return True, ""


def fsck_file(root: Path, auth_key: bytes = b"", repair: bool = False, prefix_dir: str | None = None) -> FsckReport:
    """Check (and with ``repair`` fix) a ``file://`` root; ``prefix_dir``: one layout's directory only.
    Files that are no hicache object are reported and left alone; an object deleted
    meanwhile (a running cache evicted it) is skipped."""
    n, bad, deleted, foreign = 0, [], 0, []
    for path, page_hash, expect in _file_objects(root, prefix_dir):
        try:
            ours, why = _judge_file(path, page_hash, expect, auth_key)
        except FileNotFoundError:
            continue
        except OSError as e:
            ours, why = False, f"unreadable: {e}"
        if not ours:
            foreign.append(Bad(path, why))
            continue
        n += 1
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
    return FsckReport(n, bad, deleted, len(stale), ledger, foreign)


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


def _judge_file(path: str, page_hash: bytes, expect: str | None, auth_key: bytes) -> tuple[bool, str]:
    """(ours, why it fails: "" when it verifies) of the file at ``path``: its size is
    checked against its header before its payload is read, and then it is mapped, not
    copied (a huge object costs page cache, never this process's memory)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return False, f"not a regular file (mode {stat.filemode(st.st_mode)})"
        ours, why = _judge_head(read_head(fd, st.st_size), st.st_size)
        if why or not ours:
            return ours, why
        with mmap.mmap(fd, st.st_size, access=mmap.ACCESS_READ) as mm:
            view = memoryview(mm)
            try:
                return True, judge(view, page_hash, expect, auth_key)
            finally:
                view.release()
    finally:
        os.close(fd)


def fsck_redis(client, auth_key: bytes = b"", repair: bool = False, prefix: bytes | None = None) -> FsckReport:
    """Check (and with ``repair`` UNLINK the failing) objects under ``prefix`` (default:
    every ``hicache:`` key) of a redis-py client, in pipelined batches. A value is read
    whole only once its size matches its header (``STRLEN`` and the first bytes first);
    keys that hold no hicache object are reported and left alone."""
    n, bad, deleted, foreign = 0, [], 0, []
    pattern = re.sub(rb"([*?\[\]\\])", rb"\\\1", prefix) + b"*" if prefix else b"hicache:*"
    keys: list[bytes] = []
    for k in client.scan_iter(match=pattern, count=1000):
        keys.append(k)
        if len(keys) >= BATCH:
            ours, gone = _redis_batch(client, keys, auth_key, repair, bad, foreign)
            n, deleted, keys = n + ours, deleted + gone, []
    if keys:
        ours, gone = _redis_batch(client, keys, auth_key, repair, bad, foreign)
        n, deleted = n + ours, deleted + gone
    return FsckReport(n, bad, deleted, 0, None, foreign)


def _redis_batch(client, keys: list[bytes], auth_key: bytes, repair: bool, bad: list[Bad],
                 foreign: list[Bad]) -> tuple[int, int]:
    """Judge one batch of keys, appending to ``bad`` and ``foreign``; returns (hicache
    objects among them, failing ones unlinked)."""
    pipe = client.pipeline(transaction=False)
    for k in keys:
        pipe.strlen(k)
    sizes = pipe.execute(raise_on_error=False)
    failing, whole, ours = [], [], 0
    for k, head, size in zip(keys, redis_heads(client, keys), sizes):
        if head is None or not isinstance(size, int):
            foreign.append(Bad(repr(k), "not a string value"))
            continue
        if not size:  # gone meanwhile (evicted), or empty: nothing of ours
            continue
        is_ours, why = _judge_head(head, size)
        if not is_ours:
            foreign.append(Bad(repr(k), why))
            continue
        ours += 1
        if why:
            failing.append((k, why))
        else:
            whole.append((k, size))
    failing.extend(_redis_verify(client, whole, auth_key))
    bad.extend(Bad(repr(k), why) for k, why in failing)
    if not repair or not failing:
        return ours, 0
    pipe = client.pipeline(transaction=False)
    for k, _ in failing:
        pipe.unlink(k)
    return ours, sum(r == 1 for r in pipe.execute(raise_on_error=False))


def _redis_verify(client, todo: list[tuple[bytes, int]], auth_key: bytes) -> Iterator[tuple[bytes, str]]:
    """(key, why) of each failing object of ``todo`` (key, size its header declares), read
    in pipelines of at most ``PIPELINE_BYTES`` (one object at least)."""
    i = 0
    while i < len(todo):
        j, nbytes = i, 0
        while j < len(todo) and (j == i or nbytes + todo[j][1] <= PIPELINE_BYTES):
            nbytes += todo[j][1]
            j += 1
        pipe = client.pipeline(transaction=False)
        for k, _ in todo[i:j]:
            pipe.get(k)
        for (k, _), obj in zip(todo[i:j], pipe.execute(raise_on_error=False)):
            if obj is None:  # gone meanwhile (evicted)
                continue
            pre, page_hash = k[:-HASH_BYTES], k[-HASH_BYTES:]
            m = _DEFAULT_PREFIX.match(pre)
            why = (f"not a page object ({obj!r:.60})" if not isinstance(obj, bytes)
                   else judge(obj, page_hash, m.group(1).decode() if m else None, auth_key))
            if why:
                yield k, why
        i = j


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
        r = _fsck_redis_url(url, max(1.0, cfg.storage.timeout_ms / 1000), mac, repair, prefix)
    else:
        raise ConfigError(f"hicache storage fsck: {shown!r} is not a file:// or redis:// URL "
                          "(memory:// lives inside one process; a cluster: fsck each node's URL)")
    _print(shown, r, repair, bool(mac))
    return 0 if r.clean or repair else 1


def _fsck_redis_url(url: str, timeout_s: float, mac: bytes, repair: bool, prefix: str | None) -> FsckReport:
    """``fsck_redis`` over the admin commands' connection (``admin.RedisStore``): its errors at
    connection, and ``hicache storage``'s for any later one, are redacted."""
    store = RedisStore(url, timeout_s)
    try:
        return fsck_redis(store.client, mac, repair, prefix.encode() if prefix else None)
    finally:
        store.client.close()


def _print(shown: str, r: FsckReport, repair: bool, mac: bool) -> None:
    did = "deleted" if repair else "kept; --repair deletes them"
    print(f"fsck {shown}: {r.objects:,} objects checked{' (with their MAC)' if mac else ''}, "
          f"{r.objects - len(r.bad):,} verify, {len(r.bad):,} fail" + (f" ({r.deleted:,} {did})" if r.bad and repair
                                                                         else f" ({did})" if r.bad else ""))
    for b in r.bad[:20]:
        print(f"  {b.where}: {b.why}")
    if len(r.bad) > 20:
        print(f"  ... and {len(r.bad) - 20:,} more")
    if r.foreign:
        print(f"{len(r.foreign):,} file(s) or key(s) hold no hicache object; left alone (not ours to delete):")
        for b in r.foreign[:5]:
            print(f"  {b.where}: {b.why}")
        if len(r.foreign) > 5:
            print(f"  ... and {len(r.foreign) - 5:,} more")
    if r.stale_tmp:
        print(f"{r.stale_tmp:,} crashed writers' temp file(s) " + ("deleted" if repair else "found; --repair deletes them"))
    if r.ledger is not None:
        print(ledger_verdict(*r.ledger, repair))


def ledger_verdict(ledger: int, on_disk: int, repaired: bool) -> str:
    """One line on a capped directory's size ledger against the bytes on disk, with what it means."""
    if repaired:
        return f"size ledger: {ledger:,} -> {on_disk:,} bytes (rescanned to what is on disk)"
    if ledger == on_disk:
        return f"size ledger: {ledger:,} bytes, as on disk: OK"
    if ledger > on_disk:
        return (f"size ledger: {ledger:,} bytes, on disk {on_disk:,}: over-counts by {ledger - on_disk:,} "
                "(the cap trims that much early until the next trim rescans; harmless; --repair rescans now)")
    return (f"size ledger: {ledger:,} bytes, on disk {on_disk:,}: under-counts by {on_disk - ledger:,} "
            "(the directory may exceed its cap; --repair rescans it)")
