"""Connections that send their request head slowly, or not at all, cannot keep the REST
API from answering (``HeadGuardedH11``), driven against a real uvicorn server built
with ``hicache serve``'s own settings (``uvicorn_config``).

Before the fix uvicorn set no timer before a request head was complete, and counted
every open connection against ``service.rest_max_connections``: that many clients
that each sent half a header held their connections forever and ``/healthz`` was
answered 503; a client sending its headers a byte at a time was served whenever it
finished. The tests assert what is answered, and what is closed, never durations.
"""
from __future__ import annotations

import select
import socket
import threading
import time

import httpx
import pytest
import uvicorn

from hicache.api.app import create_app
from hicache.api.serve import uvicorn_config
from tests.api.conftest import free_port

PARTIAL = b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Slow: "  # a head that never ends
REQUEST = b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n"


@pytest.fixture
def rest(make_state):
    """``rest(settings)``: the port of a started uvicorn server over a fresh ``RestState``."""
    servers: list[tuple[uvicorn.Server, threading.Thread]] = []

    def start(settings: dict[str, str]) -> tuple[int, uvicorn.Server]:
        port = free_port()
        st = make_state({"service.port": str(port), **settings})
        server = uvicorn.Server(uvicorn_config(create_app(st), st.config))
        t = threading.Thread(target=server.run, daemon=True)
        t.start()
        servers.append((server, t))
        for _ in range(600):
            if server.started:
                return port, server
            time.sleep(0.05)
        raise AssertionError("the REST server did not start")
    yield start
    for server, t in servers:
        server.should_exit = True
        t.join(30)


def _closed_by_server(s: socket.socket) -> bool:
    if not select.select([s], [], [], 0)[0]:
        return False
    try:
        return s.recv(1, socket.MSG_PEEK) == b""
    except ConnectionResetError:
        return True


def _response(s: socket.socket) -> bytes:
    """One whole response of ``s`` (headers and Content-Length bytes), or b"" if closed first."""
    got = b""
    while b"\r\n\r\n" not in got:
        try:
            chunk = s.recv(4096)
        except ConnectionResetError:
            return b""
        if not chunk:
            return b""
        got += chunk
    head, _, body = got.partition(b"\r\n\r\n")
    length = next(int(v) for k, _, v in (ln.partition(b":") for ln in head.split(b"\r\n")[1:])
                  if k.strip().lower() == b"content-length")
    while len(body) < length:
        body += s.recv(4096)
    return got


def test_half_sent_heads_on_every_connection_do_not_keep_healthz_from_answering(rest):
    limit = 80  # the lowest rest_max_connections allowed
    port, server = rest({"service.rest_max_connections": str(limit), "service.rest_header_timeout_s": "600"})
    slow = [socket.create_connection(("127.0.0.1", port), timeout=30) for _ in range(limit)]
    try:
        for s in slow:
            s.sendall(PARTIAL)
        # Every slow connection has reached the server: it holds it, or has closed it.
        for _ in range(600):
            closed = sum(_closed_by_server(s) for s in slow)
            if closed + len(server.server_state.connections) >= limit:
                break
            time.sleep(0.05)
        r = httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=30)
        assert r.status_code == 200 and r.json()["status"] == "ok", (r.status_code, r.text)
        assert len(server.server_state.connections) < limit // 2  # the waiting ones were capped, not counted
    finally:
        for s in slow:
            s.close()


def test_a_head_sent_a_byte_at_a_time_is_cut_and_others_are_served(rest):
    port, _ = rest({"service.rest_header_timeout_s": "0.5"})
    s = socket.create_connection(("127.0.0.1", port), timeout=30)
    try:
        s.sendall(REQUEST)  # a whole request first: the deadline also covers the next head on the connection
        assert _response(s).startswith(b"HTTP/1.1 200 ")
        head = b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"a" * 1500 + b"\r\n\r\n"  # ~30 s of bytes
        sent = 0
        for i in range(len(head)):
            if _closed_by_server(s):
                break
            try:
                s.sendall(head[i:i + 1])
            except (BrokenPipeError, ConnectionResetError):
                break
            sent += 1
            if i == 5:  # meanwhile, a client that sends its request at once is served
                r = httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=30)
                assert r.status_code == 200, r.text
            time.sleep(0.02)
        assert sent < len(head)  # closed before the head was complete...
        assert _response(s) == b""  # ...and never answered
    finally:
        s.close()
