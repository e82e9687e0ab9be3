"""Idle connections cannot hold ``BodyGate``'s slots (issue 36, row 1).

Before the fix two connections that sent headers and a few bytes of a
1 MB body held both slots with no timeout, and every large ``/v1/lookup``
was answered 503 for as long as they stayed open. An admitted body must now
arrive within ``service.body_read_timeout_s``; the idle ones get 408 and
their slots are free again. Driven against a real uvicorn server.
"""
from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import httpx
import uvicorn

from hicache.api.app import create_app
from hicache.api.rest_guards import BodyGate

from tests.api.conftest import free_port

STALL = (b"POST /v1/lookup HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
         b"Content-Length: 1000000\r\n\r\n{\"tokens\": [1")


def _gate(app) -> BodyGate:
    stack = app.middleware_stack
    while not isinstance(stack, BodyGate):
        stack = stack.app
    return stack


def test_idle_bodies_time_out_with_408_and_free_their_slots(make_state):
    st = make_state({"service.body_read_timeout_s": "0.5"})
    port = free_port()
    app = create_app(st)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error", lifespan="on"))
    t = threading.Thread(target=server.run, daemon=True)
    t.start()
    url = f"http://127.0.0.1:{port}"
    body = json.dumps({"tokens": list(range(40_000))})
    assert len(body) > 200_000
    try:
        for _ in range(300):
            if server.started:
                break
            time.sleep(0.05)
        idle = [socket.create_connection(("127.0.0.1", port), timeout=30) for _ in range(2)]
        for s in idle:
            s.sendall(STALL)
        while _gate(app).in_flight < 2:  # both admitted and holding a slot
            time.sleep(0.01)
        answers = []
        for s in idle:
            answers.append(s.recv(4096).split(b"\r\n", 1)[0])  # blocks until the server answers
            s.close()
        assert answers == [b"HTTP/1.1 408 Request Timeout"] * 2
        for _ in range(500):  # the slot is freed just after the 408 is sent
            if _gate(app).in_flight == 0:
                break
            time.sleep(0.01)
        assert _gate(app).in_flight == 0 and _gate(app).timed_out == 2
        r = httpx.post(url + "/v1/lookup", content=body, headers={"content-type": "application/json"}, timeout=30)
        assert r.status_code == 200, r.text[:300]
        assert r.json()["query_pages"] == 40_000 // st.layout.page_size
        _gate(app).check_integrity()
    finally:
        server.should_exit = True
        t.join(30)


def test_a_body_that_arrives_in_time_is_not_cut_and_waiting_after_it_is_unbounded():
    """The deadline covers the body only: a response that waits for a disconnect is never cut."""
    async def run():
        async def app(scope, receive, send):
            got = b""
            while True:
                msg = await receive()
                got += msg.get("body", b"")
                if not msg.get("more_body"):
                    break
            waiter = asyncio.ensure_future(receive())  # a streaming response's disconnect watch
            await asyncio.sleep(0.05)
            assert not waiter.done()
            waiter.cancel()
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": got})
        gate = BodyGate(app, max_bodies=1, max_bytes=1 << 20, read_timeout_s=0.02)
        parts = [b"a" * 70_000, b"b"]

        async def receive():
            if parts:
                return {"type": "http.request", "body": parts.pop(0), "more_body": bool(parts)}
            await asyncio.Event().wait()
        sent = []

        async def send(msg):
            sent.append(msg)
        scope = {"type": "http", "method": "POST", "path": "/x", "headers": [(b"content-length", b"70001")]}
        await gate(scope, receive, send)
        assert sent[0]["status"] == 200 and sent[1]["body"] == b"a" * 70_000 + b"b"
        assert gate.in_flight == 0 and gate.timed_out == 0
    asyncio.run(run())
