"""L3 objects and the ``file://`` store against local tampering (issue 17, items 9-10).

Before the fix: the writer opened ``<object>.tmp.<pid>.<thread>`` with
O_TRUNC and followed a symlink planted there (overwriting the target); a FIFO
at an object path made ``get`` block forever; file I/O had no deadline; a bit
flip inside the fingerprint read as "another layout" (kept, warned once);
every corrupt object logged its own warning; a wrong-type Redis item was
counted silently.
"""
from __future__ import annotations

import logging
import os
import threading

import pytest
import redis

from hicache.core.errors import IntegrityError
from hicache.storage import codec, open_storage
from hicache.storage.codec import ReadStatus

FP = "0f1e2d3c4b5a69788796a5b4c3d2e1f0"
SIZES = [16, 16]
PAYLOAD = bytes(range(32))


def key(i: int) -> bytes:
    return i.to_bytes(16, "big")


def finishes(fn, limit: float = 30.0):
    """Run ``fn`` in a thread; fail (instead of hanging the suite) if it does not return within ``limit``."""
    out: list = []
    t = threading.Thread(target=lambda: out.append(fn()), daemon=True)
    t.start()
    t.join(limit)
    assert not t.is_alive(), f"{fn} still blocked after {limit}s"
    return out[0]


@pytest.fixture
def store(tmp_path):
    b = open_storage(f"file://{tmp_path}/l3", fingerprint=FP, timeout_ms=200)
    yield b
    b.close()


def test_a_symlink_at_the_temp_name_is_not_followed(store, tmp_path):
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    path = store.path_of(key(1))
    path.parent.mkdir(parents=True, exist_ok=True)
    for tid in {threading.get_ident(), *(t.ident for t in threading.enumerate())}:
        os.symlink(victim, f"{path}.tmp.{os.getpid()}.{tid}")  # the old, predictable temp names
    assert store.put([(key(1), PAYLOAD, SIZES)]) == 1
    assert victim.read_bytes() == b"precious"
    assert bytes(store.get([key(1)], SIZES)[0]) == PAYLOAD


def test_a_symlinked_fanout_directory_is_refused(store, tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    path = store.path_of(key(2))
    os.symlink(outside, path.parent)
    assert store.put([(key(2), PAYLOAD, SIZES)]) == 0
    assert os.listdir(outside) == [] and store.stats().put_dropped == 1


def test_a_fifo_or_symlink_at_an_object_path_is_a_counted_miss(store, tmp_path):
    assert store.put([(key(3), PAYLOAD, SIZES)]) == 1
    real = store.path_of(key(3))
    fifo, link = store.path_of(key(4)), store.path_of(key(5))
    fifo.parent.mkdir(parents=True, exist_ok=True)
    link.parent.mkdir(parents=True, exist_ok=True)
    os.mkfifo(fifo)
    os.symlink(real, link)
    got = finishes(lambda: store.get([key(4), key(5), key(3)], SIZES))
    assert got[0] is None and got[1] is None and bytes(got[2]) == PAYLOAD
    s = store.stats()
    assert (s.hits, s.misses, s.errors) == (1, 2, 2)
    with pytest.raises(IntegrityError, match="2 stored object"):
        store.check_integrity()  # reports both, without blocking on the FIFO


def test_file_io_honours_the_timeout(store, monkeypatch):
    stuck = threading.Event()
    monkeypatch.setattr(store, "_get_all", lambda *args: stuck.wait(60) and [])
    try:
        got = finishes(lambda: store.get([key(6)], SIZES))
        assert got == [None] and store.down  # an outage: later calls answer at once
        assert finishes(lambda: store.get([key(6)], SIZES)) == [None]
    finally:
        stuck.set()


def _flip_fingerprint(obj: bytes) -> bytes:
    i = obj.index(FP.encode()) + 5  # a hex digit inside the fingerprint
    b = bytearray(obj)
    b[i] ^= 0x01  # '4' <-> '5': still a well-formed hex fingerprint
    assert chr(b[i]) in "0123456789abcdef"
    return bytes(b)


def test_a_bit_flip_in_the_fingerprint_is_corrupt_not_another_layout():
    o = codec.encode(FP, key(7), SIZES, PAYLOAD)
    d = codec.decode(_flip_fingerprint(o), key(7), FP, SIZES)
    assert d.status is ReadStatus.CORRUPT and "header" in d.why
    # A real object of another layout is still told apart.
    other = codec.encode("a" * 32, key(7), SIZES, PAYLOAD)
    assert codec.decode(other, key(7), FP, SIZES).status is ReadStatus.FINGERPRINT


def test_corrupt_object_warnings_are_rate_limited(store, caplog):
    n = 60
    assert store.put([(key(100 + i), PAYLOAD, SIZES) for i in range(n)]) == n
    for i in range(n):
        p = store.path_of(key(100 + i))
        p.write_bytes(_flip_fingerprint(p.read_bytes()))
    with caplog.at_level(logging.WARNING, logger="hicache.storage.base"):
        assert store.get([key(100 + i) for i in range(n)], SIZES) == [None] * n
    assert store.stats().corrupt == n
    assert 1 <= len([m for m in caplog.messages if "corrupt object" in m]) <= 5


def test_a_wrong_type_redis_item_is_logged(redis_url, caplog):
    b = open_storage(redis_url, fingerprint=FP, key_prefix=f"hc-hard-{os.getpid()}:")
    r = redis.Redis.from_url(redis_url)
    try:
        r.rpush(b.key_prefix + key(9), b"x")
        with caplog.at_level(logging.WARNING, logger="hicache.storage.base"):
            assert b.get([key(9)], SIZES) == [None]
        assert any("WRONGTYPE" in m or "ResponseError" in m for m in caplog.messages), caplog.messages
        assert b.stats().errors == 1
    finally:
        r.delete(b.key_prefix + key(9))
        r.close()
        b.close()
