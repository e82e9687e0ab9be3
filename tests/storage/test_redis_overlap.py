"""Large Redis puts checksum chunk j+1 on a helper thread while chunk j is sent:
same objects on the server as the serial path, every header built once."""
from __future__ import annotations

import os
import uuid

import pytest
import redis

from hicache.core.hashing import page_hashes
from hicache.storage import codec, open_storage, redis_backend
from hicache.storage.into import PutBatch

from .conftest import FP


@pytest.mark.parametrize("overlap", [True, False])
def test_chunked_put_stores_the_same_objects(redis_url, monkeypatch, overlap):
    monkeypatch.setattr(redis_backend, "OVERLAP_CHUNK_BYTES", 3000)  # 4 KiB pages: one chunk each
    built = []
    real = codec.encode_header
    monkeypatch.setattr(codec, "encode_header", lambda *a: built.append(a[1]) or real(*a))
    prefix = f"ovl-{uuid.uuid4().hex[:8]}:".encode()
    b = open_storage(redis_url, fingerprint=FP, key_prefix=prefix.decode())
    b.overlap_checksums = overlap
    keys = page_hashes(list(range(7 * 4)), 4, namespace=prefix.decode())
    payloads = [os.urandom(4096) for _ in keys]
    sizes = [1000, 3096]
    assert b.put([(k, p, sizes) for k, p in zip(keys, payloads)]) == len(keys)
    assert sorted(built) == sorted(keys)  # one header per page, whichever thread built it
    raw = redis.Redis.from_url(redis_url)
    for k, p in zip(keys, payloads):
        obj = raw.get(prefix + k)
        assert obj == real(FP, k, sizes, p) + p  # exactly header + payload, byte for byte
    assert [bytes(x) for x in b.get(keys, sizes)] == payloads
    if overlap:
        assert b._hash_pool is not None  # the chunked path ran
    b.delete(keys)
    b.close()
    assert b._hash_pool is None  # close() stops the helper
    raw.close()


def test_small_batches_take_one_pipeline(redis_url):
    b = open_storage(redis_url, fingerprint=FP, key_prefix=f"ovl-{uuid.uuid4().hex[:8]}:")
    keys = page_hashes(list(range(8)), 4)
    assert b.put([(k, b"x" * 64, [64]) for k in keys]) == 2
    assert b._hash_pool is None  # under OVERLAP_CHUNK_BYTES: no helper thread
    b.delete(keys)
    b.close()


def test_lazy_put_builds_headers_in_groups_as_the_pipeline_is_sent(redis_url, monkeypatch):
    monkeypatch.setattr(redis_backend, "LAZY_GROUP_BYTES", 3 * 4096)  # groups of three 4 KiB pages
    groups: list[list[int]] = []
    real = PutBatch.header_ahead

    def spy(self, i, nbytes):
        before = [j for j in range(len(self)) if self._headers[j] is not None]
        out = real(self, i, nbytes)
        built = [j for j in range(len(self)) if self._headers[j] is not None and j not in before]
        if built:
            groups.append(built)
        return out
    monkeypatch.setattr(PutBatch, "header_ahead", spy)
    prefix = f"lazy-{uuid.uuid4().hex[:8]}:"
    b = open_storage(redis_url, fingerprint=FP, key_prefix=prefix)
    b.overlap_checksums = False
    keys = page_hashes(list(range(7 * 4)), 4, namespace=prefix)
    payloads = [os.urandom(4096) for _ in keys]
    assert b.put([(k, p, [4096]) for k, p in zip(keys, payloads)]) == len(keys)
    assert groups == [[0, 1, 2], [3, 4, 5], [6]]
    assert [bytes(x) for x in b.get(keys, [4096])] == payloads
    b.delete(keys)
    b.close()
