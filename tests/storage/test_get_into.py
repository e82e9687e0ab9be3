"""``StorageBackend.get_into`` (payloads read straight into the caller's rows,
verified there) and ``put_new`` (one call that skips stored pages), on every
published model shape at the adapters' sizes: vLLM's block-16 row and SGLang's
pages of 1, 16 and 64 (MLA) tokens."""
from __future__ import annotations

import os
import random
import struct
import threading

import msgpack
import pytest

from hicache.core.hashing import page_hashes
from hicache.core.shapes import model_shapes
from hicache.storage import codec
from hicache.storage.into import InPlace, header_of, verify_into

SHAPES = {m.name: m for m in model_shapes()}
# vLLM's row is the block-16 page of all layers; SGLang pages 1 and 16, MLA also 64.
CASES = ([(n, 16) for n in SHAPES] + [(n, 1) for n in SHAPES] + [(n, 64) for n, m in SHAPES.items() if m.is_mla])
KEY = "get-into-test-key-0123456789abcdef"
FILL = 0xA5  # what a destination holds before a read


def payload_of(nbytes: int, seed: str) -> bytes:
    return random.Random(seed).randbytes(nbytes)


def sizes_of(name: str, page_size: int) -> list[int]:
    return [p.page_bytes for p in SHAPES[name].kv_layout(page_size).planes]


def rows(n: int, nbytes: int) -> list[bytearray]:
    return [bytearray([FILL]) * nbytes for _ in range(n)]


@pytest.mark.parametrize("harness", ["memory", "file", "redis"], indirect=True)
@pytest.mark.parametrize("name,page_size", CASES)
def test_get_into_round_trips_real_pages(harness, name, page_size):
    b = harness.backend
    sizes = sizes_of(name, page_size)
    total = sum(sizes)
    ks = page_hashes(list(range(3 * page_size)), page_size, namespace=f"into/{name}")
    pages = [payload_of(total, f"{name}/{page_size}/{i}") for i in range(2)]
    assert b.put_new([(k, p, sizes) for k, p in zip(ks, pages)]) == [True, True]
    dest = rows(3, total)
    assert b.get_into([ks[1], ks[2], ks[0]], sizes, dest) == [True, False, True]
    assert dest[0] == pages[1] and dest[2] == pages[0]
    s = b.stats()
    assert (s.gets, s.hits, s.misses, s.corrupt, s.bytes_read) == (3, 2, 1, 0, 2 * total)
    b.check_integrity()


def _flip(obj: bytes, pos: int) -> bytes:
    out = bytearray(obj)
    out[pos] ^= 0x40
    return bytes(out)


def _bad_objects(fp: str, key: bytes, sizes: list[int], payload: bytes) -> dict[str, bytes]:
    """Objects at ``key`` that must all be misses: name -> object."""
    good = codec.encode(fp, key, sizes, payload)
    hlen = struct.unpack_from("<4sI", good)[1]
    other = codec.encode(fp, bytes(16), sizes, payload)  # a whole object of another page
    return {"payload bit": _flip(good, len(good) - 1), "header bit": _flip(good, 8 + hlen // 2),
            "magic": _flip(good, 0), "short": good[:-1], "long": good + b"\0", "empty": b"",
            "prefix only": good[:8], "another page's object": other,
            "huge head": b"\0" * (len(good) + 70_000)}


@pytest.mark.parametrize("harness", ["memory", "file", "redis"], indirect=True)
@pytest.mark.parametrize("name,page_size", [("opt-125m", 1), ("llama-3.1-8b", 16), ("deepseek-v3", 64)])
def test_corrupt_objects_are_counted_misses_and_deleted(harness, name, page_size):
    b = harness.backend
    sizes = sizes_of(name, page_size)
    payload = payload_of(sum(sizes), name)
    names = list(_bad_objects(b.fingerprint, bytes(16), sizes, payload))
    ks = page_hashes(list(range(len(names) * page_size)), page_size, namespace=f"bad/{name}")
    for k, what in zip(ks, names):  # each damaged object written for its own key
        harness.write_raw(k, _bad_objects(b.fingerprint, k, sizes, payload)[what])
    got = b.get_into(ks, sizes, rows(len(ks), sum(sizes)))
    assert got == [False] * len(ks), [n for n, g in zip(names, got) if g]
    s = b.stats()
    assert (s.misses, s.corrupt, s.hits) == (len(ks), len(ks), 0)
    assert [harness.read_raw(k) for k in ks] == [None] * len(ks)  # each one deleted on read
    b.check_integrity()


@pytest.mark.parametrize("harness", ["memory", "file", "redis"], indirect=True)
def test_foreign_objects_are_misses_and_kept(harness):
    b = harness.backend
    sizes = sizes_of("qwen3-8b", 16)
    other = SHAPES["gpt-oss-120b"].kv_layout(16)
    osizes = [p.page_bytes for p in other.planes]
    ks = page_hashes(list(range(32)), 16, namespace="foreign")
    # Same length as ours and another length: both are another layout's, not corrupt.
    harness.write_raw(ks[0], codec.encode(other.fingerprint(), ks[0], [sum(sizes)], payload_of(sum(sizes), "a")))
    harness.write_raw(ks[1], codec.encode(other.fingerprint(), ks[1], osizes, payload_of(sum(osizes), "b")))
    assert b.get_into(ks, sizes, rows(2, sum(sizes))) == [False, False]
    s = b.stats()
    assert (s.misses, s.fingerprint_mismatch, s.corrupt) == (2, 2, 0)
    assert harness.read_raw(ks[0]) is not None and harness.read_raw(ks[1]) is not None


@pytest.mark.parametrize("harness", ["file", "redis"], indirect=True)  # memory:// reopens empty
def test_forged_objects_are_misses_with_a_key(harness):
    b = harness.reopen(auth_key=KEY)
    try:
        sizes = sizes_of("llama-3.2-1b", 16)
        ks = page_hashes(list(range(48)), 16, namespace="forged")
        good = payload_of(sum(sizes), "good")
        assert b.put_new([(ks[0], good, sizes)]) == [True]
        # Well formed, right fingerprint and checksum, no MAC / a MAC under another key.
        harness.write_raw(ks[1], codec.encode(b.fingerprint, ks[1], sizes, payload_of(sum(sizes), "f")))
        harness.write_raw(ks[2], codec.encode(b.fingerprint, ks[2], sizes, payload_of(sum(sizes), "g"),
                                              codec.mac_key(b"another-key-0123456789abcdef")))
        dest = rows(3, sum(sizes))
        assert b.get_into(ks, sizes, dest) == [True, False, False]
        assert dest[0] == good
        s = b.stats()
        assert (s.hits, s.misses, s.corrupt) == (1, 2, 2)
        b.check_integrity()
    finally:
        b.close()


def test_an_object_without_header_checksum_still_verifies(tmp_path):
    """Objects written before ``hck`` existed take the fallback path and load."""
    from hicache.storage import open_storage
    b = open_storage(f"file://{tmp_path}/l3", fingerprint="f" * 32)
    sizes, key = [300, 700], bytes(range(16))
    payload = payload_of(1000, "old")
    hdr = msgpack.packb({"version": codec.FORMAT_VERSION, "fingerprint": b.fingerprint, "hash": key,
                         "plane_sizes": sizes, "length": 1000, "checksum": codec.checksum(payload)})
    b.path_of(key).parent.mkdir(parents=True, exist_ok=True)
    b.path_of(key).write_bytes(struct.pack("<4sI", codec.MAGIC, len(hdr)) + hdr + payload)
    dest = rows(1, 1000)
    assert b.get_into([key], sizes, dest) == [True] and dest[0] == payload
    b.close()


def test_verify_into_judges_the_destination_bytes():
    fp, key, sizes = "e" * 32, bytes(range(16)), [64, 64]
    payload = bytearray(payload_of(128, "v"))
    t = codec.header_template(fp, sizes)
    hdr = codec.encode_header(fp, key, sizes, payload)
    assert verify_into(hdr, [memoryview(payload)], key, fp, t) is codec.ReadStatus.OK
    payload[5] ^= 1
    d = verify_into(hdr, [memoryview(payload)], key, fp, t)
    assert d.status is codec.ReadStatus.CORRUPT and "checksum" in d.why
    assert InPlace(hdr).header == hdr


@pytest.mark.parametrize("harness", ["memory", "file"], indirect=True)
def test_get_into_misuse_raises_naming_the_values(harness):
    b = harness.backend
    with pytest.raises(ValueError, match="2 keys but 1 destinations"):
        b.get_into([bytes(16), bytes(range(16))], [8], [bytearray(8)])
    with pytest.raises(ValueError, match="destination 0 has 7 bytes, the page payload 8"):
        b.get_into([bytes(16)], [8], [bytearray(7)])
    with pytest.raises(ValueError, match="read-only"):
        b.get_into([bytes(16)], [8], [bytes(8)])
    assert b.stats().gets == 0


@pytest.mark.parametrize("harness", ["memory", "file", "redis"], indirect=True)
def test_put_new_skips_stored_pages(harness):
    b = harness.backend
    sizes = [4096]
    ks = page_hashes(list(range(48)), 16, namespace="put-new")
    first = [payload_of(4096, f"1/{i}") for i in range(3)]
    assert b.put_new([(ks[0], first[0], sizes)]) == [True]
    # ks[0] is stored: not rewritten (its bytes stay the first ones), the others are.
    assert b.put_new([(k, p, sizes) for k, p in zip(ks, [b"\1" * 4096] + first[1:])]) == [True] * 3
    dest = rows(3, 4096)
    assert b.get_into(ks, sizes, dest) == [True] * 3 and [bytes(d) for d in dest] == first
    s = b.stats()
    assert (s.put_ok, s.put_dropped, s.bytes_written) == (3, 0, 3 * 4096)
    b.check_integrity()


def test_file_calls_from_many_threads_overlap_byte_exact(tmp_path):
    """The file backend's workers run independent calls at once; every page lands whole."""
    from hicache.storage import open_storage
    b = open_storage(f"file://{tmp_path}/l3", fingerprint="c" * 32, max_bytes=64 << 20)
    sizes = sizes_of("opt-125m", 1)
    total = sum(sizes)
    errors: list[BaseException] = []

    def worker(t: int) -> None:
        try:
            ks = page_hashes(list(range(8)), 1, namespace=f"thread/{t}")
            pages = [payload_of(total, f"{t}/{i}") for i in range(8)]
            for _ in range(3):
                assert b.put_new([(k, p, sizes) for k, p in zip(ks, pages)]) == [True] * 8
                dest = rows(8, total)
                assert b.get_into(ks, sizes, dest) == [True] * 8
                assert [bytes(d) for d in dest] == pages
        except BaseException as e:  # noqa: BLE001 - reported below, on the test's thread
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(6)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert errors == []
    s = b.stats()
    assert (s.put_ok, s.hits, s.misses) == (48, 6 * 3 * 8, 0)
    b.check_integrity()
    b.close()


def test_file_get_into_of_a_fifo_is_a_counted_error(tmp_path):
    from hicache.storage import open_storage
    b = open_storage(f"file://{tmp_path}/l3", fingerprint="d" * 32)
    key = bytes(range(16))
    b.path_of(key).parent.mkdir(parents=True, exist_ok=True)
    os.mkfifo(b.path_of(key))
    assert b.get_into([key], [16], rows(1, 16)) == [False]
    s = b.stats()
    assert (s.misses, s.errors) == (1, 1)
    b.close()


@pytest.mark.parametrize("auth", [False, True])
@pytest.mark.parametrize("harness", ["memory", "file", "redis"], indirect=True)
def test_get_into_scatters_into_segments(harness, auth):
    """A page's payload fills a list of segments in order (SGLang's K and V per page,
    or one segment per layer), verified there; a flipped byte is a miss."""
    b = harness.reopen(auth_key=KEY) if auth else harness.backend
    try:
        name = "llama-3.1-8b"
        sizes = sizes_of(name, 1)
        total = sum(sizes)
        ks = page_hashes(list(range(2)), 1, namespace=f"scatter/{auth}")
        pages = [payload_of(total, f"s/{i}") for i in range(2)]
        assert b.put_new([(k, p, sizes) for k, p in zip(ks, pages)]) == [True, True]
        # 2 x 32 layers of uneven pieces, then K/V halves.
        cuts = sorted(random.Random(1).sample(range(1, total), 63))
        bufs = [bytearray(e - s) for s, e in zip([0, *cuts], [*cuts, total])]
        halves = [bytearray(total // 2), bytearray(total - total // 2)]
        assert b.get_into(ks, sizes, [bufs, halves]) == [True, True]
        assert b"".join(bufs) == pages[0] and b"".join(halves) == pages[1]
        if harness.kind != "memory" or not auth:
            obj = harness.read_raw(ks[0])
            harness.write_raw(ks[0], _flip(obj, len(obj) - 5))
            assert b.get_into(ks[:1], sizes, [bufs]) == [False]
            assert b.stats().corrupt == 1
    finally:
        if auth:
            b.close()


def test_header_of_segments_is_the_writers_header():
    fp, key, sizes = "e" * 32, bytes(range(16)), [40, 88]
    payload = payload_of(128, "h")
    t = codec.header_template(fp, sizes)
    segs = [memoryview(bytearray(payload[:7])), memoryview(bytearray(payload[7:100])),
            memoryview(bytearray(payload[100:]))]
    for auth in (b"", codec.mac_key(KEY.encode())):
        assert header_of(fp, key, t, segs, auth) == codec.encode_header(fp, key, sizes, payload, auth)


def test_plain_headers_are_the_writers_headers():
    """The read path's header built from per-batch constants is byte for byte the writer's,
    and steps aside (None) where a checksum or ``hck`` encodes shorter than 8 bytes."""
    import random
    rng = random.Random(7)
    t = codec.header_template("f" * 32, [4096, 4096, 131072])
    plain = codec.PlainHeaders(t)
    built = 0
    for ck in [rng.getrandbits(64) for _ in range(2000)] + [(1 << 32) - 1, 1 << 32, (1 << 64) - 1, 5]:
        key = rng.randbytes(16)
        got = plain(key, ck)
        if got is None:
            assert ck < 1 << 32 or codec.header_of_digests(t, key, ck, None)[-9] != 0xCF
            continue
        assert got == codec.header_of_digests(t, key, ck, None)
        built += 1
    assert built >= 1990
