"""Format version 2 (keyed BLAKE3 MAC): version 1 objects are re-verified without a key
and refused with one, never misread; objects of an unknown version are corrupt."""
from __future__ import annotations

import hashlib
import struct

import blake3
import msgpack
import pytest

from hicache.storage import codec, open_storage
from hicache.storage.codec import ReadStatus

FP = "0f1e2d3c4b5a69788796a5b4c3d2e1f0"
SIZES = [40, 24]
PAYLOAD = bytes((i * 13 + 5) % 256 for i in range(64))
SECRET = b"a-shared-secret-of-32-characters"


def key(i: int) -> bytes:
    return i.to_bytes(16, "big")


def v1_object(page: bytes, payload: bytes, secret: bytes = b"", version: int = 1) -> bytes:
    """What the version 1 writer stored: MAC = keyed BLAKE2b-256 over the fields' map, then the payload."""
    fields = {"version": version, "fingerprint": FP, "hash": page, "plane_sizes": SIZES,
              "length": len(payload), "checksum": codec.checksum(payload)}
    if secret:
        h = hashlib.blake2b(msgpack.packb(fields), key=secret, digest_size=32, person=b"hicache-l3-v1")
        h.update(payload)
        fields["mac"] = h.digest()
    fields["hck"] = codec.checksum(msgpack.packb(fields))
    hdr = msgpack.packb(fields)
    return struct.pack("<4sI", b"HCL3", len(hdr)) + hdr + payload


def test_v2_mac_is_keyed_blake3_over_payload_then_fields():
    k = codec.mac_key(SECRET)
    assert k == blake3.blake3(SECRET, derive_key_context="hicache L3 object MAC, format version 2").digest()
    hdr = msgpack.unpackb(codec.encode(FP, key(1), SIZES, PAYLOAD, k)[8:][:-64])
    fields = {f: hdr[f] for f in ("version", "fingerprint", "hash", "plane_sizes", "length", "checksum")}
    assert hdr["version"] == codec.FORMAT_VERSION == 2
    assert hdr["mac"] == blake3.blake3(PAYLOAD + msgpack.packb(fields), key=k).digest()


@pytest.mark.parametrize("big", [False, True])
def test_segments_and_blocks_hash_like_one_buffer(big):
    """The block-by-block pass over scattered segments gives the one-buffer header, keyed or not."""
    n = 3 * codec.HASH_BLOCK + 17 if big else 64
    payload = bytes((i * 31 + 7) % 251 for i in range(n))
    sizes = [n // 3, n - n // 3]
    t = codec.header_template(FP, sizes)
    segs = [memoryview(payload)[:n // 3], memoryview(payload)[n // 3:]]
    for k in (b"", codec.mac_key(SECRET)):
        assert codec.header_of_segments(t, key(2), segs, k) == codec.encode_header(FP, key(2), sizes, payload, k)
        assert codec.encode_header(FP, key(2), sizes, payload, k) == \
            codec._encode_header_dict(FP, key(2), sizes, payload, k)


def test_v1_objects_are_reverified_without_a_key():
    o = v1_object(key(3), PAYLOAD, SECRET)  # a MAC'd v1 object: a keyless reader ignores the MAC
    for obj in (o, v1_object(key(3), PAYLOAD)):
        d = codec.decode(obj, key(3), FP, SIZES, template=codec.header_template(FP, SIZES))
        assert d.status is ReadStatus.OK and bytes(d.payload) == PAYLOAD
        for i in range(len(obj)):  # ... by their checksums: every flipped byte is still caught
            bad = bytearray(obj)
            bad[i] ^= 0x40
            assert codec.decode(bytes(bad), key(3), FP, SIZES).status is not ReadStatus.OK, i


def test_v1_objects_are_refused_with_a_key_even_with_their_old_valid_mac():
    d = codec.decode(v1_object(key(4), PAYLOAD, SECRET), key(4), FP, SIZES, codec.mac_key(SECRET))
    assert d.status is ReadStatus.CORRUPT and "format version 1" in d.why and "BLAKE2b" in d.why


@pytest.mark.parametrize("version", [0, 3, "2", None])
def test_unknown_versions_are_corrupt(version):
    d = codec.decode(v1_object(key(5), PAYLOAD, version=version), key(5), FP, SIZES)
    assert d.status is ReadStatus.CORRUPT and "format version" in d.why


@pytest.mark.parametrize("read", ["get", "get_into"])
def test_a_store_of_v1_objects_migrates(tmp_path, read):
    """Through a file:// backend: keyless, a v1 object is a verified hit; keyed, a counted
    corrupt miss that is deleted, and the next put stores a v2 object that reads back."""
    url = f"file://{tmp_path}/l3"
    plain, keyed = open_storage(url, fingerprint=FP), open_storage(url, fingerprint=FP, auth_key=SECRET)
    try:
        for b, want in ((plain, PAYLOAD), (keyed, None)):
            path = b.path_of(key(6))
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(v1_object(key(6), PAYLOAD, SECRET))
            if read == "get":
                got = b.get([key(6)], SIZES)[0]
                got = None if got is None else bytes(got)
            else:
                dest = bytearray(64)
                got = bytes(dest) if b.get_into([key(6)], SIZES, [dest])[0] else None
            assert got == want
        assert keyed.stats().corrupt == 1 and not keyed.path_of(key(6)).exists()
        assert keyed.put([(key(6), PAYLOAD, SIZES)]) == 1
        assert bytes(keyed.get([key(6)], SIZES)[0]) == PAYLOAD
        assert msgpack.unpackb(keyed.path_of(key(6)).read_bytes()[8:-64])["version"] == 2
        keyed.check_integrity()
    finally:
        plain.close()
        keyed.close()
