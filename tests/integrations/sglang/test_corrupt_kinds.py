"""Every kind of damaged L3 object is rejected through SGLang's own load path
(``HiCacheController._page_get_zero_copy`` over ``HiCacheBackend.batch_get_v1``), on
file:// and redis://, both host layouts, with and without a MAC: a flipped byte, a
truncated object, another page's object under the key (swapped), another model's
object under the key, and (with a MAC) an object forged with a recomputed checksum.
The pages SGLang is told loaded hold exactly the stored bytes; the hit ends at the
damaged page."""
from __future__ import annotations

import uuid

import pytest
import redis
import torch
from sglang.srt.managers.cache_controller import PrefetchOperation

from hicache.integrations.sglang_keys import page_key
from hicache.storage import codec

from .conftest import PAGE, controller
from .test_backend import keys_for, pages_of

SECRET = "a-shared-secret-of-32-characters"
KINDS = ["flip", "truncate", "swap", "other_model", "forged"]


def _raw(store, url: str):
    """(get, put) of the stored object of a page hash, behind the backend's back."""
    if url.startswith("redis"):
        r = redis.Redis.from_url(url)
        return (lambda h: r.get(store.key_prefix + h)), (lambda h, o: r.set(store.key_prefix + h, o))
    return (lambda h: store.path_of(h).read_bytes()), (lambda h, o: store.path_of(h).write_bytes(o))


CASES = [(kind, layout, mac) for kind in KINDS for layout in ("layer_first", "page_first")
         for mac in ("", SECRET) if kind != "forged" or mac]


@pytest.mark.parametrize("kind,layout,mac", CASES)
def test_damaged_objects_never_load(kind, layout, mac, l3_url, model, controllers):
    extra = {"key_prefix": f"corrupt-{uuid.uuid4().hex[:8]}:", **({"auth_key": mac} if mac else {})}
    c = controller("mha", layout, l3_url, model, extra=extra)
    controllers.append(c)
    pool, b = c.mem_pool_host, c.storage_backend
    keys = keys_for(3, seed=len(kind) + len(layout))
    src, dst = pool.alloc(3 * PAGE), pool.alloc(3 * PAGE)
    want = pages_of(pool, src)
    assert c.page_set_func(keys, src)
    get, put = _raw(b.store, l3_url)
    h1, h2 = page_key(keys[1]), page_key(keys[2])
    obj = bytearray(get(h1))
    if kind == "flip":
        obj[len(obj) // 2] ^= 0x01
        put(h1, bytes(obj))
    elif kind == "truncate":
        put(h1, bytes(obj[:-len(obj) // 3]))
    elif kind == "swap":
        put(h1, get(h2))
    elif kind == "other_model":  # another model's backend sharing the store, the prefix and the key
        other = controller("mha", layout, l3_url, model + "-other", extra=extra)
        controllers.append(other)
        assert other.storage_backend.layout.fingerprint() != b.layout.fingerprint()
        osrc = other.mem_pool_host.alloc(3 * PAGE)
        assert other.storage_backend.store.delete([h1]) == 1
        assert other.page_set_func(keys[1:2], osrc[:PAGE])
    else:  # forged: well formed, checksum recomputed, no key
        payload = bytes(b.layout.page_bytes)
        put(h1, codec.encode(b.layout.fingerprint(), h1, [p.page_bytes for p in b.layout.planes], payload))
    hits = c.page_get_func(PrefetchOperation("r", []), keys, dst)
    got = pages_of(pool, dst)
    assert hits == 1 and torch.equal(got[0], want[0]), (kind, hits)
    s = b.hicache_stats()
    assert (s.fingerprint_mismatch, s.corrupt) == ((1, 0) if kind == "other_model" else (0, 1)), s
