"""One client of the engine socket cannot starve the others: per client (a peer process,
by its SO_PEERCRED pid) at most ``service.max_connections_per_client`` connections and
``service.client_page_share`` of the L2 pages reserved or acquired at once.

Before, a same-uid process could open every one of ``service.max_connections`` and
reserve every page: the next engine was refused ``busy``, or got ``out_of_pages``
for as long as the first one held on.
"""
from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from hicache.client.link import Link, ServiceClient
from hicache.core.hashing import page_hashes
from hicache.memory.allocator import PageAllocator
from hicache.node.l2_index import L2Index
from hicache.core.errors import OutOfPages, ServiceError

ROOT = Path(__file__).resolve().parents[2]

# A client that takes all it can: connections until refused, then on every connection
# one page at a time until refused; reports, then holds everything until told to go.
# Raw frames (tests.raw_socket): no torch to import, no segment to map.
HOG = textwrap.dedent("""
    import json, os, sys
    from hicache.client.protocol import hello_request
    from hicache.core.layout import KVLayout
    from tests.raw_socket import RawConn
    sock, lay = sys.argv[1], KVLayout.from_dict(json.loads(sys.argv[2]))
    conns, busy, full = [], "", ""
    while len(conns) < 64:
        c = RawConn(sock)
        try:
            c.send(hello_request(lay.to_dict(), lay.fingerprint(), os.getpid()))
        except BrokenPipeError:
            pass  # refused at once: the reason is waiting
        rep = c.recv()
        if not rep["ok"]:
            busy = f"{rep['kind']}: {rep['message']}"
            break
        conns.append(c)
    held = 0
    for c in conns:
        while True:
            rep = c.call({"op": "reserve", "n": 1})
            if not rep["ok"]:
                full = f"{rep['kind']}: {rep['message']}"
                break
            held += len(rep["pages"])
    print(json.dumps({"conns": len(conns), "pages": held, "busy": busy, "full": full}), flush=True)
    sys.stdin.readline()
""")


def test_a_client_holding_all_it_can_leaves_the_others_served(server):
    srv = server(max_connections=16, max_connections_per_client=4)  # pool: 16 pages, share 0.5 by default
    lay = srv.layout
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    hog = subprocess.Popen([sys.executable, "-c", HOG, srv.socket_path, json.dumps(lay.to_dict())], env=env,
                           stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        took = json.loads(hog.stdout.readline())
        assert (took["conns"], took["pages"]) == (4, 8), took
        assert took["busy"].startswith(f"busy: client pid {hog.pid} ") and \
            "service.max_connections_per_client=4" in took["busy"], took
        assert took["full"].startswith("out_of_pages: ") and f"client pid {hog.pid} " in took["full"] and "at most 8 of the 16" in took["full"] and \
            "service.client_page_share=0.5" in took["full"], took
        # This process is another client: it connects, and its bytes round-trip through L2.
        hashes = page_hashes(list(range(8 * lay.page_size)), lay.page_size)
        payloads = [bytes([i + 1]) * lay.page_bytes for i in range(8)]
        with ServiceClient(srv.socket_path, lay, pin=False) as c, ServiceClient(srv.socket_path, lay, pin=False):
            pages = c.reserve(8)
            for p, data in zip(pages, payloads):
                c.pool.write_page(p, data)
            assert c.commit(hashes, pages).inserted == 8
            got = c.acquire(hashes)
            assert [bytes(c.pool.read_page(p)) for p in got] == payloads
            c.release(hashes)
            srv.check_integrity()
    finally:
        hog.stdin.close()
        hog.wait(30)
    s = srv.stats()
    assert (s.reserved_pages, s.locked_pages, s.committed_pages) == (0, 0, 8)  # the hog's pages reclaimed
    srv.check_integrity()


def test_acquire_stops_at_the_share_and_reserve_is_refused_whole():
    idx = L2Index(PageAllocator(8, "L2"), client_pages=3, share_setting="service.client_page_share=0.4")
    idx.add_owner(1, "pid 10")
    idx.add_owner(2, "pid 10")  # a second connection of the same client shares its count
    idx.add_owner(3, "pid 11")
    h = page_hashes(list(range(6 * 4)), 4)
    pages = idx.reserve(3, 3)
    idx.commit(3, h[:3], pages)
    pages = idx.reserve(3, 3)
    idx.commit(3, h[3:], pages)
    assert idx.acquire(1, h[:2] + h[:1]) == idx.peek_pages(h[:2] + h[:1])  # a page acquired twice counts once
    # Counted per connection: the same page held by two connections of a client counts twice.
    assert idx.acquire(2, h) == idx.peek_pages(h[:1])  # one more page, then the share is used up
    assert idx.held_by("pid 10") == 3
    with pytest.raises(OutOfPages, match=r"client pid 10 asked for 1 pages and holds 3 .* at most 3 of the 8 "
                                         r"at once \(service.client_page_share=0.4\)"):
        idx.reserve(1, 1)
    assert idx.reserve(3, 2) and idx.held_by("pid 11") == 2  # another client is not affected
    idx.release(1, h[:1])  # still held once by owner 1: the client's count is unchanged
    assert idx.held_by("pid 10") == 3
    idx.release(1, h[:2])
    assert idx.held_by("pid 10") == 1 and len(idx.reserve(1, 2)) == 2
    idx.check_integrity()
    assert idx.drop_owner(1).reserved == 2 and idx.held_by("pid 10") == 1
    idx.check_integrity()


def test_a_refused_client_reads_why(server, monkeypatch):
    """The server refuses a connection as it accepts it, and may hang up before the hello
    is sent: the client still reports the refusal, not a broken pipe."""
    srv = server(max_connections_per_client=2)
    connect = Link._connect

    def connect_then_wait_for_the_server(self, path, timeout):
        connect(self, path, timeout)
        p = select.poll()
        p.register(self._sock, select.POLLRDHUP)
        assert p.poll(10_000), "the server neither refused nor hung up"  # before the hello is sent

    with ServiceClient(srv.socket_path, srv.layout, pin=False), ServiceClient(srv.socket_path, srv.layout, pin=False):
        monkeypatch.setattr(Link, "_connect", connect_then_wait_for_the_server)
        with pytest.raises(ServiceError) as e:
            ServiceClient(srv.socket_path, srv.layout, pin=False)
        assert e.value.kind == "busy" and "service.max_connections_per_client=2" in e.value.detail, e.value
    srv.check_integrity()
