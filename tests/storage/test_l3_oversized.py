"""An L3 object whose size is not what its header and the page's planes say (a sparse
300 GiB file, one grown by appends, a forged header claiming a huge payload) is refused
before anything is allocated for it: a counted corrupt miss, deleted, so ``exists()``
never offers it again; ``fsck`` reports it without reading it. ``fsck --repair`` and
``clear`` delete only what starts with a hicache object header (one check for both)."""
from __future__ import annotations

import os
import tracemalloc

import pytest
import redis

from hicache.cli import main
from hicache.core.hashing import page_hashes
from hicache.storage import codec, open_storage

FP = "0f1e2d3c4b5a69788796a5b4c3d2e1f0"
SIZES = [4096, 4096]
PAGE = 8192
HUGE = 300 << 30  # a sparse file: no disk, no memory, unless someone reads it


def keys(n: int) -> list[bytes]:
    return page_hashes(list(range(4 * n)), 4)


def _peak_bytes(fn) -> tuple[object, int]:
    """``fn()`` and the most bytes Python allocated meanwhile (every thread)."""
    tracemalloc.start()
    try:
        out = fn()
        return out, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def _stored(tmp_path, n: int = 2):
    b = open_storage(f"file://{tmp_path}", fingerprint=FP)
    ks = keys(n)
    assert b.put([(k, bytes([i + 1]) * PAGE, SIZES) for i, k in enumerate(ks)]) == n
    return b, ks


def _forged_huge(k: bytes) -> bytes:
    """A well-formed header (checksums included) that claims a 300 GiB payload of our layout."""
    t = codec.header_template(FP, [HUGE])
    return codec.header_of_segments(t, k, [memoryview(b"")])


@pytest.mark.parametrize("how", ["sparse", "appended", "forged"])
@pytest.mark.parametrize("read", ["get_into", "get"])
def test_an_oversized_object_is_a_corrupt_miss_deleted_before_any_allocation(tmp_path, how, read):
    b, (bad, good) = _stored(tmp_path)
    path = b.path_of(bad)
    if how == "sparse":
        os.truncate(path, HUGE)
    elif how == "appended":
        with open(path, "ab") as f:
            f.write(bytes(64 << 20))
    else:
        path.write_bytes(_forged_huge(bad))
        os.truncate(path, len(_forged_huge(bad)) + HUGE)
    try:
        if read == "get_into":
            dests = [bytearray(PAGE), bytearray(PAGE)]
            got, peak = _peak_bytes(lambda: b.get_into([bad, good], SIZES, dests))
            assert got == [False, True] and bytes(dests[1]) == bytes([2]) * PAGE
        else:
            got, peak = _peak_bytes(lambda: b.get([bad, good], SIZES))
            assert got[0] is None and bytes(got[1]) == bytes([2]) * PAGE
        assert peak < 4 << 20, f"{peak:,} bytes allocated to read a {PAGE}-byte page"
        s = b.stats()
        assert (s.corrupt, s.hits, s.misses) == (1, 1, 1), s
        assert not path.exists() and b.exists([bad, good]) == [False, True]
        assert b.prefix_hits([bad]) == 0  # never offered again
        b.check_integrity()
    finally:
        b.close()


def test_another_layouts_oversized_object_is_kept_not_read(tmp_path):
    b, (k, _) = _stored(tmp_path)
    path = b.path_of(k)
    path.write_bytes(codec.encode("a" * 32, k, [PAGE * 4], bytes(PAGE * 4)))
    try:
        dests = [bytearray(PAGE)]
        assert b.get_into([k], SIZES, dests) == [False]
        assert b.stats().fingerprint_mismatch == 1 and path.exists()
    finally:
        b.close()


def test_fsck_reports_an_oversized_object_without_reading_it(tmp_path, capsys):
    b, (bad, good) = _stored(tmp_path)
    os.truncate(b.path_of(bad), HUGE)
    b.close()
    url = f"file://{tmp_path}"
    rc, peak = _peak_bytes(lambda: main(["storage", "fsck", "--url", url]))
    out = capsys.readouterr().out
    assert rc == 1 and "2 objects checked, 1 verify, 1 fail" in out, out
    assert f"object is {HUGE:,} bytes but its header declares" in out
    assert peak < 4 << 20, peak
    assert main(["storage", "fsck", "--url", url, "--repair"]) == 0
    assert "1 fail (1 deleted)" in capsys.readouterr().out
    assert not b.path_of(bad).exists() and b.path_of(good).exists()


def test_fsck_repair_leaves_a_directory_that_is_no_store_alone(tmp_path, capsys):
    """A root that is (or holds) a git directory beside the store: fsck looks two levels
    down into every directory, and deletes only what starts with a hicache object header."""
    b, (k, _) = _stored(tmp_path)
    b.close()
    git = tmp_path / "objects" / "ab"  # storage.url=file:///repo/.git
    git.mkdir(parents=True)
    blob = git / ("ab" + "0" * 30)
    blob.write_bytes(b"x\x9c compressed git object")
    other = git / "cd0123"
    other.write_bytes(b"not ours either")
    ours_broken = b.path_of(k)
    raw = bytearray(ours_broken.read_bytes())
    raw[-1] ^= 1
    ours_broken.write_bytes(raw)
    assert main(["storage", "fsck", "--url", f"file://{tmp_path}", "--repair"]) == 0
    out = capsys.readouterr().out
    assert "1 fail (1 deleted)" in out and "2 file(s) or key(s) hold no hicache object; left alone" in out, out
    assert blob.read_bytes() == b"x\x9c compressed git object" and other.exists()
    assert not ours_broken.exists()


def test_clear_on_file_leaves_files_that_are_no_hicache_object(tmp_path, capsys):
    b, ks = _stored(tmp_path)
    stray = b.path_of(ks[0]).with_name("f" * 32)
    stray.write_bytes(b"someone else's file, named like a page")
    b.close()
    assert main(["storage", "clear", "--url", f"file://{tmp_path}", "--yes"]) == 0
    out = capsys.readouterr().out
    assert "deleted 2 objects" in out and "left 1 files that are no hicache object alone" in out, out
    assert stray.exists()


def test_fsck_repair_on_redis_touches_only_hicache_objects(private_redis, capsys):
    """Under a --prefix shared with another application, and under the default prefix
    (``hicache:app-config-v1:settings``), fsck --repair unlinks only failing hicache objects."""
    raw = redis.Redis(port=private_redis.port)
    b = open_storage(private_redis.url, fingerprint=FP)
    try:
        ks = keys(2)
        assert b.put([(k, bytes(PAGE), SIZES) for k in ks]) == 2
        full = b.key_prefix + ks[0]
        obj = bytearray(raw.get(full))
        obj[-1] ^= 1
        raw.set(full, bytes(obj))
        app = {b"hicache:app-config-v1:settings": b"{\"theme\": \"dark\"}", b.key_prefix + b"x" * 16: b"user data"}
        for k, v in app.items():
            raw.set(k, v)
        raw.hset(b.key_prefix + b"y" * 16, "field", "value")
        for argv in ([], ["--prefix", b.key_prefix.decode()]):
            rc = main(["storage", "fsck", "--url", private_redis.url, "--repair", *argv])
            out = capsys.readouterr().out
            assert rc == 0 and "left alone" in out, out
            assert all(raw.get(k) == v for k, v in app.items()) and raw.hget(b.key_prefix + b"y" * 16, "field")
        assert raw.exists(full) == 0 and raw.exists(b.key_prefix + ks[1]) == 1
    finally:
        b.close()


def test_live_fsck_skips_objects_evicted_while_it_runs(tmp_path, capsys, monkeypatch):
    """A running cache evicts objects under fsck's feet: they were reported as failing
    ("unreadable: No such file") and fsck exited 1 on a healthy store."""
    from hicache.storage import fsck
    b, ks = _stored(tmp_path, 3)
    b.close()
    real = fsck._file_objects

    def evicting(root, only):
        for i, (path, page_hash, expect) in enumerate(real(root, only)):
            if i == 1:
                os.unlink(path)  # the trim of a running cache, between listing and reading
            yield path, page_hash, expect
    monkeypatch.setattr(fsck, "_file_objects", evicting)
    assert main(["storage", "fsck", "--url", f"file://{tmp_path}"]) == 0
    out = capsys.readouterr().out
    assert "2 objects checked, 2 verify, 0 fail" in out, out
