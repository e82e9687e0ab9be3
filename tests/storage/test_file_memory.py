"""file:// specifics (restart survival, atomic writes, fan-out, URL forms) and
memory:// eviction."""
from __future__ import annotations

import os

import pytest

from hicache.core.errors import ConfigError, IntegrityError
from hicache.core.hashing import page_hashes
from hicache.storage import open_storage

from .conftest import FP


def keys(n: int) -> list[bytes]:
    return page_hashes(list(range(4 * n)), 4)


def all_files(root) -> list[str]:
    return sorted(os.path.relpath(os.path.join(d, f), root) for d, _, fs in os.walk(root) for f in fs)


def test_file_survives_restart_with_fanout_layout(tmp_path):
    k = keys(2)
    a = open_storage(f"file://{tmp_path}", fingerprint=FP)
    assert a.put([(k[0], b"0123", [4]), (k[1], b"4567", [4])]) == 2
    a.close()
    assert all_files(tmp_path) == sorted(f"hicache-0f1e2d3c/{h.hex()[:2]}/{h.hex()}" for h in k)
    b = open_storage(f"file://{tmp_path}", fingerprint=FP)
    assert [bytes(p) for p in b.get(k, [4])] == [b"0123", b"4567"]
    b.check_integrity()


def test_relative_file_url(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    b = open_storage("file://./rel/l3", fingerprint=FP, key_prefix="x:")
    assert b.put([(keys(1)[0], b"ab", [2])]) == 1
    h = keys(1)[0].hex()
    assert all_files(tmp_path / "rel" / "l3") == [f"x/{h[:2]}/{h}"]


def test_big_payload_and_no_temp_files_left(tmp_path):
    b = open_storage(f"file://{tmp_path}", fingerprint=FP, fsync=True)
    payload = os.urandom(3 << 20)
    k = keys(1)[0]
    assert b.put([(k, memoryview(payload), [1 << 20, 2 << 20])]) == 1
    assert bytes(b.get([k], [1 << 20, 2 << 20])[0]) == payload
    assert not [f for f in all_files(tmp_path) if ".tmp." in f]


def test_crash_leftover_temp_file_is_ignored(tmp_path):
    b = open_storage(f"file://{tmp_path}", fingerprint=FP)
    k = keys(2)
    assert b.put([(k[0], b"ab", [2])]) == 1
    b.path_of(k[1]).parent.mkdir(parents=True, exist_ok=True)
    (b.path_of(k[1]).parent / (k[1].hex() + ".tmp.999.1")).write_bytes(b"half-writ")
    assert b.exists(k) == [True, False] and b.prefix_hits(k) == 1
    assert b.get(k, [2])[1] is None and b.stats().corrupt == 0
    b.check_integrity()


def test_stray_file_fails_integrity(tmp_path):
    b = open_storage(f"file://{tmp_path}", fingerprint=FP)
    b.put([(keys(1)[0], b"ab", [2])])
    (b.dir / "00").mkdir(exist_ok=True)
    (b.dir / "00" / "notes.txt").write_text("hello")
    with pytest.raises(IntegrityError, match="1 stored object"):
        b.check_integrity()


def test_directory_removed_under_a_running_backend(tmp_path):
    import shutil
    b = open_storage(f"file://{tmp_path}/l3", fingerprint=FP)
    k = keys(1)[0]
    assert b.put([(k, b"ab", [2])]) == 1
    shutil.rmtree(tmp_path / "l3")
    assert b.get([k], [2]) == [None]
    assert b.put([(k, b"cd", [2])]) == 1
    assert bytes(b.get([k], [2])[0]) == b"cd"


def test_unwritable_directory_is_a_config_error(tmp_path):
    (tmp_path / "f").write_text("a file, not a directory")
    with pytest.raises(ConfigError, match="cannot create directory"):
        open_storage(f"file://{tmp_path}/f/l3", fingerprint=FP)
    with pytest.raises(ConfigError, match="needs a directory"):
        open_storage("file://", fingerprint=FP)


def test_memory_max_bytes_evicts_least_recently_used():
    k = keys(4)
    probe = open_storage("memory://", fingerprint=FP)
    probe.put([(k[0], b"a" * 100, [100])])
    obj_bytes = len(probe.raw_object(k[0]))  # every object below has this size
    b = open_storage("memory://", fingerprint=FP, max_bytes=3 * obj_bytes)
    assert b.put([(k[0], b"a" * 100, [100]), (k[1], b"b" * 100, [100])]) == 2
    b.get([k[0]], [100])  # k0 is now more recent than k1
    assert b.put([(k[2], b"c" * 100, [100]), (k[3], b"d" * 100, [100])]) == 2
    assert b.exists(k) == [True, False, True, True]
    b.check_integrity()
    with pytest.raises(ConfigError, match="max_bytes"):
        open_storage("memory://", fingerprint=FP, max_bytes=-1)


def test_short_writev_and_preadv_still_move_every_byte(tmp_path, monkeypatch):
    """The kernel may move fewer bytes than asked (signals, pipes, some file systems): a put
    (``writev``) and a get into rows (``preadv``) of a real page (llama-3.1-8b, page 16, every
    plane) that only ever move an odd number of bytes per call still round-trip exactly."""
    from hicache.core.shapes import model_shape
    from hicache.storage import file as file_mod

    lay = model_shape("llama-3.1-8b").kv_layout(16)
    sizes = [p.page_bytes for p in lay.planes]
    payload = os.urandom(sum(sizes))
    real_writev, real_preadv, calls = os.writev, os.preadv, {"w": 0, "r": 0}

    def short_writev(fd, bufs):
        calls["w"] += 1
        return real_writev(fd, [memoryview(b"".join(bytes(b) for b in bufs)[:100_003])])

    def short_preadv(fd, bufs, offset):
        calls["r"] += 1
        first = bufs[0]
        return real_preadv(fd, [first[:min(first.nbytes, 70_001)]], offset)

    monkeypatch.setattr(file_mod.os, "writev", short_writev)
    monkeypatch.setattr(file_mod.os, "preadv", short_preadv)
    b = open_storage(f"file://{tmp_path}", fingerprint=FP)
    k = keys(1)[0]
    assert b.put([(k, memoryview(payload), sizes)]) == 1
    dest = [bytearray(len(payload))]
    assert b.get_into([k], sizes, dest) == [True]
    assert dest[0] == payload
    assert calls["w"] > len(payload) // 100_003 and calls["r"] > len(payload) // 70_001
