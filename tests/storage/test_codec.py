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


# --- header templates: the same bytes as packing the fields' dict, and decode's byte-compare path

@pytest.mark.parametrize("auth", [b"", codec.mac_key(b"k" * 16)])
@pytest.mark.parametrize("sizes", [[], [0], [64], SIZES, [4] * 16, list(range(200)), [70000, 3]])
def test_template_header_is_the_dict_header(sizes, auth):
    fps = [FP, "f" * 8, "é" * 40, "x" * 300]
    for i, fp in enumerate(fps):
        t = codec.header_template(fp, sizes)
        payload = memoryview(bytes((j * 13 + i) % 256 for j in range(sum(sizes))))
        key = bytes(range(i, i + 16))
        ref = codec._encode_header_dict(fp, key, sizes, payload, auth)
        assert codec.encode_header(fp, key, sizes, payload, auth) == ref
        assert codec.encode_header(fp, key, sizes, payload, auth, t) == ref


def test_uint_is_msgpacks_smallest_encoding():
    for v in [0, 1, 127, 128, 255, 256, 65535, 65536, (1 << 32) - 1, 1 << 32, (1 << 64) - 1]:
        assert codec._uint(v) == msgpack.packb(v), v


def _same(a: codec.Decoded, b: codec.Decoded) -> bool:
    return a.status is b.status and (a.payload is None) == (b.payload is None) and (
        a.payload is None or bytes(a.payload) == bytes(b.payload))


@pytest.mark.parametrize("xor", [0x01, 0x80])
def test_template_decode_agrees_with_the_field_by_field_decode(xor):
    t = codec.header_template(FP, SIZES)
    o = obj()
    d = codec.decode(o, KEY, FP, SIZES, template=t)
    assert d.status is ReadStatus.OK and bytes(d.payload) == PAYLOAD and d.why == ""
    for i in range(len(o)):  # every flipped byte: the same verdict (never OK) and the same reason
        bad = bytearray(o)
        bad[i] ^= xor
        fast, slow = codec.decode(bytes(bad), KEY, FP, SIZES, template=t), codec.decode(bytes(bad), KEY, FP, SIZES)
        assert fast == slow and fast.status is not ReadStatus.OK, (i, fast)
    for n in range(len(o)):  # every truncation, and one byte too many
        assert codec.decode(o[:n], KEY, FP, SIZES, template=t) == codec.decode(o[:n], KEY, FP, SIZES)
    assert codec.decode(o + b"x", KEY, FP, SIZES, template=t).status is ReadStatus.CORRUPT


def test_template_decode_falls_back_for_what_it_does_not_write():
    t = codec.header_template(FP, SIZES)
    cases = {
        "other key": (obj(), bytes(16), FP, SIZES, b""),
        "other layout": (codec.encode("b" * 32, KEY, SIZES, PAYLOAD), KEY, FP, SIZES, b""),
        "other sizes": (codec.encode(FP, KEY, [32, 32], PAYLOAD), KEY, FP, SIZES, b""),
        "with a MAC, read with the key": (codec.encode(FP, KEY, SIZES, PAYLOAD, b"m" * 32), KEY, FP, SIZES,
                                          b"m" * 32),
        "with a MAC, read without": (codec.encode(FP, KEY, SIZES, PAYLOAD, b"m" * 32), KEY, FP, SIZES, b""),
        "no MAC, read with a key": (obj(), KEY, FP, SIZES, b"m" * 32),
    }
    for name, (o, key, fp, sizes, auth) in cases.items():
        fast = codec.decode(o, key, fp, sizes, auth, t if fp == FP and sizes == SIZES else None)
        assert _same(fast, codec.decode(o, key, fp, sizes, auth)), name
    # An object without hck (written before it existed) still verifies, field by field.
    fields = {"version": FORMAT_VERSION, "fingerprint": FP, "hash": KEY, "plane_sizes": SIZES,
              "length": 64, "checksum": codec.checksum(PAYLOAD)}
    hdr = msgpack.packb(fields)
    old = struct.pack("<4sI", MAGIC, len(hdr)) + hdr + PAYLOAD
    assert codec.decode(old, KEY, FP, SIZES, template=t).status is ReadStatus.OK
    # A valid header in a longer encoding ("length" as a uint32) is not byte-equal: the
    # field-by-field path decides (OK, as before templates).
    o = obj()
    hlen = struct.unpack_from("<I", o, 4)[0]
    short = msgpack.packb("length") + msgpack.packb(64)
    assert o[8:8 + hlen].count(short) == 1
    hdr = o[8:8 + hlen].replace(short, msgpack.packb("length") + b"\xce" + (64).to_bytes(4, "big"))
    long_ = struct.pack("<4sI", MAGIC, len(hdr)) + hdr + PAYLOAD
    assert codec._decode_exact(memoryview(long_), KEY, t) is None
    d = codec.decode(long_, KEY, FP, SIZES, template=t)
    assert d.status is ReadStatus.OK and bytes(d.payload) == PAYLOAD


@pytest.mark.parametrize("row_bytes", [589824, 2097152 + 3])
def test_rows_layout_pages_encode_and_verify(row_bytes):
    """A kind="rows" page (one opaque engine row, here opt-125m's vLLM block and an odd size)
    is one plane: it round-trips zero-copy, and damage or another row description is refused."""
    from hicache.core.layout import KVLayout
    lay = KVLayout.rows("vllm:m", row_bytes, {"engine": "vllm", "block": 16})
    sizes = [p.page_bytes for p in lay.planes]
    assert sizes == [row_bytes]
    payload = bytes(range(256)) * (row_bytes // 256) + bytes(row_bytes % 256)
    o = codec.encode(lay.fingerprint(), KEY, sizes, payload)
    t = codec.header_template(lay.fingerprint(), sizes)
    for template in (None, t):
        d = codec.decode(o, KEY, lay.fingerprint(), sizes, template=template)
        assert d.status is ReadStatus.OK and d.payload.nbytes == row_bytes and d.payload == payload
    for i in (0, 20, len(o) - row_bytes, len(o) - 1):  # prefix, header, first and last payload byte
        bad = bytearray(o)
        bad[i] ^= 0x5A
        assert codec.decode(bytes(bad), KEY, lay.fingerprint(), sizes, template=t).status is not ReadStatus.OK
    other = KVLayout.rows("vllm:m", row_bytes, {"engine": "vllm", "block": 32})
    d = codec.decode(o, KEY, other.fingerprint(), sizes)
    assert d.status is ReadStatus.FINGERPRINT and lay.fingerprint() in d.why
    key = codec.mac_key(b"k" * 32)
    signed = codec.encode(lay.fingerprint(), KEY, sizes, payload, auth_key=key)
    assert codec.decode(signed, KEY, lay.fingerprint(), sizes, auth_key=key).status is ReadStatus.OK
    assert codec.decode(o, KEY, lay.fingerprint(), sizes, auth_key=key).status is ReadStatus.CORRUPT
