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


def test_framed_set_packs_the_same_on_its_fast_path_and_builds_a_lazy_header_once():
    payload = memoryview(b"p" * 7000)
    built = []

    def header() -> bytes:
        built.append(1)
        return b"HEADER"
    fast = FramedPacker().pack("SET", b"key", FramedValue(header, payload))
    general = FramedPacker().pack("SET", b"key", FramedValue(b"HEADER", payload), "KEEPTTL")
    assert b"".join(bytes(c) for c in fast) == resp(b"SET", b"key", b"HEADER" + bytes(payload))
    assert b"".join(bytes(c) for c in general) == resp(b"SET", b"key", b"HEADER" + bytes(payload), b"KEEPTTL")
    assert fast[1] is payload and built == [1]


def test_lazy_headers_are_packed_as_the_pipeline_is_sent():
    conn = FramedConnection(host="127.0.0.1", port=1)  # never connects
    order = []
    cmds = []
    for i in range(3):
        payload = memoryview(bytes([i]) * 9000)

        def header(i=i) -> bytes:
            order.append(f"header {i}")
            return b"H%d" % i
        cmds.append(("SET", b"k%d" % i, FramedValue(header, payload)))
    out = conn.pack_commands(cmds + [("GET", b"k0")])
    assert order == []  # nothing built yet: packing happens while sending
    sent = []
    for chunk in out:
        if isinstance(chunk, memoryview):
            order.append(f"payload {chunk[0]}")
        sent.append(bytes(chunk))
    assert order == ["header 0", "payload 0", "header 1", "payload 1", "header 2", "payload 2"]
    assert b"".join(sent) == b"".join(resp(b"SET", b"k%d" % i, b"H%d" % i + bytes([i]) * 9000) for i in range(3)) + \
        resp(b"GET", b"k0")
    eager = conn.pack_commands([("SET", b"a", FramedValue(b"H", memoryview(b"x" * 10)))])
    assert isinstance(eager, list)  # nothing lazy: redis-py's own packing


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


# --- DirectReplyParser: RESP2 replies; undecoded bulk values land in their own bytearray

import socket
import threading
import uuid

import pytest
import redis
from redis.exceptions import ConnectionError as RedisConnectionError, InvalidResponse, ResponseError

from hicache.core.hashing import page_hashes
from hicache.storage import open_storage
from hicache.storage.redis_wire import _DIRECT_MIN, DirectReplyParser

from .conftest import FP


class _Conn:
    """What the parser reads from a connection on connect."""

    def __init__(self, sock):
        self._sock = sock
        self.socket_timeout = 5.0
        self.encoder = Encoder("utf-8", "strict", False)


def parser_on(data: bytes, read_size: int = 64, dribble: int = 0):
    """A parser reading ``data`` from a socket pair; ``dribble``: the peer writes that many bytes at a time."""
    a, b = socket.socketpair()
    a.settimeout(5.0)
    p = DirectReplyParser(read_size)
    p.on_connect(_Conn(a))

    def send():
        if dribble:
            for i in range(0, len(data), dribble):
                b.sendall(data[i:i + dribble])
        else:
            b.sendall(data)
    t = threading.Thread(target=send, daemon=True)
    t.start()
    return p, a, b, t


def bulk(v: bytes) -> bytes:
    return b"$%d\r\n%s\r\n" % (len(v), v)


@pytest.mark.parametrize("read_size,dribble", [(64, 0), (64, 7), (1 << 16, 0), (64, 1)])
def test_bulk_values_across_every_boundary(read_size, dribble):
    values = [b"", b"x", bytes(range(256)) * 3, b"\r\n" * 50, bytes(5000), b"y" * 63, b"z" * 64, b"w" * 65,
              b"p" * (_DIRECT_MIN - 1), bytes(range(256)) * (_DIRECT_MIN // 256), b"q" * (3 * _DIRECT_MIN + 5)]
    if dribble == 1:
        values = values[:4] + values[-2:-1]
    data = b"".join(bulk(v) for v in values) + b"$-1\r\n"
    p, a, b, t = parser_on(data, read_size, dribble)
    for v in values:
        got = p.read_response(disable_decoding=True)
        # a page-sized value lands in its own bytearray; a small one is bytes, as redis-py's
        # own INFO parser (asked undecoded since redis-py 8.2) needs
        assert type(got) is (bytearray if len(v) >= _DIRECT_MIN else bytes) and got == v
    assert p.read_response(disable_decoding=True) is None
    assert not p.can_read(0)
    t.join()
    a.close()
    b.close()


def test_other_replies_keep_redis_py_types():
    long_line = b"s" * 1000  # longer than the parser's buffer: it grows
    data = (b"+OK\r\n:42\r\n:-7\r\n" + bulk(b"value") + b"*3\r\n$1\r\na\r\n*2\r\n:1\r\n$-1\r\n+st\r\n"
            + b"*-1\r\n*0\r\n-WRONGTYPE Operation against a key\r\n+" + long_line + b"\r\n" + bulk(b"v" * 3000))
    p, a, b, t = parser_on(data)
    assert p.read_response() == b"OK"
    assert p.read_response() == 42
    assert p.read_response() == -7
    got = p.read_response()
    assert type(got) is bytes and got == b"value"  # decoded replies stay bytes
    assert p.read_response() == [b"a", [1, None], b"st"]
    assert p.read_response() is None
    assert p.read_response() == []
    err = p.read_response()
    assert isinstance(err, ResponseError) and "Operation against a key" in str(err)
    assert p.read_response() == long_line
    assert p.can_read(0)
    assert p.read_response() == b"v" * 3000
    t.join()
    a.close()
    b.close()


def test_a_connection_error_reply_is_raised():
    p, a, b, t = parser_on(b"-ERR max number of clients reached\r\n")
    with pytest.raises(RedisConnectionError):
        p.read_response()
    t.join()
    a.close()
    b.close()


@pytest.mark.parametrize("cut", [3, 10, 70, 1000, 1002])
def test_a_server_that_closes_mid_reply_is_a_connection_error(cut):
    data = bulk(b"q" * 1000)[:cut]
    p, a, b, t = parser_on(data)
    t.join()
    b.close()
    with pytest.raises(RedisConnectionError):
        p.read_response(disable_decoding=True)
    a.close()


def test_a_bulk_not_followed_by_crlf_is_a_protocol_error():
    for data in (b"$3\r\nabcXY", b"*1\r\n!x\r\n", b"$x1\r\n", b":4.5\r\n", b"*two\r\n"):
        p, a, b, t = parser_on(data)
        with pytest.raises(InvalidResponse):
            p.read_response(disable_decoding=True)
        t.join()
        a.close()
        b.close()


def test_a_slow_reply_times_out():
    a, b = socket.socketpair()
    a.settimeout(0.05)
    p = DirectReplyParser(64)
    c = _Conn(a)
    c.socket_timeout = 0.05
    p.on_connect(c)
    b.sendall(b"$10\r\n12345")  # the rest never comes
    with pytest.raises(socket.timeout):
        p.read_response(disable_decoding=True)
    p.on_disconnect()
    assert not p.can_read(0)
    a.close()
    b.close()


def test_backend_connections_speak_resp2_through_the_direct_parser(redis_url):
    prefix = f"wire-{uuid.uuid4().hex[:8]}:"
    b = open_storage(redis_url, fingerprint=FP, key_prefix=prefix)
    keys = page_hashes(list(range(4 * 6)), 4, namespace=prefix)
    big, small = 200_000, 100  # a page spanning many reads next to tiny ones
    pages = [bytes([i]) * (big if i % 2 else small) for i in range(len(keys))]
    assert b.put([(k, p, [len(p)]) for k, p in zip(keys, pages)]) == len(keys)
    conn = b._client().connection_pool.get_connection()
    assert conn.protocol == 2 and isinstance(conn._parser, DirectReplyParser)
    b._client().connection_pool.release(conn)
    raw = redis.Redis.from_url(redis_url)
    raw.delete(prefix.encode() + keys[2])
    raw.rpush(prefix.encode() + keys[2], b"x")  # WRONGTYPE reply in the middle of the pipeline
    raw.delete(prefix.encode() + keys[3])  # absent
    got = b.get(keys, [big])
    assert [i for i, g in enumerate(got) if g is not None] == [1, 5]
    assert all(bytes(got[i]) == pages[i] and got[i].readonly for i in (1, 5))
    s = b.stats()
    assert (s.hits, s.misses, s.errors, s.corrupt) == (2, 4, 1, 2)  # the small pages: wrong sizes, deleted
    assert b.exists(keys) == [False, True, True, False, False, True]
    b.close()
    raw.delete(*[prefix.encode() + k for k in keys])
    raw.close()


def test_a_url_asking_for_resp3_keeps_redis_pys_parser(redis_url):
    sep = "&" if "?" in redis_url else "?"
    b = open_storage(redis_url + f"{sep}protocol=3", fingerprint=FP, key_prefix=f"w3-{uuid.uuid4().hex[:8]}:")
    keys = page_hashes(list(range(8)), 4)
    assert b.put([(k, b"p" * 70000, [70000]) for k in keys]) == 2
    assert [bytes(x) for x in b.get(keys, [70000])] == [b"p" * 70000] * 2
    rows = [bytearray(70000) for _ in keys]
    assert b.get_into(keys, [70000], rows) == [True, True]  # whole values, verified, then copied
    assert rows == [bytearray(b"p" * 70000)] * 2
    conn = b._client().connection_pool.get_connection()
    assert conn.protocol == 3 and not isinstance(conn._parser, DirectReplyParser)
    b._client().connection_pool.release(conn)
    b.delete(keys)
    b.close()


def test_a_corrupt_page_mid_pipeline_is_a_miss_and_its_neighbours_verify(redis_url):
    prefix = f"wirec-{uuid.uuid4().hex[:8]}:"
    b = open_storage(redis_url, fingerprint=FP, key_prefix=prefix)
    keys = page_hashes(list(range(4 * 5)), 4, namespace=prefix)
    pages = [bytes([i + 1]) * 150_000 for i in range(len(keys))]
    assert b.put([(k, p, [len(p)]) for k, p in zip(keys, pages)]) == len(keys)
    raw = redis.Redis.from_url(redis_url)
    full = prefix.encode() + keys[2]
    raw.setrange(full, 100_000, bytes([raw.getrange(full, 100_000, 100_000)[0] ^ 1]))  # one flipped payload byte
    got = b.get(keys, [150_000])
    assert [g is not None for g in got] == [True, True, False, True, True]
    assert all(bytes(got[i]) == pages[i] for i in (0, 1, 3, 4))
    assert b.stats().corrupt == 1 and not raw.exists(full)  # rejected and deleted
    b.delete(keys)
    b.close()
    raw.close()


def test_ok_replies_read_from_the_buffer_match_the_general_path():
    p, a, b, t = parser_on(b"+OK\r\n" * 4 + b"+OKAY\r\n")
    t.join()
    got = [p.read_response(), p.read_response(disable_decoding=True)]
    p.encoder = Encoder("utf-8", "strict", True)  # decode_responses=True
    got += [p.read_response(), p.read_response(), p.read_response()]
    assert got == [b"OK", b"OK", "OK", "OK", "OKAY"]
    a.close()
    b.close()


def test_tls_connections_read_through_the_direct_parser(tmp_path):
    import shutil
    import subprocess

    from .conftest import free_port, redis_server, stop
    if not shutil.which("openssl"):
        pytest.skip("openssl is not on PATH")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out",
                    str(cert), "-days", "1", "-subj", "/CN=127.0.0.1"], check=True, capture_output=True)
    port = free_port()
    try:
        proc = redis_server(port, str(tmp_path), "--port", "0", "--tls-port", str(port), "--tls-cert-file",
                            str(cert), "--tls-key-file", str(key), "--tls-auth-clients", "no")
    except RuntimeError:
        pytest.skip("this redis-server was built without TLS")
    try:
        b = open_storage(f"rediss://127.0.0.1:{port}/0?ssl_cert_reqs=none", fingerprint=FP, timeout_ms=2000)
        keys = page_hashes(list(range(4 * 5)), 4)
        pages = [bytes([i]) * 300_000 for i in range(len(keys))]
        assert b.put([(k, p, [len(p)]) for k, p in zip(keys, pages)]) == len(keys)
        for _ in range(3):  # the pooled connection is checked (can_read) before each reuse
            assert [bytes(x) for x in b.get(keys, [300_000])] == pages
        conn = b._client().connection_pool.get_connection()
        assert type(conn).__name__ == "FramedSSLConnection" and isinstance(conn._parser, DirectReplyParser)
        b._client().connection_pool.release(conn)
        assert b.prefix_hits(keys) == len(keys) and b.delete(keys) == len(keys)
        s = b.stats()
        assert (s.hits, s.errors, s.put_dropped) == (15, 0, 0)
        b.close()
    finally:
        stop(proc)
