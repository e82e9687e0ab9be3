"""A flood frame on the engine socket never holds the loop (issue 27, item 2).

Before the fix a hello announcing 7.5 MiB (a layout with 800K
``extra_planes``) was read whole, decoded (~2 s) and built plane by plane
(~4 s) on the event loop before it was refused; every other client waited.
Now the first frame of a connection is bounded from its 4-byte header, a
layout's plane count is checked before any plane is built, and large frames
of handshaken clients are decoded off the loop. No wall-clock asserts: the
tests check what the server read and in which order it answered.
"""
from __future__ import annotations

import msgpack
import pytest

from hicache.client.link import ServiceClient
from hicache.core.errors import LayoutError
from hicache.core.hashing import page_hashes
from hicache.core.layout import MAX_EXTRA_PLANES, KVLayout
from hicache.client.protocol import HEADER, MAX_HELLO_BYTES, hello_request
from tests.raw_socket import RawConn

FLOOD = 7_500_000  # what the 800K-plane hello weighed


def test_oversized_hello_is_refused_from_its_header(server):
    srv = server(handshake_timeout_s=30)
    r = RawConn(srv.socket_path)
    r.send_raw(HEADER.pack(FLOOD))  # the header only: the refusal cannot wait for the body
    rep = r.recv()
    assert rep["ok"] is False and rep["kind"] == "too_large", rep
    assert f"first frame of {FLOOD} bytes exceeds the handshake limit of {MAX_HELLO_BYTES}" in rep["message"]
    assert r.closed()


def test_other_clients_are_answered_while_a_flood_hello_is_pending(server):
    srv = server(handshake_timeout_s=30)
    lay = srv.layout
    flood = RawConn(srv.socket_path)
    d = lay.to_dict() | {"extra_planes": [[f"p{i}", 1] for i in range(800_000)]}
    frame = msgpack.packb(hello_request(d, lay.fingerprint(), 1), use_bin_type=True)
    assert len(frame) > FLOOD
    flood.send_raw(HEADER.pack(len(frame)) + frame[:4096])  # begun, far from complete
    with ServiceClient(srv.socket_path, lay) as c:  # answered before the flood's bytes are all sent
        assert c.lookup(page_hashes(list(range(8)), lay.page_size)).num_pages == 0
    rep = flood.recv()
    assert rep["kind"] == "too_large" and flood.closed()
    assert srv.stats().errors == {"too_large": 1}


def test_layout_counts_planes_before_building_them():
    base = KVLayout("m", num_layers=2, num_kv_heads=1, head_dim=4).to_dict()
    # Entries that could not even be built: the count refuses them first.
    with pytest.raises(LayoutError, match=rf"at most {MAX_EXTRA_PLANES} extra planes, got 800000") as e:
        KVLayout.from_dict(base | {"extra_planes": [["p", 1, 2, 3]] * 800_000})
    assert len(str(e.value)) < 200 and e.value.field == "extra_planes"
    ok = KVLayout.from_dict(base | {"extra_planes": [[f"p{i}", 1] for i in range(MAX_EXTRA_PLANES)]})
    assert len(ok.extra_planes) == MAX_EXTRA_PLANES


def test_hello_with_too_many_planes_is_bad_layout(server):
    srv = server()
    r = RawConn(srv.socket_path)
    d = srv.layout.to_dict() | {"extra_planes": [[f"p{i}", 1] for i in range(MAX_EXTRA_PLANES + 1)]}
    rep = r.call(hello_request(d, "x" * 32, 1))
    assert rep["kind"] == "bad_layout" and f"got {MAX_EXTRA_PLANES + 1}" in rep["message"]
    assert r.closed()


def test_large_frames_of_a_handshaken_client_do_not_stall_others(server):
    """A client may send up to max_request_bytes once handshaken; another is served while it arrives."""
    srv = server(handshake_timeout_s=30)
    lay = srv.layout
    big = RawConn(srv.socket_path)
    big.hello(lay)
    hashes = [bytes(16)] * 400_000  # 7.2 MB of msgpack: decoded off the loop
    body = msgpack.packb({"op": "lookup", "hashes": hashes}, use_bin_type=True)
    big.send_raw(HEADER.pack(len(body)) + body[:len(body) // 2])
    with ServiceClient(srv.socket_path, lay) as c:
        assert c.lookup(page_hashes(list(range(8)), lay.page_size)).num_pages == 0
    big.send_raw(body[len(body) // 2:])
    rep = big.recv()
    assert rep["ok"] is True and rep["pages"] == [], rep
