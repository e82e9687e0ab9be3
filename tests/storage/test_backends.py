"""Every backend: exact round trips for every layout, batch API semantics,
counters, and corruption detection against objects changed behind its back."""
from __future__ import annotations

import os

import pytest
import torch

from hicache.core.errors import IntegrityError
from hicache.core.hashing import page_hashes
from hicache.core.layout import BytePlane, KVLayout
from hicache.memory.pools import HostPool
from hicache.storage import codec


LAYOUTS = {
    "mha": dict(model_id="m", num_layers=2, kind="mha", num_kv_heads=2, head_dim=4, dtype="bfloat16",
                page_size=4),
    "mla": dict(model_id="m", num_layers=2, kind="mla", kv_lora_rank=8, rope_dim=4, dtype="float16",
                page_size=4),
    "byte_planes": dict(model_id="m", num_layers=2, kind="mha", num_kv_heads=1, head_dim=8,
                        dtype="float8_e4m3fn", page_size=4, extra_planes=(BytePlane("idx", 5),)),
    "draft": dict(model_id="m", num_layers=2, kind="mha", num_kv_heads=2, head_dim=4, dtype="float32",
                  page_size=4, draft_layers=1),
    # An engine's opaque rows (vLLM's tier): one uint8 plane of an odd, non-aligned size.
    "rows": dict(model_id="m", num_layers=1, kind="rows", row_bytes=4099, engine_layout='{"engine":"test"}',
                 dtype="uint8", page_size=1),
}


def keys(n: int, ns: str = "") -> list[bytes]:
    return page_hashes(list(range(4 * n)), 4, namespace=ns)


def filled_pool(layout: KVLayout, pages: int, seed: int) -> HostPool:
    pool = HostPool(layout, pages, pin=False)
    g = torch.Generator().manual_seed(seed)
    pool.buffer.copy_(torch.randint(0, 256, (pool.buffer.numel(),), dtype=torch.uint8, generator=g))
    return pool


@pytest.mark.parametrize("host_layout", ["layer_first", "page_first"])
@pytest.mark.parametrize("layout_name", sorted(LAYOUTS))
def test_pages_round_trip_exactly(harness, layout_name, host_layout):
    layout = KVLayout(**LAYOUTS[layout_name], host_layout=host_layout)
    b = harness.reopen(fingerprint=layout.fingerprint())
    sizes = [p.page_bytes for p in layout.planes]
    src, dst = filled_pool(layout, 3, seed=1), filled_pool(layout, 3, seed=2)
    ks = keys(3, ns=layout_name + host_layout)
    payloads = [src.read_page(p) for p in range(3)]
    assert b.put([(k, memoryview(pl), sizes) for k, pl in zip(ks, payloads)]) == 3
    got = b.get(ks[::-1], sizes)  # read back in another order, into other pages
    for page, payload in enumerate(got):
        assert payload is not None and payload.nbytes == layout.page_bytes
        dst.write_page(page, payload)
    for page in range(3):
        want, have = src.page_view(2 - page), dst.page_view(page)
        for plane in want:
            assert torch.equal(want[plane].view(torch.uint8), have[plane].view(torch.uint8)), plane
    s = b.stats()
    assert (s.put_ok, s.gets, s.hits, s.misses) == (3, 3, 3, 0)
    assert s.bytes_written == s.bytes_read == 3 * layout.page_bytes
    b.check_integrity()
    b.close()


def test_batch_api_and_counters(harness):
    b = harness.backend
    ks = keys(6)
    sizes = [3, 5]
    pl = [bytes([i]) * 8 for i in range(6)]
    assert b.put([(ks[i], pl[i], sizes) for i in (0, 1, 2, 4)]) == 4
    assert b.exists(ks) == [True, True, True, False, True, False]
    assert b.prefix_hits(ks) == 3
    assert b.prefix_hits(ks[3:]) == 0
    assert b.prefix_hits([]) == 0 and b.exists([]) == [] and b.get([], sizes) == []
    got = b.get(ks, sizes)
    assert [None if g is None else bytes(g) for g in got] == [pl[0], pl[1], pl[2], None, pl[4], None]
    assert got[0].readonly
    assert b.put([(ks[0], b"\x09" * 8, sizes)]) == 1  # overwrite
    assert bytes(b.get([ks[0]], sizes)[0]) == b"\x09" * 8
    assert b.delete([ks[1], ks[3]]) == 1
    assert b.exists(ks[:2]) == [True, False]
    assert b.ping() is True and not b.down
    s = b.stats()
    assert (s.gets, s.hits, s.misses, s.corrupt, s.fingerprint_mismatch) == (7, 5, 2, 0, 0)
    assert (s.put_ok, s.put_dropped, s.errors, s.reconnects) == (5, 0, 0, 0)
    assert (s.bytes_written, s.bytes_read) == (40, 40)
    b.check_integrity()


def test_long_prefix_spans_growing_batches(harness):
    b = harness.backend
    ks = keys(300)
    assert b.put([(k, b"ab", [2]) for k in ks[:45]]) == 45
    assert b.prefix_hits(ks) == 45
    assert b.put([(k, b"ab", [2]) for k in ks[45:]]) == 255
    assert b.prefix_hits(ks) == 300


def test_misuse_raises_value_error(harness):
    b = harness.backend
    with pytest.raises(ValueError, match="16-byte page hash"):
        b.get([b"short"], [1])
    with pytest.raises(ValueError, match="16-byte page hash"):
        b.exists(["not-bytes-16char"])
    with pytest.raises(ValueError, match="3 bytes does not match plane sizes summing to 4"):
        b.put([(keys(1)[0], b"abc", [2, 2])])
    assert b.stats().put_dropped == 0


def _flip(o: bytes) -> bytes:
    bad = bytearray(o)
    bad[len(bad) // 2] ^= 0x40
    return bytes(bad)


CORRUPTIONS = {
    "flipped_payload_byte": lambda o: o[:-3] + bytes([o[-3] ^ 1]) + o[-2:],
    "flipped_middle_byte": _flip,
    "truncated": lambda o: o[:-5],
    "truncated_header": lambda o: o[:20],
    "empty": lambda o: b"",
    "not_ours": lambda o: b"some other application's value",
}


@pytest.mark.parametrize("how", sorted(CORRUPTIONS))
def test_corrupt_object_is_a_counted_miss_and_is_deleted(harness, how):
    b = harness.backend
    k0, k1 = keys(2)
    payload = bytes(range(200)) * 3
    assert b.put([(k0, payload, [600]), (k1, payload, [600])]) == 2
    harness.write_raw(k0, CORRUPTIONS[how](harness.read_raw(k0)))
    if harness.kind in ("memory", "file"):
        with pytest.raises(IntegrityError, match="1 stored object"):
            b.check_integrity()
    for _ in range(2):  # every time: the first read deletes it, the second misses
        got = b.get([k0, k1], [600])
        assert got[0] is None and bytes(got[1]) == payload
    s = b.stats()
    assert (s.gets, s.hits, s.misses, s.corrupt, s.fingerprint_mismatch) == (4, 2, 2, 1, 0)
    assert harness.read_raw(k0) is None and b.exists([k0]) == [False]
    b.check_integrity()


def test_wrong_fingerprint_is_detected_and_left_alone(harness):
    b = harness.backend
    k0, k1 = keys(2)
    other = codec.encode("f" * 32, k0, [4], b"abcd")
    harness.write_raw(k0, other)
    b.put([(k1, b"wxyz", [4])])
    for _ in range(3):
        got = b.get([k0, k1], [4])
        assert got[0] is None and bytes(got[1]) == b"wxyz"
    s = b.stats()
    assert (s.hits, s.misses, s.corrupt, s.fingerprint_mismatch) == (3, 3, 0, 3)
    assert harness.read_raw(k0) == other  # another layout's object: not ours to delete


def test_layouts_sharing_a_key_prefix_never_read_each_other(harness):
    k = keys(1)[0]
    a = harness.backend
    b = harness.reopen(fingerprint="e" * 32)  # same key_prefix, other layout
    assert a.put([(k, b"AAAA", [4])]) == 1
    assert b.get([k], [4]) == [None]
    # memory:// stores are private to each open, so there is nothing to reject
    assert b.stats().fingerprint_mismatch == (0 if harness.kind == "memory" else 1)
    b.close()


def test_default_prefix_separates_layouts(harness):
    k = os.urandom(16)
    a = harness.reopen(key_prefix="", fingerprint="1" * 32)
    b = harness.reopen(key_prefix="", fingerprint="2" * 32)
    assert a.key_prefix == b"hicache:11111111:" and b.key_prefix == b"hicache:22222222:"
    assert a.put([(k, b"xy", [2])]) == 1
    assert b.exists([k]) == [False] and b.get([k], [2]) == [None]
    assert b.stats().fingerprint_mismatch == 0
    assert a.delete([k]) == 1
    a.close()
    b.close()


def test_concurrent_callers_see_their_own_pages_and_counters_add_up(harness):
    from concurrent.futures import ThreadPoolExecutor
    b = harness.backend

    def worker(t: int) -> list[bool]:
        ks = keys(10, ns=f"thread{t}")
        assert b.put([(k, bytes([t, i]) * 8, [16]) for i, k in enumerate(ks)]) == 10
        both = keys(10, ns="shared")  # every thread writes the same bytes to these
        b.put([(k, bytes([99, i]) * 8, [16]) for i, k in enumerate(both)])
        got = b.get(ks + both, [16])
        return [bytes(g) == (bytes([t, i % 10]) if i < 10 else bytes([99, i - 10])) * 8
                for i, g in enumerate(got)]

    with ThreadPoolExecutor(4) as ex:
        results = list(ex.map(worker, range(4)))
    assert all(all(r) for r in results)
    s = b.stats()
    assert (s.put_ok, s.gets, s.hits, s.misses, s.errors) == (80, 80, 80, 0, 0)
    b.check_integrity()


def test_clear_deletes_only_this_layouts_objects(harness):
    b = harness.backend
    other = harness.reopen(key_prefix="other-" + harness.opts["key_prefix"])
    mine, theirs = keys(5), keys(3, ns="other")
    assert b.put([(k, b"m" * 4, [4]) for k in mine]) == 5
    assert other.put([(k, b"o" * 4, [4]) for k in theirs]) == 3
    assert b.clear() == 5
    assert b.exists(mine) == [False] * 5
    assert other.exists(theirs) == [True] * 3
    assert b.clear() == 0
    other.clear()
    other.close()
    b.check_integrity()
