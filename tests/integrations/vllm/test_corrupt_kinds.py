"""Every kind of damaged L3 object is rejected through vLLM's own load path
(``HiCacheTier.submit_load`` -> ``get_finished_jobs``), on file:// and redis://,
with and without a MAC: a flipped byte, a truncated object, another page's object
under the key (swapped), another model's object under the key, and (with a MAC) an
object forged with a recomputed checksum. Whatever vLLM is told loaded holds exactly
the stored bytes; a damaged chunk is reported not loaded."""
from __future__ import annotations

import itertools

import numpy as np
import pytest
import redis

from hicache.integrations.vllm import page_hash
from hicache.storage import codec

from .tiers import finish, job, keys, tier

SECRET = "a-shared-secret-of-32-characters"
KINDS = ["flip", "truncate", "swap", "other_model", "forged"]
_ids = itertools.count(1)


class Raw:
    """The stored object of a page hash, read and written behind the tier's back."""

    def __init__(self, t):
        self.t = t
        self.r = redis.Redis.from_url(t.url) if t.url.startswith("redis") else None

    def get(self, h: bytes) -> bytes:
        if self.r is not None:
            return self.r.get(self.t.storage.key_prefix + h)
        return self.t.storage.path_of(h).read_bytes()

    def put(self, h: bytes, obj: bytes) -> None:
        if self.r is not None:
            self.r.set(self.t.storage.key_prefix + h, obj)
        else:
            self.t.storage.path_of(h).write_bytes(obj)


def damage(kind: str, raw: Raw, ha: bytes, hb: bytes, t, url: str, prefix: str, mac: str) -> None:
    obj = bytearray(raw.get(ha))
    if kind == "flip":
        obj[len(obj) // 2 + 8] ^= 0x01  # one bit, inside the payload
        raw.put(ha, bytes(obj))
    elif kind == "truncate":
        raw.put(ha, bytes(obj[:-max(1, len(obj) // 3)]))
    elif kind == "swap":
        raw.put(ha, raw.get(hb))
    elif kind == "other_model":  # a tier of another model, sharing the store, prefix and key
        arr2 = np.full((2, t._row_bytes), 7, dtype=np.int8)
        other = tier(url, memoryview(arr2), model="model-b", key_prefix=prefix, probe_l3=False, auth_key=mac)
        assert other.fingerprint != t.fingerprint
        other.storage.put([(ha, arr2[0].tobytes(), [t._row_bytes])])
        other.shutdown()
    else:  # forged: well-formed, checksum recomputed, written by someone without the key
        raw.put(ha, codec.encode(t.fingerprint, ha, [t._row_bytes], bytes(t._row_bytes)))


# 2 MiB rows: a load of three is split among the file:// workers, each verifying its own.
CASES = [(u, row, mac, kind) for u, row in (("file", 64), ("file", 2 << 20), ("redis", 64))
         for mac in ("", SECRET) for kind in KINDS if kind != "forged" or mac]


@pytest.mark.parametrize("where,row,mac,kind", CASES)
def test_damaged_objects_never_load(where, row, mac, kind, tmp_path, redis_url):
    url = f"file://{tmp_path}/l3" if where == "file" else redis_url
    prefix = f"hicache-vllm-corrupt:{next(_ids)}:"
    arr = np.zeros((6, row), dtype=np.int8)
    t = tier(url, memoryview(arr), key_prefix=prefix, probe_l3=False, auth_key=mac)
    try:
        ks = keys(1, 2, 3)
        arr[:3] = np.random.default_rng(row + len(kind)).integers(-128, 128, size=(3, row), dtype=np.int8)
        want = arr[:3].copy()
        t.submit_store(job(1, ks, [0, 1, 2], promotion=False))
        assert finish(t)[1].success
        ha, hb = page_hash(ks[1]), page_hash(ks[2])
        damage(kind, Raw(t), ha, hb, t, url, prefix, mac)
        arr[:] = 0
        t.submit_load(job(2, ks, [3, 4, 5], promotion=True))
        r = finish(t)[2]
        assert not r.success and set(r.successful_keys) == {ks[0], ks[2]}, (kind, r)
        assert np.array_equal(arr[3], want[0]) and np.array_equal(arr[5], want[2])
        s = t.storage.stats()
        if kind == "other_model":
            assert (s.fingerprint_mismatch, s.corrupt) == (1, 0)
        else:
            assert (s.corrupt, s.fingerprint_mismatch) == (1, 0)
            assert Raw(t).get(ha) is None if where == "redis" else not t.storage.path_of(ha).exists()
        assert t.stats().misses == 1
    finally:
        t.shutdown()

