"""Concurrent large REST bodies never stall the REST loop (issue 27, item 3).

Before the fix ten 8 MiB lookup bodies, each just under the size limit,
were all buffered, JSON-decoded and validated on the event loop (answered
422 for holding more than 1M tokens): ``/healthz`` did not answer for 5.8 s
and RSS grew by 214 MB. ``BodyGate`` admits ``service.max_body_requests``
bodies at once (503 beyond, before reading them) and refuses a lookup body
with more items than a lookup may carry from a count of its commas. The
tests drive the ASGI middleware directly and check admissions and order,
not time.
"""
from __future__ import annotations

import asyncio
import json

import pytest
from fastapi.testclient import TestClient

from hicache.api.app import create_app
from hicache.api.rest_guards import MIN_FAST_BYTES, split_tokens
from hicache.api.models import LOOKUP_MAX_ITEMS, MAX_LOOKUP_TOKENS
from hicache.api.rest_guards import BodyGate
from hicache.core.hashing import page_hashes

MiB8 = 8 << 20


def _scope(path: str, length: int | None, method: str = "POST") -> dict:
    headers = [] if length is None else [(b"content-length", str(length).encode())]
    return {"type": "http", "method": method, "path": path, "headers": headers}


class _App:
    """Reads the whole body, then waits for ``release`` before answering 200."""

    def __init__(self):
        self.release = asyncio.Event()
        self.bodies: list[int] = []  # bytes read, per call
        self.order: list[str] = []

    async def __call__(self, scope, receive, send):
        n = 0
        while True:
            msg = await receive()
            n += len(msg.get("body", b""))
            if not msg.get("more_body"):
                break
        self.bodies.append(n)
        if scope["path"] != "/healthz":
            await self.release.wait()
        self.order.append(scope["path"])
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})


async def _call(gate, scope, body: bytes, reads: list[int]) -> int:
    sent = False

    async def receive():
        nonlocal sent
        if sent:
            await asyncio.Event().wait()  # a client that sends nothing more
        sent = True
        reads.append(len(body))
        return {"type": "http.request", "body": body, "more_body": False}
    status = []

    async def send(msg):
        if msg["type"] == "http.response.start":
            status.append(msg["status"])
    await gate(scope, receive, send)
    return status[0]


def test_bodies_beyond_the_limit_get_503_unread_and_health_still_answers():
    async def run():
        app = _App()
        gate = BodyGate(app, max_bodies=2, max_bytes=MiB8, max_waiting=0)  # no queue: refused at once
        reads: list[int] = []
        body = b"x" * 1024  # stands for an 8 MiB body: only the declared length matters to the gate
        held = [asyncio.create_task(_call(gate, _scope("/v1/lookup", MiB8), body, reads)) for _ in range(2)]
        await asyncio.sleep(0)  # let both be admitted and park in the app
        while len(app.bodies) < 2:
            await asyncio.sleep(0)
        flood = [await _call(gate, _scope("/v1/lookup", MiB8), body, reads) for _ in range(8)]
        assert flood == [503] * 8 and len(reads) == 2  # refused without reading a byte of their bodies
        assert await _call(gate, _scope("/healthz", None, "GET"), b"", reads) == 200
        assert app.order == ["/healthz"]  # answered while both admitted bodies are still held
        small = [asyncio.create_task(_call(gate, _scope("/v1/stats", 100), b"s" * 100, reads)) for _ in range(10)]
        while len(app.bodies) < 12:  # a router's small lookups are never gated: all ten reach the app
            await asyncio.sleep(0)
        assert gate.in_flight == 2
        gate.check_integrity()
        assert (gate.in_flight, gate.admitted, gate.refused) == (2, 2, 8)
        app.release.set()
        assert await asyncio.gather(*held) == [200, 200] and await asyncio.gather(*small) == [200] * 10
        assert gate.in_flight == 0
        assert await _call(gate, _scope("/v1/lookup", MiB8), b"x" * 10, reads) == 200  # capacity is back
        gate.check_integrity()
    asyncio.run(run())


def test_lookup_with_more_items_than_allowed_is_refused_unparsed(make_state):
    st = make_state()
    body = '{"tokens": [' + ",".join(["7"] * (LOOKUP_MAX_ITEMS + 1)) + "]}"
    assert len(body) < st.config.service.max_request_bytes  # under the size limit: the old path parsed it
    with TestClient(create_app(st)) as c:
        r = c.post("/v1/lookup", content=body, headers={"content-type": "application/json"})
        assert r.status_code == 413, r.text[:300]
        assert f"at most {LOOKUP_MAX_ITEMS}" in r.json()["detail"] and "7,7" not in r.text
        ok = c.post("/v1/lookup", content=json.dumps({"tokens": list(range(64)), "namespace": "a,b,c"}),
                    headers={"content-type": "application/json"})
        assert ok.status_code == 200 and ok.json()["query_pages"] == 64 // st.layout.page_size
    assert MAX_LOOKUP_TOKENS < LOOKUP_MAX_ITEMS


@pytest.mark.parametrize("tokens,split", [
    (b"[1, 2,3]", [1, 2, 3]), (b"[ ]", []), (b"[4294967295, 0]", [4294967295, 0]),
    (b"[1, -2]", None), (b"[1,,2]", None), (b"[1, ,2]", None), (b"[1 2]", None), (b"[,1]", None), (b"[1,]", None),
    (b"[4294967296]", None), (b"[1.5]", None), (b"[99999999999999999999999]", None), (b'["1"]', None),
])
def test_split_tokens_takes_only_what_json_and_the_model_accept(tokens, split):
    got = split_tokens(b'{"tokens": ' + tokens + b', "namespace": "a,b"}')
    if split is None:
        assert got is None
    else:
        assert got == (b'{"tokens": [], "namespace": "a,b"}', split)


def test_big_lookup_read_off_the_loop_answers_as_the_usual_path(make_state):
    """A body over MIN_FAST_BYTES takes the split path; its answer equals a small body's for the same pages."""
    st = make_state()
    ps = st.layout.page_size
    toks = [i * 7919 % 50_000 for i in range(40_000)]
    body = json.dumps({"tokens": toks, "namespace": "ns"}).encode()
    assert len(body) >= MIN_FAST_BYTES and split_tokens(body) is not None
    want = page_hashes(toks, ps, namespace="ns")
    with TestClient(create_app(st)) as c:
        big = c.post("/v1/lookup", content=body, headers={"content-type": "application/json"})
        by_hash = c.post("/v1/lookup", json={"hashes": [h.hex() for h in want[:64]]})
        bad = c.post("/v1/lookup", content=body.replace(b"[", b"[-1, ", 1), headers={"content-type": "application/json"})
    assert big.status_code == 200 and big.json()["query_pages"] == len(want) == len(toks) // ps
    assert by_hash.json()["query_pages"] == 64
    assert bad.status_code == 422 and "tokens" in bad.json()["detail"][0]["loc"], bad.text[:300]


def test_a_client_that_reopens_after_each_408_cannot_hold_every_slot():
    """Two connections that trickle nothing and reopen after each 408 kept every large
    /v1/lookup at 503 (35 of 35 over 40 s). Now a waiting request takes the next freed
    slot (the reopened connection queues behind it), and clients are served by the
    fewest slots held: every lookup from another client is answered 200."""
    async def run():
        app = _App()
        app.release.set()
        # A fair request waits for a slot up to 2 x the read timeout: 0.5 s keeps a loaded
        # machine's loop stalls (xdist workers beside a CPU hog) from timing it out.
        gate = BodyGate(app, max_bodies=2, max_bytes=MiB8, read_timeout_s=0.5)
        stop = asyncio.Event()
        attacker = {**_scope("/v1/lookup", MiB8), "client": ("10.0.0.66", 1)}
        codes: list[int] = []
        hogs = [asyncio.create_task(_hog_forever(gate, attacker, stop, codes)) for _ in range(2)]
        while gate.in_flight < 2:
            await asyncio.sleep(0)
        fair = []
        for i in range(5):
            scope = {**_scope("/v1/lookup", MiB8), "client": ("10.0.0.7", 100 + i)}
            fair.append(await _call(gate, scope, b"x" * 100, []))
        stop.set()
        await asyncio.gather(*hogs)
        gate.check_integrity()
        return fair, codes, gate

    fair, codes, gate = asyncio.run(run())
    assert fair == [200] * 5 and set(codes) == {408} and gate.in_flight == 0


async def _hog_forever(gate, scope, stop, codes):
    async def receive():
        await asyncio.Event().wait()  # headers sent, body never
    while not stop.is_set():
        sent = []

        async def send(msg):
            sent.append(msg)
        await gate(scope, receive, send)
        codes.append(sent[0]["status"])


def test_a_waiter_that_leaves_gives_back_its_place_and_any_slot_handed_to_it():
    async def run():
        app = _App()
        gate = BodyGate(app, max_bodies=1, max_bytes=MiB8, read_timeout_s=5)
        held = asyncio.create_task(_call(gate, _scope("/v1/lookup", MiB8), b"x", []))
        while gate.in_flight < 1 or not app.bodies:
            await asyncio.sleep(0)
        waiter = asyncio.create_task(_call(gate, _scope("/v1/lookup", MiB8), b"y", []))
        while not gate._waiting:
            await asyncio.sleep(0)
        app.release.set()  # the held one answers: its slot is handed to the waiter...
        await held
        waiter.cancel()  # ...which leaves before it runs
        with pytest.raises(asyncio.CancelledError):
            await waiter
        gate.check_integrity()
        return gate.in_flight, gate._waiting
    assert asyncio.run(run()) == (0, [])
