"""The L3 object format and the memory://, file:// and redis:// backends with real
pages: every published model shape (``hicache.core.shapes``) at its real page bytes
of all layers (0.4-4 MiB at page 16), byte-exact, with the header, the MAC and
the corrupt / foreign verdicts checked at that size."""
from __future__ import annotations

import random
import struct

import msgpack
import pytest
import torch

from hicache.core.errors import IntegrityError
from hicache.core.hashing import page_hashes
from hicache.memory.pools import HostPool
from hicache.core.shapes import model_shapes
from hicache.storage import codec
from hicache.storage.codec import FORMAT_VERSION, MAGIC, ReadStatus

SHAPES = {m.name: m for m in model_shapes()}
# Page 1 (SGLang's default), 16 (vLLM's block), 64 for MLA (FlashMLA).
CODEC_CASES = ([(n, 16) for n in SHAPES] + [(n, 1) for n in SHAPES]
               + [(n, 64) for n, m in SHAPES.items() if m.is_mla])
AUTH = codec.mac_key(b"real-shapes-test-key-0123456789")


# Many small tensor ops: one torch thread (tests/conftest.py says why).
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def payload_of(nbytes: int, seed: str) -> bytes:
    return random.Random(seed).randbytes(nbytes)


def setup(name: str, page_size: int):
    lay = SHAPES[name].kv_layout(page_size)
    sizes = [p.page_bytes for p in lay.planes]
    key = page_hashes(list(range(page_size)), page_size, namespace=name)[0]
    return lay, sizes, key, payload_of(lay.page_bytes, f"{name}/{page_size}")


@pytest.mark.parametrize("name,page_size", CODEC_CASES)
def test_codec_round_trip_and_header(name, page_size):
    lay, sizes, key, payload = setup(name, page_size)
    fp = lay.fingerprint()
    obj = bytearray(codec.encode(fp, key, sizes, payload))
    magic, hlen = struct.unpack_from("<4sI", obj)
    assert magic == MAGIC and len(obj) == 8 + hlen + lay.page_bytes
    fields = {"version": FORMAT_VERSION, "fingerprint": fp, "hash": key, "plane_sizes": sizes,
              "length": lay.page_bytes, "checksum": codec.checksum(payload)}
    fields["hck"] = codec.checksum(msgpack.packb(fields))
    # The header is exactly the msgpack map of its fields: ~140 bytes plus 1-5 per plane.
    assert bytes(obj[8:8 + hlen]) == msgpack.packb(fields)
    assert hlen <= 160 + 5 * len(sizes)
    for template in (None, codec.header_template(fp, sizes)):
        d = codec.decode(obj, key, fp, sizes, template=template)
        assert d.status is ReadStatus.OK and d.payload.nbytes == lay.page_bytes
        assert bytes(d.payload) == payload
    d = codec.decode(obj, key, fp, sizes)
    obj[-1] ^= 0xFF  # a zero-copy view of the object
    assert d.payload[-1] == payload[-1] ^ 0xFF


@pytest.mark.parametrize("name,page_size", CODEC_CASES)
def test_codec_mac_on_and_off(name, page_size):
    lay, sizes, key, payload = setup(name, page_size)
    fp = lay.fingerprint()
    plain = codec.encode(fp, key, sizes, payload)
    signed = bytearray(codec.encode(fp, key, sizes, payload, AUTH))
    hdr = msgpack.unpackb(signed[8:8 + struct.unpack_from("<I", signed, 4)[0]])
    assert len(hdr["mac"]) == codec.MAC_BYTES
    assert len(signed) == len(plain) + 2 + 4 + codec.MAC_BYTES  # "mac" key (1+3) + bin8 (2) + 32 bytes
    assert bytes(codec.decode(signed, key, fp, sizes, AUTH).payload) == payload
    assert bytes(codec.decode(signed, key, fp, sizes).payload) == payload  # a reader without the key
    no_mac = codec.decode(plain, key, fp, sizes, AUTH)
    assert no_mac.status is ReadStatus.CORRUPT and "no MAC" in no_mac.why
    other = codec.decode(signed, key, fp, sizes, codec.mac_key(b"another key"))
    assert other.status is ReadStatus.CORRUPT and "MAC does not verify" in other.why
    # A forger who rewrites the payload and its checksum (and hck) but lacks the key.
    forged = bytes(codec.encode(fp, key, sizes, payload[:-1] + bytes([payload[-1] ^ 1]), codec.mac_key(b"x")))
    assert codec.decode(forged, key, fp, sizes, AUTH).status is ReadStatus.CORRUPT


def flip_positions(hlen: int, sizes: list[int]) -> list[int]:
    """Every header byte, and the first and last byte of every plane of the payload."""
    out = list(range(8 + hlen))
    at = 8 + hlen
    for s in sizes:
        out += [at, at + s - 1]
        at += s
    return out


@pytest.mark.parametrize("name,page_size", [(n, 16) for n in SHAPES] + [("deepseek-v3", 64)])
def test_codec_rejects_corrupt_objects(name, page_size):
    lay, sizes, key, payload = setup(name, page_size)
    fp = lay.fingerprint()
    t = codec.header_template(fp, sizes)
    for auth in (b"", AUTH):
        obj = bytearray(codec.encode(fp, key, sizes, payload, auth))
        hlen = struct.unpack_from("<I", obj, 4)[0]
        for i in flip_positions(hlen, sizes):
            obj[i] ^= 0x01
            d = codec.decode(obj, key, fp, sizes, auth, t)
            obj[i] ^= 0x01
            assert d.status is not ReadStatus.OK and d.payload is None, (i, d)
        for n in (0, 7, 8, 8 + hlen - 1, 8 + hlen, len(obj) - sizes[-1], len(obj) - 1):
            d = codec.decode(bytes(obj[:n]), key, fp, sizes, auth, t)
            assert d.status is ReadStatus.CORRUPT, (n, d)
        assert codec.decode(bytes(obj) + b"\0", key, fp, sizes, auth, t).status is ReadStatus.CORRUPT
        assert codec.decode(obj, key, fp, sizes, auth, t).status is ReadStatus.OK


@pytest.mark.parametrize("name", list(SHAPES))
def test_codec_foreign_objects_are_named(name):
    """An object of every other model (same page size) read as this model's: another
    fingerprint is FINGERPRINT; the right fingerprint with another model's planes is CORRUPT."""
    lay, sizes, key, _ = setup(name, 16)
    for other in SHAPES:
        if other == name:
            continue
        olay, osizes, _, opayload = setup(other, 16)
        obj = codec.encode(olay.fingerprint(), key, osizes, opayload)
        d = codec.decode(obj, key, lay.fingerprint(), sizes)
        assert d.status is ReadStatus.FINGERPRINT and olay.fingerprint() in d.why, other
        mixed = codec.encode(lay.fingerprint(), key, osizes, opayload)
        d = codec.decode(mixed, key, lay.fingerprint(), sizes)
        assert d.status is ReadStatus.CORRUPT and "plane sizes" in d.why, other


# ------------------------------------------------------------------------- backends

def filled_pool(layout, pages: int, seed: str) -> HostPool:
    pool = HostPool(layout, pages, pin=False)
    pool.buffer.copy_(torch.frombuffer(bytearray(payload_of(pool.buffer.numel(), seed)), dtype=torch.uint8))
    return pool


@pytest.mark.parametrize("harness", ["memory", "file", "redis"], indirect=True)
@pytest.mark.parametrize("name", list(SHAPES))
def test_backend_round_trips_real_pages(harness, name):
    """Two full-layer pages (page 16) out of a ``page_first`` pool land byte-exact in a
    ``layer_first`` pool through L3; a flipped byte and another model's object are counted
    misses, the flipped one deleted."""
    m = SHAPES[name]
    src = filled_pool(m.kv_layout(16, host_layout="page_first"), 2, f"src/{name}")
    dst = HostPool(m.kv_layout(16, host_layout="layer_first"), 3, pin=False)
    lay = src.layout
    b = harness.backend  # the harness's fingerprint: raw access reaches this backend's objects
    sizes = [p.page_bytes for p in lay.planes]
    ks = page_hashes(list(range(4 * 16)), 16, namespace=f"real/{name}")
    pages = [src.read_page(p) for p in range(2)]
    assert b.put([(k, memoryview(pl), sizes) for k, pl in zip(ks[:2], pages)]) == 2
    got = b.get([ks[1], ks[0]], sizes)
    for page, payload in zip((0, 2), got):
        assert payload is not None and payload.nbytes == lay.page_bytes
        dst.write_page(page, payload)
    assert dst.read_page(0) == pages[1] and dst.read_page(2) == pages[0]
    want, have = src.page_view(0), dst.page_view(2)
    for key in want:  # typed views agree too (bf16 / fp16 rows of the real shape)
        assert torch.equal(want[key].view(torch.uint8), have[key].view(torch.uint8)), key

    stored = bytearray(harness.read_raw(ks[0]))
    stored[len(stored) // 2] ^= 0x40  # inside the payload
    harness.write_raw(ks[0], bytes(stored))
    other = next(o for o in SHAPES if o != name)
    olay = SHAPES[other].kv_layout(16)
    harness.write_raw(ks[2], codec.encode(olay.fingerprint(), ks[2], [p.page_bytes for p in olay.planes],
                                          payload_of(olay.page_bytes, other)))
    got = b.get(ks[:3], sizes)
    assert got[0] is None and bytes(got[1]) == pages[1] and got[2] is None
    assert bytes(b.get([ks[1]], sizes)[0]) == pages[1]
    assert harness.read_raw(ks[0]) is None  # the corrupt object was deleted
    s = b.stats()
    assert (s.gets, s.hits, s.misses, s.corrupt, s.fingerprint_mismatch) == (6, 4, 2, 1, 1)
    assert s.bytes_written == 2 * lay.page_bytes and s.bytes_read == 4 * lay.page_bytes
    if harness.kind in ("memory", "file"):  # these scan what they hold: the foreign object is named
        with pytest.raises(IntegrityError, match="1 stored object.*fingerprint_mismatch"):
            b.check_integrity()
    assert b.delete([ks[2]]) == 1
    b.check_integrity()
    src.check_integrity()
    dst.check_integrity()
