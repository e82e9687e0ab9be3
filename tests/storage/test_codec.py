"""The L3 object format: exact framing, and every corruption is rejected."""
from __future__ import annotations

import struct

import msgpack
import pytest

from hicache.storage import codec
from hicache.storage.codec import FORMAT_VERSION, MAGIC, ReadStatus

FP = "a" * 32
KEY = bytes(range(16))
SIZES = [24, 8, 32]
PAYLOAD = bytes((i * 7 + 3) % 256 for i in range(64))


def obj() -> bytes:
    return codec.encode(FP, KEY, SIZES, PAYLOAD)


def test_layout_is_magic_length_header_payload():
    o = obj()
    magic, hlen = struct.unpack_from("<4sI", o)
    assert magic == MAGIC == b"HCL3"
    hdr = msgpack.unpackb(o[8:8 + hlen])
    assert hdr == {"version": FORMAT_VERSION, "fingerprint": FP, "hash": KEY, "plane_sizes": SIZES,
                   "length": 64, "checksum": codec.checksum(PAYLOAD), "hck": hdr["hck"]}
    assert o[8 + hlen:] == PAYLOAD
    assert len(o) == 8 + hlen + 64


def test_decode_returns_zero_copy_view():
    o = bytearray(obj())
    d = codec.decode(o, KEY, FP, SIZES)
    assert d.status is ReadStatus.OK and d.why == "" and bytes(d.payload) == PAYLOAD
    o[-1] ^= 0xFF  # the view shares the object's memory
    assert d.payload[-1] == PAYLOAD[-1] ^ 0xFF


def test_header_does_not_copy_and_checks_length():
    hdr = codec.encode_header(FP, KEY, SIZES, memoryview(PAYLOAD))
    assert hdr + PAYLOAD == obj()
    with pytest.raises(ValueError, match="65 bytes does not match plane sizes summing to 64"):
        codec.encode_header(FP, KEY, SIZES, PAYLOAD + b"x")


@pytest.mark.parametrize("xor", [0x01, 0x80, 0xFF])
def test_every_flipped_byte_is_rejected(xor):
    o = obj()
    for i in range(len(o)):
        bad = bytearray(o)
        bad[i] ^= xor
        d = codec.decode(bytes(bad), KEY, FP, SIZES)
        assert d.status is not ReadStatus.OK and d.payload is None, (i, d)


def test_every_truncation_is_rejected():
    o = obj()
    for n in range(len(o)):
        d = codec.decode(o[:n], KEY, FP, SIZES)
        assert d.status is ReadStatus.CORRUPT and d.payload is None, (n, d)
    assert codec.decode(o + b"\0", KEY, FP, SIZES).status is ReadStatus.CORRUPT


@pytest.mark.parametrize("case, status, why", [
    ("fingerprint", ReadStatus.FINGERPRINT, "fingerprint 'bbbb"),
    ("key", ReadStatus.CORRUPT, "page hash"),
    ("sizes", ReadStatus.CORRUPT, "plane sizes [24, 8, 32] != expected [32, 32]"),
    ("version", ReadStatus.CORRUPT, f"format version {FORMAT_VERSION + 1} != {FORMAT_VERSION}"),
    ("checksum", ReadStatus.CORRUPT, "checksum"),
    ("magic", ReadStatus.CORRUPT, "magic"),
])
def test_each_mismatch_names_its_field(case, status, why):
    o, key, sizes = obj(), KEY, SIZES
    if case == "fingerprint":
        o = codec.encode("b" * 32, KEY, SIZES, PAYLOAD)
    elif case == "key":
        key = bytes(16)
    elif case == "sizes":
        sizes = [32, 32]
    elif case in ("version", "checksum"):
        hdr = msgpack.unpackb(o[8:8 + struct.unpack_from("<I", o, 4)[0]])
        hdr["version" if case == "version" else "checksum"] += 1
        h = msgpack.packb(hdr)
        o = struct.pack("<4sI", MAGIC, len(h)) + h + PAYLOAD
    else:
        o = b"XXXX" + o[4:]
    d = codec.decode(o, key, FP, sizes)
    assert d.status is status and d.payload is None
    assert why in d.why


def test_header_that_is_not_a_map_is_corrupt():
    h = msgpack.packb([1, 2, 3])
    d = codec.decode(struct.pack("<4sI", MAGIC, len(h)) + h, KEY, FP, None)
    assert d.status is ReadStatus.CORRUPT and "not a map" in d.why


def test_plane_sizes_none_checks_only_consistency():
    assert codec.decode(obj(), KEY, FP, None).status is ReadStatus.OK


def test_plane_sizes_are_validated_once():
    ps = codec.plane_sizes([24, 8, 32])
    assert ps == codec.PlaneSizes([24, 8, 32], 64) and codec.plane_sizes(ps) is ps
    assert codec.decode(obj(), KEY, FP, ps).status is ReadStatus.OK
    with pytest.raises(ValueError, match="must be >= 0"):
        codec.plane_sizes([4, -4])
