"""`storage clear` on Redis deletes hicache objects only (issue 36, row 9).

Before the fix ``SET user:session:0123456789abcdef x; hicache storage clear
--prefix u --yes`` deleted the session key: any key under the prefix with a
16-byte tail was taken for an object. Each key's value must now start with
a hicache object header (magic and a header naming a fingerprint).
"""
from __future__ import annotations

import uuid

import redis

from hicache.cli import main
from hicache.core.hashing import page_hashes
from hicache.storage import open_storage

FP = "0f1e2d3c4b5a6978"


def test_clear_leaves_keys_that_are_no_hicache_object(redis_url, capsys):
    tag = f"u{uuid.uuid4().hex[:8]}"
    raw = redis.Redis.from_url(redis_url)
    foreign = {f"{tag}:session:0123456789abcdef".encode(): "string",
               f"{tag}:hicache:fake0123456789ab".encode(): "magic only",
               f"{tag}:list:0123456789abcdef".encode(): "list"}
    raw.set(b"%s:session:0123456789abcdef" % tag.encode(), b"x")
    raw.set(b"%s:hicache:fake0123456789ab" % tag.encode(), b"HCL3" + bytes(60))  # right magic, no header
    raw.rpush(b"%s:list:0123456789abcdef" % tag.encode(), b"a", b"b")
    st = open_storage(redis_url, fingerprint=FP, key_prefix=f"{tag}:obj:".encode(), timeout_ms=2000)
    keys = page_hashes(list(range(32)), 4)
    assert st.put([(k, bytes(100), [100]) for k in keys]) == len(keys)
    try:
        rc = main(["storage", "clear", "--url", redis_url, "--prefix", tag, "--yes"])
        out = capsys.readouterr().out
        assert rc == 0 and f"deleted {len(keys)} objects" in out and "left 3 keys" in out, out
        assert all(raw.exists(k) for k in foreign)
        assert st.exists(keys) == [False] * len(keys)
    finally:
        for k in foreign:
            raw.delete(k)
        st.close()
        raw.close()
