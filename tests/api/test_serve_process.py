"""``hicache serve`` as a real process, exercised over HTTP and the engine socket."""
from __future__ import annotations

import json
import os
import threading
import time

import httpx
import torch
from prometheus_client.parser import text_string_to_metric_families

from hicache.cli import main
from hicache.client.link import ServiceClient
from hicache.core.hashing import page_hashes
from hicache.storage import open_storage

from .conftest import BASE_SETTINGS, free_port, short_dir, start_serve, stop_serve

PS = int(BASE_SETTINGS["model.page_size"])


def commit(client: ServiceClient, hashes: list[bytes]) -> None:
    pages = client.reserve(len(hashes))
    for i, p in enumerate(pages):
        client.pool.write_page(p, torch.full((client.layout.page_bytes,), i + 1, dtype=torch.uint8))
    assert client.commit(hashes, pages).inserted == len(hashes)


def metrics(c: httpx.Client) -> dict[tuple[str, tuple], float]:
    r = c.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    out = {}
    for fam in text_string_to_metric_families(r.text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_health_ready_and_initial_stats(served):
    with served.client() as c:
        assert c.get("/healthz").json() == {"status": "ok"}
        r = c.get("/readyz")
        assert r.status_code == 200
        assert r.json() == {"ready": True, "engine": True,
                            "l3": {"configured": True, "url": "memory://", "reachable": True}}
        st = c.get("/v1/stats").json()
    layout = served.config.layout()
    assert st["page_size"] == PS and st["page_bytes"] == layout.page_bytes
    assert st["fingerprint"] == layout.fingerprint()
    l2 = st["tiers"]["L2"]
    assert (l2["capacity_pages"], l2["capacity_bytes"]) == (16, 16 * layout.page_bytes)
    assert st["tiers"]["L3"]["configured"] is True and st["tiers"]["L3"]["capacity_pages"] is None


def test_lookup_agrees_with_what_an_engine_committed(served):
    layout = served.config.layout()
    tokens = list(range(100, 100 + 5 * PS + 2))  # 5 whole pages and a partial one
    hashes = page_hashes(tokens, PS)
    with served.client() as c, ServiceClient(served.socket_path, layout, pin=False) as eng:
        before = c.get("/v1/stats").json()["tiers"]["L2"]
        commit(eng, hashes[:3])
        r = c.post("/v1/lookup", json={"tokens": tokens})
        assert r.status_code == 200, r.text
        assert r.json() == {"page_size": PS, "query_pages": 5, "L2": {"pages": 3, "tokens": 12},
                            "L3": {"pages": 0, "tokens": 0}, "total": {"pages": 3, "tokens": 12},
                            "hit_tokens_exact": 12, "hit_tokens_visible": 12}
        by_hash = c.post("/v1/lookup", json={"hashes": [h.hex() for h in hashes[:4]], "include_l3": False}).json()
        assert (by_hash["L2"], by_hash["L3"], by_hash["query_pages"]) == ({"pages": 3, "tokens": 12}, None, 4)
        other_ns = c.post("/v1/lookup", json={"tokens": tokens, "namespace": "lora-7"}).json()
        assert other_ns["total"] == {"pages": 0, "tokens": 0}
        # REST lookups are read-only: engine counters moved only by the engine's own lookup.
        mid = c.get("/v1/stats").json()["tiers"]["L2"]
        assert (mid["lookups"], mid["hit_pages"]) == (before["lookups"], before["hit_pages"])
        assert eng.lookup(hashes).num_pages == 3
        after = c.get("/v1/stats").json()["tiers"]["L2"]
    assert after["lookups"] - before["lookups"] == 1
    assert (after["hit_pages"] - before["hit_pages"], after["miss_pages"] - before["miss_pages"]) == (3, 2)
    assert after["hit_tokens_exact"] - before["hit_tokens_exact"] == 3 * PS
    assert after["used_pages"] - before["used_pages"] == 3
    assert after["bytes_written"] - before["bytes_written"] == 3 * layout.page_bytes


def test_metrics_agree_with_stats(served):
    layout = served.config.layout()
    with served.client() as c, ServiceClient(served.socket_path, layout, pin=False) as eng:
        h = page_hashes(list(range(7000, 7000 + 2 * PS)), PS)
        commit(eng, h)
        assert eng.acquire(h) == eng.lookup(h).host_page_ids
        eng.release(h)
        st = c.get("/v1/stats").json()
        m = metrics(c)
    l2 = st["tiers"]["L2"]
    assert m[("hicache_used_pages", (("tier", "L2"),))] == l2["used_pages"]
    assert m[("hicache_capacity_bytes", (("tier", "L2"),))] == 16 * layout.page_bytes
    assert m[("hicache_bytes_total", (("op", "write"), ("tier", "L2")))] == l2["bytes_written"]
    assert m[("hicache_bytes_total", (("op", "read"), ("tier", "L2")))] == l2["bytes_read"] >= 2 * layout.page_bytes
    assert m[("hicache_lookup_pages_total", (("op", "hit"), ("tier", "L2")))] == l2["hit_pages"]
    assert m[("hicache_up", (("tier", "L3"),))] == 1.0
    assert ("hicache_bandwidth_bytes_per_second", (("op", "read"), ("tier", "L3"))) in m
    wb = st["tiers"]["L3"]["service"]
    assert wb["queued"] >= 2  # the two committed pages went to the L3 writer
    for op in ("queued", "written", "dropped", "stale", "failed"):
        assert m[("hicache_l3_writeback_pages_total", (("op", op),))] == wb[op], op
    assert m[("hicache_l3_write_queue_pages", ())] == wb["queue_pages"]
    assert m[("hicache_l3_fetch_pages_total", (("op", "fetched"),))] == wb["fetched"]
    eng_st = st["engine"]
    assert m[("hicache_engine_pages", (("state", "reserved"),))] == eng_st["reserved_pages"]
    assert m[("hicache_engine_pages", (("state", "locked"),))] == eng_st["locked_pages"]
    assert all(name.startswith("hicache_") for name, _ in m)


def _read_events(url: str, n: int, out: list[dict]) -> None:
    with httpx.stream("GET", url + "/v1/events", params={"max_events": n, "timeout_s": 20}, timeout=30) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: "):
                out.append(json.loads(line[6:]))


def _wait_subscribers(c: httpx.Client, n: int) -> None:
    deadline = time.monotonic() + 10
    while c.get("/v1/stats").json()["events"]["subscribers"] < n:
        assert time.monotonic() < deadline, "event subscriber did not register"
        time.sleep(0.05)


def test_events_lookup_and_flush_with_file_l3(tmp_path):
    l3_dir = tmp_path / "l3"
    s = start_serve({"storage.url": f"file://{l3_dir}"})
    try:
        layout = s.config.layout()
        tokens = list(range(500, 500 + 5 * PS))
        h = page_hashes(tokens, PS)
        # Another process (a previous run, another node) left pages 3 and 4 in L3.
        with open_storage(f"file://{l3_dir}", fingerprint=layout.fingerprint()) as l3:
            sizes = [p.page_bytes for p in layout.planes]
            assert l3.put([(k, bytes(layout.page_bytes), sizes) for k in h[3:5]]) == 2
        got: list[dict] = []
        with s.client() as c, ServiceClient(s.socket_path, layout, pin=False) as eng:
            reader = threading.Thread(target=_read_events, args=(s.url, 8, got))
            reader.start()
            _wait_subscribers(c, 1)
            commit(eng, h[:3])
            look = c.post("/v1/lookup", json={"tokens": tokens}).json()
            assert (look["L2"]["pages"], look["L3"]["pages"], look["total"]["tokens"]) == (3, 2, 5 * PS)
            # The service writes committed pages behind to L3.
            deadline = time.monotonic() + 20
            while c.get("/v1/stats").json()["tiers"]["L3"]["service"]["written"] < 3:
                assert time.monotonic() < deadline, "committed pages never reached L3"
                time.sleep(0.02)
            eng.acquire(h[:1])  # a locked page survives a flush
            r = c.post("/v1/flush", json={"tier": "all"})
            assert r.status_code == 200, r.text
            assert r.json() == {"L2": 2, "L3": 5}
            reader.join(30)
            look = c.post("/v1/lookup", json={"tokens": tokens}).json()
            assert (look["L2"]["pages"], look["L3"]["pages"]) == (1, 0)
            st = c.get("/v1/stats").json()
            eng.release(h[:1])
        assert [(e["type"], e["tier"], e["page_hash"]) for e in got] == (
            [("stored", "L2", x.hex()) for x in h[:3]] + [("stored", "L3", x.hex()) for x in h[:3]]
            + [("removed", "L2", x.hex()) for x in (h[2], h[1])])
        assert [e["parent_hash"] for e in got[:6]] == [None, h[0].hex(), h[1].hex()] * 2
        assert [e["seq"] for e in got] == sorted(e["seq"] for e in got) and all(e["dropped"] == 0 for e in got)
        assert (st["tiers"]["L2"]["flushed"], st["tiers"]["L3"]["flushed"]) == (2, 5)
        assert st["tiers"]["L3"]["service"] == {"queued": 3, "written": 3, "dropped": 0, "stale": 0, "failed": 0,
                                                "queue_pages": 0, "fetches": 0, "fetched": 0, "fetch_timeouts": 0,
                                                "fetch_busy": 0, "fetch_no_room": 0, "skipped_draft": 0}
        assert st["events"]["published"] == 8
    finally:
        stop_serve(s)


def test_readyz_503_when_redis_l3_is_down():
    port = free_port()  # nothing listens there
    s = start_serve({"storage.url": f"redis://:pw-secret@127.0.0.1:{port}/0", "storage.timeout_ms": "20",
                     "storage.max_retries": "0"})
    out = ""
    try:
        with s.client() as c:
            r = c.get("/readyz")
            assert r.status_code == 503
            assert r.json()["l3"] == {"configured": True, "url": f"redis://:***@127.0.0.1:{port}/0",
                                      "reachable": False}
            assert c.get("/healthz").status_code == 200
            look = c.post("/v1/lookup", json={"tokens": list(range(3 * PS))})
            assert look.status_code == 200 and look.json()["L3"] == {"pages": 0, "tokens": 0}
            assert c.get("/v1/stats").json()["tiers"]["L3"]["down"] is True
    finally:
        out = stop_serve(s)
    # One line on start, whatever the log level: where it listens, redacted, and how to stop it.
    line = (f"hicache serve: REST http://127.0.0.1:{s.settings['service.port']} (docs /docs), "
            f"engine socket {s.socket_path}, L2 16 pages in shared memory '{s.settings['service.shm_name']}', "
            f"L3 redis://:***@127.0.0.1:{port}/0; pid {s.proc.pid}, stop with Ctrl-C or SIGTERM")
    assert out.splitlines() == [line]


def test_serve_refuses_to_listen_beyond_loopback_without_a_token(capsys, monkeypatch):
    # The refusal happens before anything binds, so the CLI runs in-process here.
    for k in [k for k in os.environ if k.startswith("HICACHE_")]:
        monkeypatch.delenv(k)
    d = short_dir()
    rc = main(["serve", "--set", "service.host=0.0.0.0", "--set", f"service.port={free_port()}",
               "--set", f"service.socket_path={d}/h.sock", "--set", "storage.url=memory://"])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert "service.admin_token" in err and "HICACHE_SERVICE__ADMIN_TOKEN" in err
    assert not os.path.exists(f"{d}/h.sock")


def test_admin_token_from_a_file_guards_flush_and_is_never_shown(tmp_path):
    secret = tmp_path / "token"
    secret.write_text("s3cret-token-value\n")
    s = start_serve(env={"HICACHE_SERVICE__ADMIN_TOKEN_FILE": str(secret)})
    try:
        with s.client() as c:
            assert c.post("/v1/flush", json={"tier": "L2"}).status_code == 401
            bad = c.post("/v1/flush", json={"tier": "L2"}, headers={"Authorization": "Bearer nope"})
            assert bad.status_code == 401
            ok = c.post("/v1/flush", json={"tier": "L2"}, headers={"Authorization": "Bearer s3cret-token-value"})
            assert ok.status_code == 200 and ok.json() == {"L2": 0, "L3": None}
            assert c.get("/v1/config").status_code == 401  # admin whenever a token is configured
            cfg = c.get("/v1/config", headers={"Authorization": "Bearer s3cret-token-value"})
            assert cfg.status_code == 200 and "s3cret" not in cfg.text
            assert cfg.json()["config"]["service"]["admin_token_file"] == str(secret)
    finally:
        stop_serve(s)
