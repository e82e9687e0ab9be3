"""Authenticated L3 objects, opt-in (issue 17, item 8).

Before the fix an object rewritten with a recomputed checksum was accepted:
the checksum catches damage, not forgery. With ``storage.auth_key`` every
object carries a keyed MAC; a forged or unkeyed object is a counted miss.
"""
from __future__ import annotations

import pytest

from hicache.core.config import HiCacheConfig
from hicache.core.errors import ConfigError
from hicache.storage import codec, open_storage

FP = "0f1e2d3c4b5a69788796a5b4c3d2e1f0"
SIZES = [16, 16]
KEY = "a-shared-secret-of-32-characters"


def key(i: int) -> bytes:
    return i.to_bytes(16, "big")


@pytest.fixture(params=["memory", "file"])
def url(request, tmp_path):
    return "memory://" if request.param == "memory" else f"file://{tmp_path}/l3"


def forge(b, page: bytes, payload: bytes) -> None:
    """What an attacker with write access does: a well-formed object, checksum recomputed, no key."""
    obj = codec.encode(FP, page, SIZES, payload)
    if b.scheme == "file":
        b.path_of(page).write_bytes(obj)
    else:  # memory:// lives in this process: write its table directly
        b._objects[b.key_prefix + page] = obj


def test_forged_objects_are_counted_misses(url):
    b = open_storage(url, fingerprint=FP, auth_key=KEY)
    try:
        good = bytes(range(32))
        assert b.put([(key(1), good, SIZES), (key(2), good, SIZES)]) == 2
        forge(b, key(2), bytes(32))
        got = b.get([key(1), key(2)], SIZES)
        assert bytes(got[0]) == good and got[1] is None
        s = b.stats()
        assert (s.hits, s.misses, s.corrupt) == (1, 1, 1)
        # A reader without the key still reads keyed objects (it just cannot check them).
        plain = open_storage(url, fingerprint=FP) if url != "memory://" else None
        if plain is not None:
            assert bytes(plain.get([key(1)], SIZES)[0]) == good
            plain.close()
    finally:
        b.close()


def test_a_wrong_key_or_a_tampered_mac_is_rejected():
    o = codec.encode(FP, key(3), SIZES, bytes(32), codec.mac_key(KEY.encode()))
    assert codec.decode(o, key(3), FP, SIZES, codec.mac_key(KEY.encode())).status is codec.ReadStatus.OK
    d = codec.decode(o, key(3), FP, SIZES, codec.mac_key(b"another-secret-of-enough-length"))
    assert d.status is codec.ReadStatus.CORRUPT and "MAC" in d.why
    plain = codec.encode(FP, key(3), SIZES, bytes(32))
    assert "no MAC" in codec.decode(plain, key(3), FP, SIZES, codec.mac_key(KEY.encode())).why


def test_auth_key_config(tmp_path):
    with pytest.raises(ConfigError, match="at least 16 bytes"):
        open_storage("memory://", fingerprint=FP, auth_key="short")
    f = tmp_path / "k"
    f.write_text(KEY + "\n")
    cfg = HiCacheConfig.load(overrides={"storage.auth_key_file": str(f)}, env={})
    assert cfg.storage.resolved_auth_key() == KEY.encode()
    assert KEY not in repr(open_storage("memory://", fingerprint=FP, auth_key=KEY).options)
