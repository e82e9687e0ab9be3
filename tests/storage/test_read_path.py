"""The L3 -> L2 read path (``get_into_settled`` into ``HostPool.page_buffers``, the path of
``TransferController.storage_get``, at 512 KiB and 2 MiB; ``get_into``, the engines' tiers'
path, at 128 KiB) on file:// and redis://, with and without ``storage.auth_key``: one bad
object inside a batch fails only its own page (the others land byte for byte), whatever is
wrong with it."""
from __future__ import annotations

import dataclasses
import struct

import pytest

from hicache.core.hashing import page_hashes
from hicache.core.layout import KVLayout
from hicache.memory.pools import HostPool
from hicache.storage import codec
from hicache.storage.into import MAX_SPLIT_HEADER

KEY = "read-path-test-key-0123456789abcdef"
OTHER_KEY = "another-key-of-the-store-0123456789"
N = 6  # pages per batch; the bad one is BAD
BAD = 3


def layout(page_bytes: int, host_layout: str = "page_first") -> KVLayout:
    heads = page_bytes // (2 * 4 * 16 * 64 * 2)  # 4 layers: 8 planes
    return KVLayout(model_id="read-path", num_layers=4, kind="mha", num_kv_heads=heads, head_dim=64,
                    dtype="bfloat16", page_size=16, host_layout=host_layout)


class Batch:
    """N pages of one layout stored in ``backend``; reads land in a host pool."""

    def __init__(self, backend, page_bytes: int, host_layout: str = "page_first"):
        self.b, self.lay = backend, layout(page_bytes, host_layout)
        assert self.lay.page_bytes == page_bytes
        self.sizes = [p.page_bytes for p in self.lay.planes]
        self.keys = page_hashes(list(range(N * 16)), 16, namespace=f"read-path/{page_bytes}/{host_layout}")
        self.pages = [bytes([(i * 37 + j) % 251 for j in range(251)]) * (page_bytes // 251) for i in range(N)]
        self.pages = [p + bytes(page_bytes - len(p)) for p in self.pages]
        assert self.b.put([(k, p, self.sizes) for k, p in zip(self.keys, self.pages)]) == N
        self.pool = HostPool(self.lay, N, pin=False)

    def read(self, method: str = "get_into") -> list[bool]:
        for p in range(N):  # a known pattern: what a refused page must not leave as data
            for mv in self.pool.page_buffers(p):
                mv[:] = b"\xa5" * mv.nbytes
        return getattr(self.b, method)(self.keys, self.sizes, [self.pool.page_buffers(p) for p in range(N)])

    def landed(self, p: int) -> bytes:
        return b"".join(self.pool.page_buffers(p))

    def check_others(self, got: list[bool]) -> None:
        assert got == [i != BAD for i in range(N)], got
        for i in range(N):
            if i != BAD:
                assert self.landed(i) == self.pages[i], i


def _bad_object(kind: str, h, batch: Batch) -> bytes | None:
    """The object stored at the bad page's key for one kind of damage (None: no object)."""
    good = h.read_raw(batch.keys[BAD])
    hlen = struct.unpack_from("<4sI", good)[1] + 8
    if kind == "payload bit":
        out = bytearray(good)
        out[hlen + len(batch.pages[BAD]) // 2] ^= 0x10
        return bytes(out)
    if kind == "truncated":  # a short read: the file or value ends inside the payload
        return good[:len(good) - 4096]
    if kind == "header only":
        return good[:hlen]
    if kind == "oversized":  # never sized from: read at most a page and MAX_SPLIT_HEADER
        return good + bytes(MAX_SPLIT_HEADER + 4096)
    if kind == "other layout":
        other = dataclasses.replace(batch.lay, model_id="another-model")
        return codec.encode(other.fingerprint(), batch.keys[BAD], batch.sizes, batch.pages[BAD])
    if kind == "another page's object":
        return codec.encode(h.backend.fingerprint, batch.keys[0], batch.sizes, batch.pages[BAD])
    raise AssertionError(kind)


KINDS = ["payload bit", "truncated", "header only", "oversized", "other layout", "another page's object", "missing"]


@pytest.mark.parametrize("auth", [False, True])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("page_bytes,method", [(128 << 10, "get_into"), (512 << 10, "get_into_settled"),
                                               (2 << 20, "get_into_settled")])
@pytest.mark.parametrize("harness", ["file", "redis"], indirect=True)
def test_one_bad_object_fails_only_its_page(harness, page_bytes, method, kind, auth):
    b = harness.reopen(auth_key=KEY) if auth else harness.backend
    try:
        batch = Batch(b, page_bytes)
        if kind == "missing":
            b.delete([batch.keys[BAD]])
        else:
            harness.write_raw(batch.keys[BAD], _bad_object(kind, harness, batch))
        before = b.stats()
        got = batch.read(method)
        batch.check_others(got)
        s = b.stats()
        d = {f: getattr(s, f) - getattr(before, f) for f in ("hits", "misses", "corrupt", "fingerprint_mismatch")}
        want_corrupt = int(kind not in ("missing", "other layout"))
        assert d == dict(hits=N - 1, misses=1, corrupt=want_corrupt,
                         fingerprint_mismatch=int(kind == "other layout")), d
        # A corrupt object is deleted; another layout's is left to it; the next read agrees.
        assert (harness.read_raw(batch.keys[BAD]) is None) == (kind != "other layout")
        assert batch.read(method)[BAD] is False
        if kind != "other layout":  # (check_integrity reports another layout's object)
            b.check_integrity()
    finally:
        if auth:
            b.close()


def _forged(obj: bytes, payload_at: int) -> bytes:
    """``obj`` with a payload byte changed and its checksums (payload and header) made to
    match the new payload, its MAC left: what someone who can write the store but lacks the
    key can make."""
    payload = bytearray(obj[payload_at:])
    payload[len(payload) // 3] ^= 0x01
    hdr = codec._parse_header(memoryview(obj))
    hdr["checksum"] = codec.checksum(payload)
    hdr.pop("hck")
    hdr["hck"] = codec.checksum(codec.msgpack.packb(hdr))
    packed = codec.msgpack.packb(hdr)
    return struct.pack("<4sI", codec.MAGIC, len(packed)) + packed + bytes(payload)


@pytest.mark.parametrize("page_bytes", [128 << 10, 2 << 20])
@pytest.mark.parametrize("harness", ["file", "redis"], indirect=True)
def test_keyed_reads_refuse_what_the_key_did_not_write(harness, page_bytes):
    """With a key: an object MAC'd with another key, one without a MAC, and a forgery whose
    checksums match its payload are corrupt; only that page fails. Without a key, a MAC'd
    object (a longer header than the reader expects) is read and delivered."""
    keyed = harness.reopen(auth_key=KEY)
    other = harness.reopen(auth_key=OTHER_KEY)
    try:
        batch = Batch(keyed, page_bytes)
        good = harness.read_raw(batch.keys[BAD])
        at = struct.unpack_from("<4sI", good)[1] + 8
        bad = {"another key": None, "no MAC": codec.encode(keyed.fingerprint, batch.keys[BAD], batch.sizes,
                                                            batch.pages[BAD]),
               "forged": _forged(good, at)}
        for name, obj in bad.items():
            if obj is None:
                assert other.put([(batch.keys[BAD], batch.pages[BAD], batch.sizes)]) == 1
            else:
                harness.write_raw(batch.keys[BAD], obj)
            before = keyed.stats().corrupt
            batch.check_others(batch.read())
            assert keyed.stats().corrupt == before + 1, name
        keyed.put([(batch.keys[BAD], batch.pages[BAD], batch.sizes)])
        plain = Batch.__new__(Batch)
        plain.__dict__.update(batch.__dict__, b=harness.backend)
        assert plain.read() == [True] * N
        assert [plain.landed(i) for i in range(N)] == batch.pages
    finally:
        keyed.close()
        other.close()


@pytest.mark.parametrize("host_layout", ["page_first", "layer_first"])
@pytest.mark.parametrize("harness", ["file", "redis"], indirect=True)
def test_storage_get_lands_the_leading_pages_in_l2(harness, host_layout):
    """``TransferController.storage_get`` (the connector's and ``HiCache``'s prefetch):
    pages land in L2 through their segments (one region, or one per plane), the result
    counts the leading pages, a damaged page stops it there."""
    from hicache.memory.pools import DevicePool
    from hicache.transfer.engine import TransferController

    batch = Batch(harness.backend, 128 << 10, host_layout)
    tc = TransferController(DevicePool(batch.lay, 2), batch.pool, harness.backend, inline=True)
    try:
        tc.wait(tc.storage_get(batch.keys, list(range(N))).job)
        assert [r.pages for r in tc.finished()] == [N]
        assert [batch.landed(i) for i in range(N)] == batch.pages
        harness.write_raw(batch.keys[BAD], _bad_object("payload bit", harness, batch))
        batch.pool.buffer.zero_()
        tc.wait(tc.storage_get(batch.keys, list(range(N))).job)
        assert [r.pages for r in tc.finished()] == [BAD]
        assert [batch.landed(i) for i in range(BAD)] == batch.pages[:BAD]
    finally:
        tc.close()
