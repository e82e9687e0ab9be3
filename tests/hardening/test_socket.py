"""The engine socket against hostile or broken local callers (issue 17, items 1-3).

Each test failed on the code before the fix: a huge layout was built plane by
plane on the event loop (no error, seconds of work); idle and half-sent
connections were held forever (the reads below would block until the 10 s
socket timeout); connections were unbounded; the socket followed the umask;
any peer was served; unwritten pages were committed; every refusal was logged.
"""
from __future__ import annotations

import logging
import os
import stat

import pytest
import torch

from hicache.node.socket_guard import PeerCred, PeerPolicy
from hicache.client.link import ServiceClient
from hicache.core.errors import LayoutError, ServiceError
from hicache.core.hashing import page_hashes
from hicache.core.layout import LIMITS, KVLayout
from hicache.client.protocol import HEADER, hello_request
from tests.raw_socket import RawConn



@pytest.mark.parametrize("field,value", [("num_layers", 1_000_000), ("num_layers", 10**18),
                                         ("num_kv_heads", 10**9), ("page_size", 1 << 40),
                                         ("draft_layers", 10**6)])
def test_layout_fields_are_bounded(field, value):
    d = KVLayout("m", num_layers=2, num_kv_heads=1, head_dim=4).to_dict() | {field: value}
    with pytest.raises(LayoutError, match=rf"KVLayout.{field}={value}: must be an integer in \[\d, {LIMITS[field]}\]"):
        KVLayout.from_dict(d)


def test_a_page_too_large_for_memory_is_refused():
    with pytest.raises(LayoutError, match="page would hold"):
        KVLayout("m", num_layers=1024, num_kv_heads=1024, head_dim=8192, page_size=4096)


def test_huge_hello_is_refused_and_others_are_served(server):
    srv = server()
    lay = srv.layout
    r = RawConn(srv.socket_path)
    rep = r.call(hello_request(lay.to_dict() | {"num_layers": 10**18}, "x" * 32, 1))
    assert rep["ok"] is False and rep["kind"] == "bad_layout" and "num_layers" in rep["message"]
    assert r.closed()
    with ServiceClient(srv.socket_path, lay) as c:  # the loop still serves
        assert c.lookup(page_hashes(list(range(4)), 4)).num_pages == 0


def test_no_hello_within_the_handshake_timeout_is_hung_up(server):
    srv = server(handshake_timeout_s=0.2)
    r = RawConn(srv.socket_path)
    rep = r.recv()  # blocks until the server gives up on us (before the fix: forever)
    assert rep["kind"] == "timeout" and "handshake_timeout_s" in rep["message"]
    assert r.closed()


def test_a_half_sent_frame_is_hung_up(server):
    srv = server(handshake_timeout_s=0.2)
    r = RawConn(srv.socket_path)
    r.hello(srv.layout)
    r.s.sendall(HEADER.pack(100) + b"\x81")  # a 100-byte body announced, one byte sent
    rep = r.recv()
    assert rep["kind"] == "timeout" and "frame was not completed" in rep["message"]
    assert r.closed()


def test_an_idle_client_is_closed_and_its_reservations_reclaimed(server):
    srv = server(idle_timeout_s=0.3)
    r = RawConn(srv.socket_path)
    r.hello(srv.layout)
    assert r.call({"op": "reserve", "n": 3})["ok"]
    assert r.closed()  # the server hangs up quietly after idle_timeout_s
    with ServiceClient(srv.socket_path, srv.layout) as c:
        s = c.stats()
    assert s["reserved_pages"] == 0 and s["reclaimed"] == 3


def test_connections_are_capped_with_a_clear_refusal(server):
    srv = server(max_connections=3)
    held = [RawConn(srv.socket_path) for _ in range(3)]
    for h in held:
        h.hello(srv.layout)
    extra = RawConn(srv.socket_path)
    rep = extra.recv()
    assert rep["kind"] == "busy" and "service.max_connections=3" in rep["message"]
    assert extra.closed()
    held.pop().close()
    for _ in range(100):  # the server notices the close on its loop
        try:
            with ServiceClient(srv.socket_path, srv.layout) as c:
                assert c.stats()["errors"]["busy"] >= 1
            break
        except ServiceError as e:
            assert e.kind == "busy"
    else:
        pytest.fail("a freed connection slot was never reused")


def test_socket_mode_ignores_the_umask(server):
    old = os.umask(0)
    try:
        srv = server()
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(srv.socket_path).st_mode) == 0o600
    srv2 = server(socket_mode="0660", socket_group=str(os.getegid()))
    st = os.stat(srv2.socket_path)
    assert stat.S_IMODE(st.st_mode) == 0o660 and st.st_gid == os.getegid()


def test_peer_policy():
    p = PeerPolicy(owner_uid=1000, allowed_uids=frozenset({1001}), group_gid=None)
    assert p.allows(PeerCred(1, 1000, 5)) and p.allows(PeerCred(1, 1001, 5)) and p.allows(PeerCred(1, 0, 0))
    assert not p.allows(PeerCred(1, 1002, 5))
    assert PeerPolicy(1000, frozenset(), group_gid=77).allows(PeerCred(1, 1002, 77))


def test_a_peer_outside_the_allow_list_is_refused(server):
    srv = server()
    # A policy that trusts neither this process's uid nor root stands in for another user.
    srv.policy = PeerPolicy(owner_uid=-1, allowed_uids=frozenset(), group_gid=None, allow_root=False)
    r = RawConn(srv.socket_path)
    rep = r.recv()
    assert rep["kind"] == "forbidden" and f"uid {os.geteuid()}" in rep["message"]
    assert r.closed()
    srv.policy = PeerPolicy(owner_uid=-1, allowed_uids=frozenset({os.geteuid()}), allow_root=False)
    with ServiceClient(srv.socket_path, srv.layout) as c:
        assert c.lookup([b"\x01" * 16]).num_pages == 0


def test_commit_of_unwritten_pages_is_refused(server):
    srv = server()
    lay = srv.layout
    hashes = page_hashes(list(range(3 * lay.page_size)), lay.page_size)
    with ServiceClient(srv.socket_path, lay) as c:
        pages = c.reserve(3)
        c.pool.write_page(pages[0], bytes(range(256))[:lay.page_bytes] * (lay.page_bytes // 256 + 1)
                          if lay.page_bytes > 256 else bytes(lay.page_bytes))
        # page 1: only its first plane written; page 2: untouched
        c.pool.plane_page(0, pages[1]).copy_(torch.zeros_like(c.pool.plane_page(0, pages[1])))
        with pytest.raises(ServiceError) as e:
            c.commit(hashes, pages)
        assert e.value.kind == "not_written" and f"{pages[1:]}" in str(e.value)
        assert c.lookup(hashes).num_pages == 0  # nothing committed
        for p in pages[1:]:
            c.pool.write_page(p, bytes(lay.page_bytes))
        assert c.commit(hashes, pages).inserted == 3
        c.check_integrity()


def test_repeated_refusals_are_rate_limited(server, caplog):
    srv = server()
    r = RawConn(srv.socket_path)
    r.hello(srv.layout)
    with caplog.at_level(logging.INFO, logger="hicache.node.ops"):
        for _ in range(200):
            assert r.call({"op": "explode"})["kind"] == "unknown_op"
    lines = [m for m in caplog.messages if "refused (unknown_op)" in m]
    assert 1 <= len(lines) <= 5
