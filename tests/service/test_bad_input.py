"""Bad input never crashes the service or corrupts its state; fuzzed framing too."""
from __future__ import annotations

import os
import socket

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hicache.client.link import ServiceClient
from hicache.core.hashing import page_hashes
from hicache.client.protocol import HEADER, OPS, PROTOCOL_VERSION, hello_request

MAX = 16384  # conftest.MAX_REQUEST_BYTES
H = b"\x01" * 16


def healthy(service) -> dict:
    """A good client is still served and the server's invariants hold."""
    with ServiceClient(service.socket, service.layout) as c:
        c.check_integrity()
        assert c.lookup([H]).num_pages in (0, 1)
        return c.stats()


# (name, frames sent after an optional handshake, expected kind, connection closed after)
FRAMING = [
    ("op before hello", False, [{"op": "lookup", "hashes": []}], "not_handshaken", True),
    ("wrong protocol", False, [{**hello_request({}, "", 1), "protocol": 99}], "version", True),
    ("garbage layout", False, [hello_request({"model_id": "x", "num_layers": "two"}, "", 1)], "bad_layout", True),
    ("unknown layout field", False, [hello_request({"model_id": "x", "colour": 1}, "", 1)], "bad_layout", True),
    ("layout not a map", False, [hello_request([1, 2], "", 1)], "bad_layout", True),
    ("body not a map", True, [7], "bad_request", False),
    ("unknown op", True, [{"op": "explode"}], "unknown_op", False),
    ("op not a string", True, [{"op": [1]}], "unknown_op", False),
    ("hello twice", True, [{"op": "hello"}], "bad_request", False),
    ("missing field", True, [{"op": "lookup"}], "bad_args", False),
    ("hashes not a list", True, [{"op": "lookup", "hashes": "abc"}], "bad_args", False),
    ("short hash", True, [{"op": "acquire", "hashes": [b"abc"]}], "bad_args", False),
    ("text hash", True, [{"op": "release", "hashes": ["0" * 16]}], "bad_args", False),
    ("negative reserve", True, [{"op": "reserve", "n": -1}], "bad_args", False),
    ("float reserve", True, [{"op": "reserve", "n": 1.5}], "bad_args", False),
    ("huge reserve", True, [{"op": "reserve", "n": 1 << 40}], "out_of_pages", False),
    ("page out of range", True, [{"op": "commit", "hashes": [H], "pages": [16]}], "foreign_page", False),
    ("negative page", True, [{"op": "cancel", "pages": [-1]}], "foreign_page", False),
    ("commit unreserved", True, [{"op": "commit", "hashes": [H], "pages": [0]}], "not_reserved", False),
    ("release unacquired", True, [{"op": "release", "hashes": [H]}], "not_acquired", False),
]


@pytest.mark.parametrize("name,handshake,frames,kind,closed", FRAMING, ids=[f[0] for f in FRAMING])
def test_bad_requests_get_an_error_frame(service, raw, name, handshake, frames, kind, closed):
    before = healthy(service)["errors"].get(kind, 0)
    c = raw()
    if handshake:
        c.hello(service.layout)
    for f in frames:
        rep = c.call(f)
        assert rep is not None and rep["ok"] is False and rep["kind"] == kind, rep
        assert rep["message"]
    if closed:
        assert c.recv() is None
    else:
        assert c.call({"op": "stats"})["ok"] is True  # the connection keeps working
    assert healthy(service)["errors"][kind] == before + 1


def test_version_error_names_both_versions(service, raw):
    rep = raw().call({**hello_request(service.layout.to_dict(), service.layout.fingerprint(), 1),
                      "protocol": 99})
    assert rep["kind"] == "version" and f"ours={PROTOCOL_VERSION} theirs=99" in rep["message"]


def test_committing_pages_reserved_by_another_client_is_refused(service, raw):
    a, b = raw(), raw()
    a.hello(service.layout)
    b.hello(service.layout)
    pages = a.call({"op": "reserve", "n": 2})["pages"]
    hashes = page_hashes(list(range(4 * service.layout.page_size, 6 * service.layout.page_size)),
                         service.layout.page_size)
    rep = b.call({"op": "commit", "hashes": hashes, "pages": pages})
    assert rep["kind"] == "not_reserved" and f"page {pages[0]} is not reserved" in rep["message"]
    with ServiceClient(service.socket, service.layout) as w:  # a's bytes, written through the segment
        for p in pages:
            w.pool.write_page(p, bytes(service.layout.page_bytes))
    assert a.call({"op": "commit", "hashes": hashes, "pages": pages})["inserted"] in (0, 2)


@pytest.mark.parametrize("header,kind", [(HEADER.pack(MAX + 1), "too_large"), (HEADER.pack(0), "bad_frame"),
                                         (HEADER.pack(0xFFFFFFFF), "too_large")])
def test_unusable_frame_length_is_answered_then_closed(service, raw, header, kind):
    c = raw()
    c.send_raw(header)
    rep = c.recv()
    assert rep["ok"] is False and rep["kind"] == kind
    if kind == "too_large":
        assert f"limit of {MAX}" in rep["message"]  # (a first frame: the handshake limit)
    assert c.recv() is None
    healthy(service)


def test_invalid_msgpack_body_keeps_the_connection(service, raw):
    c = raw()
    c.hello(service.layout)
    c.send_raw(HEADER.pack(1) + b"\xc1")  # 0xc1 is never valid msgpack
    rep = c.recv()
    assert rep["kind"] == "bad_frame" and "not valid msgpack" in rep["message"]
    c.send_raw(HEADER.pack(3) + b"\x01\x02\x03")  # trailing data
    assert c.recv()["kind"] == "bad_frame"
    assert c.call({"op": "stats"})["ok"] is True


def test_client_vanishing_mid_frame_is_harmless(service, raw):
    c = raw()
    c.hello(service.layout)
    c.call({"op": "reserve", "n": 3})
    c.send_raw(HEADER.pack(100) + b"\x81")  # promise 100 bytes, send 1, hang up
    c.close()
    for _ in range(500):  # the server sees the hang-up asynchronously
        s = healthy(service)
        if s["reserved_pages"] == 0:
            break
    assert s["reserved_pages"] == 0 and s["clients"] == 1  # just the checker


_settings = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def _drain(sock_path: str, data: bytes) -> list[dict]:
    """Send ``data`` on a fresh connection, half-close, collect every reply until EOF."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(10)
    s.connect(sock_path)
    try:
        try:
            s.sendall(data)
            s.shutdown(socket.SHUT_WR)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the server hung up first: fine
        buf = b""
        while True:
            try:
                chunk = s.recv(65536)
            except ConnectionResetError:
                break
            if not chunk:
                break
            buf += chunk
    finally:
        s.close()
    out = []
    while len(buf) >= 4:
        n = HEADER.unpack(buf[:4])[0]
        assert len(buf) >= 4 + n, "truncated reply frame"
        out.append(msgpack.unpackb(buf[4:4 + n], raw=False))
        buf = buf[4 + n:]
    assert buf == b"", "trailing bytes after the last reply frame"
    return out


@_settings
@given(data=st.binary(max_size=300))
def test_fuzz_random_bytes(service, data):
    for rep in _drain(service.socket, data):
        assert rep["ok"] is False and rep["kind"] in ("bad_frame", "too_large", "bad_request",
                                                     "not_handshaken", "version", "bad_layout")
    healthy(service)


_scalar = st.one_of(st.none(), st.booleans(), st.integers(-2**63, 2**64 - 1), st.floats(allow_nan=False),
                    st.binary(max_size=20), st.text(max_size=10), st.just(H))
_value = st.recursive(_scalar, lambda inner: st.lists(inner, max_size=4)
                      | st.dictionaries(st.text(max_size=6), inner, max_size=4), max_leaves=12)
_request = st.fixed_dictionaries(
    {"op": st.one_of(st.sampled_from(sorted(OPS - {"bye"})), _value)},
    optional={"hashes": _value, "pages": _value, "n": _value, "x": _value})


@_settings
@given(reqs=st.lists(_request, min_size=1, max_size=6))
def test_fuzz_requests_after_handshake(service, reqs):
    hello = hello_request(service.layout.to_dict(), service.layout.fingerprint(), os.getpid())
    frames = [msgpack.packb(r, use_bin_type=True) for r in [hello, *reqs]]
    replies = _drain(service.socket, b"".join(HEADER.pack(len(f)) + f for f in frames))
    assert len(replies) == len(frames) and replies[0]["ok"] is True
    for rep in replies[1:]:
        assert isinstance(rep["ok"], bool) and (rep["ok"] or rep["kind"] != "internal"), rep
    s = healthy(service)
    assert s["reserved_pages"] == 0 and s["locked_pages"] == 0
