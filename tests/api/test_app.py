"""The app built in-process: admin auth by bind address, redaction, schema fuzzing, the event bus."""
from __future__ import annotations

import asyncio
import json

import pytest
import schemathesis
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings

from hicache.api.deps import check_bind, is_loopback
from hicache.api.events import EventBus
from hicache.core.redact import redact_url
from hicache.api.serve import resolve_admin_token
from hicache.api.stats import RateTracker
from hicache.core.config import HiCacheConfig
from hicache.core.errors import ConfigError
from hicache.core.hashing import page_hashes
from hicache.node.snapshot import EventKind, EventLog

TOKEN = "tok-1234567890abcdef"


@pytest.mark.parametrize("host,loop", [("127.0.0.1", True), ("localhost", True), ("::1", True),
                                       ("127.0.0.2", True), ("0.0.0.0", False), ("::", False),
                                       ("10.1.2.3", False), ("hicache.internal", False)])
def test_is_loopback(host, loop):
    assert is_loopback(host) is loop


def test_non_loopback_bind_without_token_is_refused(make_state, app_of):
    st = make_state({"service.host": "0.0.0.0"})
    with pytest.raises(ConfigError, match="service.admin_token.*HICACHE_SERVICE__ADMIN_TOKEN"):
        app_of(st)
    check_bind("127.0.0.1", "")  # loopback needs none


@pytest.mark.parametrize("host", ["0.0.0.0", "10.0.0.7"])
def test_flush_needs_the_token_beyond_loopback(make_state, app_of, host):
    st = make_state({"service.host": host}, admin_token=TOKEN)
    with TestClient(app_of(st)) as c:
        assert c.post("/v1/flush", json={"tier": "L2"}).status_code == 401
        r = c.post("/v1/flush", json={"tier": "L2"}, headers={"Authorization": "Bearer tok-12"})
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
        r = c.post("/v1/flush", json={"tier": "all"}, headers={"Authorization": f"Bearer {TOKEN}"})
        assert r.status_code == 200 and r.json() == {"L2": 0, "L3": 0}
        assert c.get("/v1/config").status_code == 401  # admin whenever a token is configured
        cfg = c.get("/v1/config", headers={"Authorization": f"Bearer {TOKEN}"})
        assert cfg.status_code == 200 and TOKEN not in cfg.text
        assert cfg.json()["config"]["service"]["admin_token"] == "***"


def test_flush_on_loopback_without_a_token(make_state, app_of):
    st = make_state()
    with TestClient(app_of(st)) as c:
        assert c.post("/v1/flush", json={"tier": "L3"}).json() == {"L2": None, "L3": 0}


def test_config_redacts_storage_password(make_state, app_of):
    st = make_state({"storage.url": "memory://"})
    assert redact_url("redis://user:pw@h:6379/0") == "redis://user:***@h:6379/0"
    assert redact_url("redis+cluster://:pw@a:1,b:2") == "redis+cluster://:***@a:1,b:2"
    assert redact_url("file:///x@y") == "file:///x@y"
    with TestClient(app_of(st)) as c:
        body = c.get("/v1/config").json()
    assert body["fingerprint"] == st.layout.fingerprint() and body["page_bytes"] == st.layout.page_bytes


def test_query_string_password_is_redacted_everywhere_the_url_is_shown(make_state, app_of):
    # redis-py reads ?password= from the query string as readily as user:pw@.
    assert redact_url("redis://h:6379/0?password=pw") == "redis://h:6379/0?password=***"
    assert redact_url("rediss://u:pw@h/0?ssl_password=k&db=1") == "rediss://u:***@h/0?ssl_password=***&db=1"
    st = make_state({"storage.url": "redis://127.0.0.1:1/0?password=s3cret-pw"})
    with TestClient(app_of(st)) as c:
        cfg, ready = c.get("/v1/config"), c.get("/readyz")
    assert cfg.json()["config"]["storage"]["url"] == "redis://127.0.0.1:1/0?password=***"
    assert ready.json()["l3"]["url"] == "redis://127.0.0.1:1/0?password=***"
    assert "s3cret-pw" not in cfg.text + ready.text


def test_admin_token_file_resolution(tmp_path):
    f = tmp_path / "t"
    f.write_text("  abc\n")
    cfg = HiCacheConfig.load(None, {"service.admin_token_file": str(f)}, env={})
    assert resolve_admin_token(cfg) == "abc"
    explicit = HiCacheConfig.load(None, {"service.admin_token_file": str(f), "service.admin_token": "x"}, env={})
    assert resolve_admin_token(explicit) == "x"
    f.write_text("\n")
    with pytest.raises(ConfigError, match="is empty"):
        resolve_admin_token(cfg)
    missing = HiCacheConfig.load(None, {"service.admin_token_file": str(tmp_path / "nope")}, env={})
    with pytest.raises(ConfigError, match="cannot be read"):
        resolve_admin_token(missing)


def test_every_route_documents_its_response(make_state, app_of):
    schema = app_of(make_state()).openapi()
    for path, ops in schema["paths"].items():
        for method, op in ops.items():
            ok = op["responses"]["200"]["content"]
            assert all("schema" in v and v["schema"] for v in ok.values()), (method, path, ok)
    assert "text/event-stream" in schema["paths"]["/v1/events"]["get"]["responses"]["200"]["content"]
    assert "bearer" in str(schema["paths"]["/v1/flush"]["post"].get("security", "")).lower() or \
        "HTTPBearer" in str(schema["paths"]["/v1/flush"]["post"])


def test_fuzzed_requests_never_get_a_server_error(make_state, app_of):
    # Driven through Hypothesis directly: schemathesis' pytest plugin does not load with this pytest.
    schema = schemathesis.openapi.from_asgi("/openapi.json", app_of(make_state(admin_token=TOKEN)))
    fuzzed = []
    for result in schema.get_all_operations():
        op = result.ok()
        if op.path == "/v1/events":  # streams until the client leaves; the process tests cover it
            continue
        fuzzed.append(f"{op.method.upper()} {op.path}")

        @given(case=op.as_strategy())
        @settings(max_examples=25, deadline=None, database=None, suppress_health_check=list(HealthCheck))
        def check(case):
            case.call_and_validate(headers={"Authorization": f"Bearer {TOKEN}"})
        check()
    assert sorted(fuzzed) == ["GET /healthz", "GET /metrics", "GET /readyz", "GET /v1/config",
                              "GET /v1/stats", "POST /v1/flush", "POST /v1/lookup"]


def test_event_bus_bounds_each_subscriber_and_counts_drops():
    bus = EventBus()
    h = page_hashes(list(range(5 * 4)), 4)

    async def run():
        small, big = bus.subscribe(2), bus.subscribe(10)
        log = EventLog(16)  # as the service records them; the app's pump publishes each take
        log.record(EventKind.STORED, "L2", zip(h, [None, *h[:-1]]))
        log.record(EventKind.REMOVED, "L2", [(h[0], None)])
        bus.publish(log.take())
        bus.check_integrity()
        a = await bus.next_batch(small, 0.1)
        b = await bus.next_batch(big, 0.1)
        bus.close()
        return a, b, await bus.next_batch(big, 0.1)

    (ev_s, dropped_s), (ev_b, dropped_b), end = asyncio.run(run())
    assert [e.seq for e in ev_s] == [1, 2] and dropped_s == 4
    assert [(e.type, e.page_hash) for e in ev_b] == [("stored", x) for x in h] + [("removed", h[0])]
    assert ev_b[1].parent_hash == h[0] and ev_b[0].parent_hash is None and dropped_b == 0
    assert end is None
    assert (bus.published, bus.dropped) == (6, 4)


def test_events_the_service_dropped_reach_every_subscriber_as_dropped():
    bus = EventBus()
    h = page_hashes(list(range(3 * 4)), 4)

    async def run():
        sub = bus.subscribe(10)
        log = EventLog(2)  # the service's log is full after two events: the third is dropped
        log.record(EventKind.STORED, "L2", zip(h, [None, *h[:-1]]))
        taken = log.take()
        log.check_integrity()
        bus.publish(taken)
        got = await bus.next_batch(sub, 0.1)
        bus.close()
        return taken, got

    taken, (events, dropped) = asyncio.run(run())
    assert (len(taken.events), taken.dropped) == (2, 1)
    assert [e.page_hash for e in events] == h[:2] and dropped == 1
    assert (bus.published, bus.dropped) == (2, 1)
    bus.check_integrity()


def test_rate_tracker_uses_a_sliding_window():
    now = [100.0]
    r = RateTracker(window_s=10.0, clock=lambda: now[0])
    assert r.sample({"x": 0}) == {"x": 0.0}
    now[0] = 102.0
    assert r.sample({"x": 200}) == {"x": 100.0}
    now[0] = 112.0  # the first sample falls out of the window; the 102 s one stays as its start
    assert r.sample({"x": 1200}) == {"x": 100.0}
    now[0] = 130.0
    assert r.sample({"x": 1200}) == {"x": 0.0}
    r.check_integrity()


def test_docs_page_loads_every_asset_from_this_server(make_state, app_of):
    """/docs works offline: the Swagger UI page references only this app's own
    URLs, and each one is served with the file the package ships."""
    import os
    import re

    from hicache.api.app import swagger_ui_dir
    with TestClient(app_of(make_state())) as c:
        page = c.get("/docs")
        assert page.status_code == 200 and "SwaggerUIBundle" in page.text
        refs = re.findall(r"""(?:src|href)=["']([^"']+)["']|url:\s*'([^']+)'""", page.text)
        urls = [a or b for a, b in refs]
        assert urls and all(u.startswith("/") for u in urls), urls  # nothing from a CDN
        for u in urls:
            r = c.get(u)
            assert r.status_code == 200, u
            if u.startswith("/docs/assets/"):
                with open(os.path.join(swagger_ui_dir(), u.rsplit("/", 1)[1]), "rb") as f:
                    assert r.content == f.read()
        assert c.get("/openapi.json").json()["info"]["title"] == "hicache"
        assert c.get("/redoc").status_code == 404  # it would load from a CDN; /docs is the UI


def test_lookup_with_intent_admit_keeps_l2_pages_and_starts_an_l3_fetch(make_state, app_of):
    import time
    from hicache.node.server import NodeServer, open_l3
    st = make_state()
    st.engine.stop()  # this test's service reads through to the L3 the routes see
    eng = NodeServer(st.config, st.layout, storage=open_l3(st.config, st.layout))
    eng.start()
    st.engine = eng
    toks = {k: list(range(1000 * k, 1000 * k + 16)) for k in range(4)}  # four prompts of 4 pages
    hs = {k: page_hashes(t, 4) for k, t in toks.items()}

    def commit(k: int) -> None:
        idx = eng._serving()
        pages = idx.reserve(-7, 4)
        idx.commit(-7, hs[k], pages)

    eng._on_loop(lambda: eng._serving().add_owner(-7))
    for k in range(3):  # 12 of 16 pages, prompt 0 the least recently used
        eng._on_loop(lambda k=k: commit(k))
    with TestClient(app_of(st)) as c:
        r = c.post("/v1/lookup", json={"tokens": toks[0], "intent": "admit"})
        assert r.json()["L2"] == {"pages": 4, "tokens": 16}
        eng._on_loop(lambda: eng._serving().reserve(-7, 8))  # 4 free: 4 pages evicted, LRU first
        assert eng.peek_l2(hs[0]) == 4 and eng.peek_l2(hs[1]) == 0  # prompt 1 went, not prompt 0
        before = eng.stats().l3.get("fetches", 0)
        c.post("/v1/lookup", json={"tokens": toks[3], "intent": "admit"})  # not in L2: L3 is asked
        for _ in range(200):
            if eng.stats().l3.get("fetches", 0) > before:
                break
            time.sleep(0.01)
        assert eng.stats().l3["fetches"] == before + 1
        eng.check_integrity()


def _published(bus: EventBus, n: int) -> None:
    log = EventLog(n)
    h = page_hashes(list(range(4 * n)), 4)
    log.record(EventKind.STORED, "L2", zip(h, [None, *h[:-1]]))
    bus.publish(log.take())


def test_event_subscribers_are_bounded_in_number_and_formatted_once():
    """300 subscribers that never read took the service from 527 MiB to 2.5 GiB and
    /healthz unanswered for minutes: every event was formatted once per subscriber and a
    batch of 65,536 written in one piece. Now: at most max_subscribers, one text per event."""
    from hicache.api.events import SubscribersFull, sse_text
    bus = EventBus(max_subscribers=8)

    async def run():
        subs = [bus.subscribe(4096) for _ in range(8)]
        with pytest.raises(SubscribersFull, match="8 event streams are open"):
            bus.subscribe(10)
        _published(bus, 300)
        got = [await bus.next_batch(s, 0.1) for s in subs]
        bus.unsubscribe(subs[0])
        bus.subscribe(10)  # a slot freed is taken again
        bus.check_integrity()
        bus.close()
        return got

    got = asyncio.run(run())
    texts = {id(e.sse) for events, _ in got for e in events}
    assert len(texts) == 300 and all(len(events) == 300 for events, _ in got)  # 300 texts for 8 x 300 deliveries
    first = got[0][0][0]
    line = sse_text(first, 7)
    assert line.startswith(f"id: {first.seq}\nevent: stored\ndata: ") and line.endswith(',"dropped":7}\n\n')
    assert json.loads(line.split("data: ", 1)[1]) == {
        "seq": first.seq, "type": "stored", "tier": "L2", "page_hash": first.page_hash.hex(), "parent_hash": None,
        "dropped": 7}


def test_a_full_event_service_answers_503_and_stays_responsive(make_state, app_of):
    st = make_state()
    st.bus.max_subscribers = 0
    with TestClient(app_of(st)) as client:
        r = client.get("/v1/events", params={"max_events": 1})
        assert r.status_code == 503 and r.headers["retry-after"] == "5" and "event streams are open" in r.text
        assert client.get("/healthz").status_code == 200


def test_a_client_that_takes_no_bytes_is_dropped_and_unsubscribed():
    """A send that waits past send_timeout_s (a client whose socket buffer is full) ends
    the stream and frees its subscription; the chunks written are at most CHUNK_EVENTS events."""
    from hicache.api import routes
    bus = EventBus()
    sent: list[dict] = []

    async def run():
        sub = bus.subscribe(4096)
        _published(bus, 600)
        stuck = asyncio.Event()

        async def send(msg):
            sent.append(msg)
            if len(sent) >= 3:  # start, the stream's opening comment, then it stops reading
                await stuck.wait()
        resp = routes.EventStreamResponse(routes._stream(bus, sub, None, None), send_timeout_s=0.05)
        await resp.stream_response(send)
        return bus.num_subscribers

    assert asyncio.run(run()) == 0
    chunk = sent[2]["body"].decode()
    assert chunk.count("\nevent: stored\n") == routes.CHUNK_EVENTS


def test_the_rest_server_caps_its_connections_above_the_event_streams():
    """uvicorn had no cap: any number of connections (and of slow clients) was served."""
    from hicache.api.events import MAX_SUBSCRIBERS
    from hicache.api.serve import KEEP_ALIVE_S, uvicorn_config
    cfg = HiCacheConfig.load(None, {"service.rest_max_connections": "200"}, env={})
    c = uvicorn_config(object(), cfg)
    assert (c.limit_concurrency, c.timeout_keep_alive) == (200, KEEP_ALIVE_S)
    assert HiCacheConfig.load(None, {}, env={}).service.rest_max_connections > MAX_SUBSCRIBERS
    with pytest.raises(ConfigError, match="rest_max_connections"):
        HiCacheConfig.load(None, {"service.rest_max_connections": "10"}, env={})
