"""The framed SET packs as one RESP bulk string without copying the payload."""
from __future__ import annotations

from redis.connection import Connection, Encoder, PythonRespSerializer

from hicache.storage.redis_wire import FramedConnection, FramedPacker, FramedValue


def resp(*args: bytes) -> bytes:
    return b"*%d\r\n" % len(args) + b"".join(b"$%d\r\n%s\r\n" % (len(a), a) for a in args)


def test_framed_set_is_the_resp_of_header_plus_payload_and_shares_the_payload():
    payload = memoryview(bytes(range(256)) * 40)  # > redis-py's 6000-byte cutoff
    chunks = FramedPacker().pack("SET", b"key", FramedValue(b"HDR", payload), "EX", 5)
    assert b"".join(bytes(c) for c in chunks) == resp(b"SET", b"key", b"HDR" + bytes(payload), b"EX", b"5")
    assert any(c is payload for c in chunks)  # sent as is: no copy


def test_plain_commands_pack_like_redis_py():
    py = PythonRespSerializer(6000, Encoder("utf-8", "strict", False).encode)
    for cmd in [("GET", b"k"), ("EXISTS", b"a"), ("CLUSTER SLOTS",), ("SET", b"k", b"v" * 10)]:
        assert b"".join(FramedPacker().pack(*cmd)) == b"".join(py.pack(*cmd))


def test_pipelined_commands_keep_the_payload_a_separate_chunk():
    conn = FramedConnection(host="127.0.0.1", port=1)  # never connects
    payload = memoryview(b"x" * 10000)
    out = conn.pack_commands([("SET", b"a", FramedValue(b"H", payload)), ("GET", b"a")])
    assert any(c is payload for c in out)
    assert b"".join(bytes(c) for c in out) == resp(b"SET", b"a", b"H" + b"x" * 10000) + resp(b"GET", b"a")
    assert isinstance(conn, Connection)
