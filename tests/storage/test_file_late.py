"""file:// under load and late writes (issue 34, item 5): call budgets sized by pages,
bytes and load; a put that outlives its caller still reaches the ledger; an
under-counting ledger is reconciled by check_integrity (one warning) and by
``hicache storage fsck --repair``; a CPU hog drops no put and reports no outage."""
from __future__ import annotations

import logging
import multiprocessing as mp
import os
import threading
import time

import pytest
import redis

from hicache.cli import main
from hicache.core.hashing import page_hashes
from hicache.storage import codec, open_storage
from hicache.storage.file_cap import FileCap, scan
from hicache.storage.health import FLOOR_BYTES_PER_S, MIN_ATTEMPT_S, call_budget

from .conftest import FP

SIZES = [4096]


def keys(n: int, start: int = 0) -> list[bytes]:
    return page_hashes(list(range(4 * (start + n))), 4)[start:]


def disk_bytes(root) -> int:
    return sum(f.size for f in scan(root)[0])


def test_call_budget_grows_with_pages_bytes_and_load():
    assert call_budget(0.05, 2, 1, 0) == 3 * MIN_ATTEMPT_S
    assert call_budget(0.05, 2, 16, 0) == pytest.approx(3 * 0.8)
    assert call_budget(0.05, 0, 16, 200 << 20) == pytest.approx(0.8 + (200 << 20) / FLOOR_BYTES_PER_S)
    assert call_budget(0.05, 2, 16, 0, load=4.0) == pytest.approx(4 * 3 * 0.8)


def test_a_put_that_outlives_its_caller_is_accounted(tmp_path, monkeypatch):
    b = open_storage(f"file://{tmp_path}", fingerprint=FP, max_bytes=10 << 20, timeout_ms=1, max_retries=0)
    release, real = threading.Event(), b._write
    monkeypatch.setattr(b, "_write", lambda *a: release.wait(30) and real(*a))
    monkeypatch.setattr(b, "_budget", lambda n, nbytes: 0.05)
    try:
        assert b.put([(k, bytes(4096), SIZES) for k in keys(4)]) == 0  # the caller gave up
        assert b.stats().put_dropped == 4  # (an outage opened; the pinger may already have closed it)
        release.set()
        with b._idle:
            assert b._idle.wait_for(lambda: b._pending == 0, timeout=30)
        assert disk_bytes(tmp_path) == 4 * b.path_of(keys(1)[0]).stat().st_size
        assert FileCap(tmp_path, 1).usage() == (disk_bytes(tmp_path), 4)  # the late writes counted themselves
        b.check_integrity()
    finally:
        release.set()
        b.close()


def test_an_under_counting_ledger_is_reconciled_once_with_a_warning(tmp_path, caplog):
    b = open_storage(f"file://{tmp_path}", fingerprint=FP, max_bytes=10 << 20)
    try:
        assert b.put([(k, bytes(4096), SIZES) for k in keys(3)]) == 3
        # A writer that died between rename and accounting: an object the ledger never saw.
        k = keys(1, 50)[0]
        b.path_of(k).parent.mkdir(parents=True, exist_ok=True)
        b.path_of(k).write_bytes(codec.encode(FP, k, SIZES, bytes(4096)))
        assert FileCap(tmp_path, 1).usage()[0] < disk_bytes(tmp_path)
        with caplog.at_level(logging.WARNING, logger="hicache.storage.base"):
            b.check_integrity()
            b.path_of(keys(1, 51)[0]).parent.mkdir(parents=True, exist_ok=True)
            b.path_of(keys(1, 51)[0]).write_bytes(codec.encode(FP, keys(1, 51)[0], SIZES, bytes(4096)))
            b.check_integrity()  # reconciled again, warned once
        warned = [r.getMessage() for r in caplog.records if "size ledger" in r.getMessage()]
        assert len(warned) == 1 and "hicache storage fsck" in warned[0], warned
        assert FileCap(tmp_path, 1).usage() == (disk_bytes(tmp_path), 5)
        assert bytes(b.get([k], SIZES)[0]) == bytes(4096)
    finally:
        b.close()


def _cli(capsys, *argv: str) -> tuple[int, str]:
    rc = main(["storage", "fsck", *argv])
    return rc, capsys.readouterr().out


def test_fsck_file_finds_and_repairs(tmp_path, capsys):
    url = f"file://{tmp_path}"
    b = open_storage(url, fingerprint=FP, max_bytes=10 << 20)
    ks = keys(6)
    assert b.put([(k, bytes([i]) * 4096, SIZES) for i, k in enumerate(ks)]) == 6
    flipped, cut, swapped, foreign = (b.path_of(k) for k in ks[:4])
    raw = bytearray(flipped.read_bytes())
    raw[-7] ^= 1
    flipped.write_bytes(raw)
    cut.write_bytes(cut.read_bytes()[:-100])
    swapped.write_bytes(b.path_of(ks[5]).read_bytes())  # another page's object under this key
    foreign.write_bytes(codec.encode("f" * 32, ks[3], SIZES, bytes(4096)))  # another layout's, in our dir
    stale = b.path_of(ks[4]).with_name(b.path_of(ks[4]).name + ".tmp.1.dead")
    stale.write_bytes(b"partial")
    os.utime(stale, (time.time() - 3600,) * 2)
    extra = keys(1, 60)[0]  # an object the ledger never saw
    b.path_of(extra).parent.mkdir(parents=True, exist_ok=True)
    b.path_of(extra).write_bytes(codec.encode(FP, extra, SIZES, bytes(4096)))
    b.close()
    rc, out = _cli(capsys, "--url", url)
    assert rc == 1 and "7 objects checked, 3 verify, 4 fail (kept; --repair deletes them)" in out, out
    for why in ("checksum", "but its header declares", "page hash", "does not belong under the prefix"):
        assert why in out, (why, out)
    assert "1 crashed writers' temp file(s) found" in out and "under-counts" in out
    rc, out = _cli(capsys, "--url", url, "--repair")
    assert rc == 0 and "4 fail (4 deleted)" in out and "rescanned" in out, out
    assert not stale.exists() and sorted(f.path for f in scan(tmp_path)[0]) == sorted(
        str(b.path_of(k)) for k in (ks[4], ks[5], extra))
    assert FileCap(tmp_path, 1).usage() == (disk_bytes(tmp_path), 3)
    rc, out = _cli(capsys, "--url", url)
    assert rc == 0 and "3 objects checked, 3 verify, 0 fail" in out, out


def test_fsck_checks_macs_with_the_configured_key(tmp_path, capsys, monkeypatch):
    url, secret = f"file://{tmp_path}", "a-shared-secret-of-32-characters"
    b = open_storage(url, fingerprint=FP, auth_key=secret)
    assert b.put([(k, bytes(4096), SIZES) for k in keys(2)]) == 2
    forged = keys(1)[0]
    b.path_of(forged).write_bytes(codec.encode(FP, forged, SIZES, bytes(4096)))  # no MAC
    b.close()
    assert _cli(capsys, "--url", url)[0] == 0  # without the key: both verify by their checksums
    monkeypatch.setenv("HICACHE_STORAGE__AUTH_KEY", secret)
    rc, out = _cli(capsys, "--url", url)
    assert rc == 1 and "with their MAC" in out and "no MAC" in out, out


def test_fsck_redis(private_redis, capsys):
    b = open_storage(private_redis.url, fingerprint=FP)
    ks = keys(3)
    assert b.put([(k, bytes(4096), SIZES) for k in ks]) == 3
    raw = redis.Redis(port=private_redis.port)
    full = b.key_prefix + ks[0]
    obj = bytearray(raw.get(full))
    obj[-1] ^= 0x80
    raw.set(full, bytes(obj))
    raw.set(b.key_prefix + ks[1], b"not an object")
    rc, out = _cli(capsys, "--url", private_redis.url)
    assert rc == 1 and "2 objects checked, 1 verify, 1 fail" in out and "1 file(s) or key(s) hold no" in out, out
    rc, out = _cli(capsys, "--url", private_redis.url, "--repair")
    assert rc == 0 and "1 deleted" in out
    assert raw.exists(full) == 0 and raw.exists(b.key_prefix + ks[2]) == 1
    assert raw.get(b.key_prefix + ks[1]) == b"not an object"  # not provably ours: left alone
    b.close()


def _spin(stop=None) -> None:
    while stop is None or not stop.is_set():
        pass


def test_a_cpu_hog_drops_no_put_and_reports_no_outage(tmp_path, caplog):
    """Default options (timeout_ms 50, as HiCacheTier and the README's replay use) on a box
    whose cores are all busy, in a process whose other threads hold the GIL (an engine's
    or the replay's compute): every put lands, every read verifies, no outage. (A flat
    50 ms x 3 attempts per page failed single-page calls here.)"""
    ctx = mp.get_context("spawn")
    hogs = [ctx.Process(target=_spin, daemon=True) for _ in range(2 * (os.cpu_count() or 1) + 2)]
    for p in hogs:
        p.start()
    stop = threading.Event()
    gil = [threading.Thread(target=_spin, args=(stop,), daemon=True) for _ in range(2)]
    for t in gil:
        t.start()
    b = open_storage(f"file://{tmp_path}", fingerprint=FP, max_bytes=64 << 20)
    try:
        with caplog.at_level(logging.WARNING):
            for r in range(3):
                ks = keys(16, 16 * r)
                pages = [(k, bytes([(r + i) % 251]) * (64 << 10), [64 << 10]) for i, k in enumerate(ks)]
                assert b.put(pages) == 16, b.stats()
                dests = [bytearray(64 << 10) for _ in ks]
                assert b.get_into(ks, [64 << 10], dests) == [True] * 16
                assert [bytes(d) for d in dests] == [p[1] for p in pages]
                assert b.prefix_hits(ks) == 16
                for k, payload, sizes in pages[:4]:  # single pages: what a flat 150 ms budget failed first
                    assert b.put([(k, payload, sizes)]) == 1 and bytes(b.get([k], sizes)[0]) == payload
        s = b.stats()
        assert (s.put_dropped, s.errors, b.down) == (0, 0, False), s
        assert not [r for r in caplog.records if "unreachable" in r.getMessage()]
        b.check_integrity()
    finally:
        stop.set()
        for t in gil:
            t.join()
        for p in hogs:
            p.kill()
        for p in hogs:
            p.join()
        b.close()


def test_a_read_that_outlives_its_caller_writes_no_further_page(tmp_path, monkeypatch):
    """After get_into gave up (an outage), a worker finishes the page it was reading and
    reads no other into the caller's rows (which the engine reuses at once)."""
    import hicache.storage.file as file_mod
    n, size = 8, 2 << 20  # 16 MiB: split among the 4 workers, two pages each
    b = open_storage(f"file://{tmp_path}", fingerprint=FP)
    ks = keys(n)
    assert b.put([(k, bytes([i + 1]) * size, [size]) for i, k in enumerate(ks)]) == n
    release, real = threading.Event(), file_mod._open_object

    def stuck(*args):
        release.wait(30)
        return real(*args)
    monkeypatch.setattr(file_mod, "_open_object", stuck)
    monkeypatch.setattr(b, "_budget", lambda n, nbytes: 0.2)
    monkeypatch.setattr(b, "_parts", lambda n, nbytes: 4)  # as on an idle box of >= 4 cores
    dests = [bytearray(size) for _ in ks]
    try:
        assert b.get_into(ks, [size], dests) == [False] * n
        assert not b.wait_late_reads(0.05)  # the four parts still read
        release.set()
        assert b.wait_late_reads(30)
        written = [i for i, d in enumerate(dests) if any(d[:1])]
        assert written == [0, 2, 4, 6], written  # the first page of each part, none after
    finally:
        release.set()
        b.close()


def test_a_settled_read_over_its_budget_is_an_outage_with_nothing_left_reading(tmp_path, monkeypatch):
    """``get_into_settled`` (the L2 prefetch's read) reads on the caller and on workers; once
    its budget is spent every part stops before its next page, the call counts an outage, and
    when it returns no read can land in the pages any more (no late reads to wait for)."""
    import time
    import hicache.storage.file as file_mod
    n, size = 8, 2 << 20
    b = open_storage(f"file://{tmp_path}", fingerprint=FP)
    ks = keys(n)
    assert b.put([(k, bytes([i + 1]) * size, [size]) for i, k in enumerate(ks)]) == n
    real, mu, first, opened = file_mod._open_object, threading.Lock(), [], []

    def stuck(*args):  # each part's first open hangs until the call's 0.2 s budget is long spent
        with mu:
            first.append(first[0] if first else time.monotonic())
            until = first[0] + 0.4
        time.sleep(max(0.0, until - time.monotonic()))
        opened.append(time.monotonic())
        return real(*args)
    monkeypatch.setattr(file_mod, "_open_object", stuck)
    monkeypatch.setattr(b, "_budget", lambda n, nbytes: 0.2)
    monkeypatch.setattr(b, "_parts", lambda n, nbytes: 4)  # the caller and three workers
    dests = [bytearray(size) for _ in ks]
    try:
        assert b.get_into_settled(ks, [size], dests) == [False] * n
        done = time.monotonic()
        assert len(opened) == 4 and max(opened) <= done  # it returned only once its reads were over
        assert b.wait_late_reads(0)
        written = [i for i, d in enumerate(dests) if any(d[:1])]
        assert written == [0, 2, 4, 6], written  # the first page of each part, none after
        assert b.down and b.stats().errors == 1
    finally:
        b.close()
