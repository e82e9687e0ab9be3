"""The REST app over an in-memory ``ServiceView``: no engine server, socket or segment.

The routes see the node service only through ``hicache.node.snapshot.ServiceView``;
these tests build the app over ``FakeView`` (a dict of pages) and check each
route reads or changes exactly what the fake holds.
"""
from __future__ import annotations

import dataclasses

from fastapi.testclient import TestClient

from hicache.api.app import create_app
from hicache.api.deps import RestState
from hicache.node.snapshot import EMPTY, Taken
from hicache.node.snapshot import ServiceStats, ServiceView
from hicache.core.config import HiCacheConfig
from hicache.core.errors import IntegrityError, ServiceError
from hicache.core.hashing import page_hashes
from hicache.core.types import PageHash

SETTINGS = {"model.num_layers": "2", "model.num_kv_heads": "1", "model.head_dim": "4",
            "model.page_size": "4", "pool.host_pages": "16", "log_level": "WARNING"}


class FakeView:
    """L2 as a set of committed page hashes; ``serving=False`` acts like a stopped server."""

    def __init__(self, capacity: int = 16, page_bytes: int = 64):
        self.pages: set[PageHash] = set()
        self.serving = True
        self.capacity, self.page_bytes = capacity, page_bytes
        self.flushed = 0
        self.integrity_checks = 0
        self.expected: list[list[PageHash]] = []  # what ``expect`` was told, in order

    def _serving(self) -> None:
        if not self.serving:
            raise ServiceError("not_serving", "fake view stopped")

    def stats(self) -> ServiceStats:
        self._serving()
        n = len(self.pages)
        return ServiceStats(
            capacity_pages=self.capacity, page_bytes=self.page_bytes, segment_bytes=self.capacity * self.page_bytes,
            used_pages=n, free_pages=self.capacity - n, committed_pages=n, reserved_pages=0, locked_pages=0,
            lookups=0, hits=0, misses=0, evictions=0, reservations=n, commits=n, acquired=0,
            flushed=self.flushed, duplicates=0, cancelled=0, reclaimed=0, draft_cut_pages=0, draft_upgraded=0,
            segment_origin="created", clients=0, clients_total=0)

    def peek_l2(self, hashes: list[PageHash]) -> int:
        self._serving()
        n = 0
        while n < len(hashes) and hashes[n] in self.pages:
            n += 1
        return n

    def expect(self, hashes: list[PageHash]) -> int:
        self.expected.append(list(hashes))
        return self.peek_l2(hashes)

    def flush_l2(self) -> int:
        self._serving()
        n = len(self.pages)
        self.pages.clear()
        self.flushed += n
        return n

    def take_events(self) -> Taken:
        self._serving()
        return EMPTY

    def check_integrity(self) -> None:
        self.integrity_checks += 1
        if len(self.pages) > self.capacity:
            raise IntegrityError(f"{len(self.pages)} pages > capacity {self.capacity}")


def make(view: ServiceView) -> RestState:
    cfg = HiCacheConfig.load(None, SETTINGS, env={})
    return RestState(config=cfg, layout=cfg.layout(), engine=view, storage=None, admin_token="")


TOKENS = list(range(12))  # three 4-token pages


def test_lookup_reports_the_fakes_leading_pages():
    view = FakeView()
    hashes = page_hashes(TOKENS, 4)
    view.pages.update(hashes[:2])
    with TestClient(create_app(make(view))) as c:
        r = c.post("/v1/lookup", json={"tokens": TOKENS})
        by_hash = c.post("/v1/lookup", json={"hashes": [bytes(h).hex() for h in hashes[::-1]]})
    assert r.status_code == 200, r.text
    body = r.json()
    assert (body["query_pages"], body["L2"], body["L3"]) == (3, {"pages": 2, "tokens": 8}, None)
    assert body["total"] == {"pages": 2, "tokens": 8}
    assert by_hash.json()["L2"] == {"pages": 0, "tokens": 0}  # hashes[2] leads and is missing


def test_lookup_with_intent_admit_tells_the_service_and_a_peek_does_not():
    view = FakeView()
    hashes = page_hashes(TOKENS, 4)
    view.pages.update(hashes[:1])
    with TestClient(create_app(make(view))) as c:
        peek = c.post("/v1/lookup", json={"tokens": TOKENS})
        admit = c.post("/v1/lookup", json={"tokens": TOKENS, "intent": "admit"})
        bad = c.post("/v1/lookup", json={"tokens": TOKENS, "intent": "later"})
    assert peek.json()["L2"] == admit.json()["L2"] == {"pages": 1, "tokens": 4}
    assert view.expected == [list(hashes)]  # only the admit
    assert bad.status_code == 422


def test_flush_empties_the_fake_and_stats_show_it():
    view = FakeView()
    view.pages.update(page_hashes(TOKENS, 4))
    with TestClient(create_app(make(view))) as c:
        before = c.get("/v1/stats").json()
        r = c.post("/v1/flush", json={"tier": "all"})
        after = c.get("/v1/stats").json()
        metrics = c.get("/metrics").text
    assert r.json() == {"L2": 3, "L3": None}
    assert view.pages == set() and view.flushed == 3
    l2_before, l2_after = before["tiers"]["L2"], after["tiers"]["L2"]
    assert (l2_before["used_pages"], l2_after["used_pages"], l2_after["flushed"]) == (3, 0, 3)
    assert "hicache_engine_clients 0.0" in metrics


def test_readyz_follows_the_views_serving_state():
    view = FakeView()
    with TestClient(create_app(make(view))) as c:
        up = c.get("/readyz")
        view.serving = False
        down = c.get("/readyz")
    assert (up.status_code, up.json()["engine"]) == (200, True)
    assert (down.status_code, down.json()["engine"], down.json()["ready"]) == (503, False, False)


def test_check_integrity_reaches_the_view():
    view = FakeView(capacity=2)
    st = make(view)
    st.check_integrity()
    assert view.integrity_checks == 1
    view.pages.update(page_hashes(TOKENS, 4))
    try:
        st.check_integrity()
    except IntegrityError as e:
        assert "3 pages > capacity 2" in str(e)
    else:
        raise AssertionError("check_integrity missed an over-full view")


def test_engine_server_has_exactly_the_view_methods():
    # mypy checks the signatures (the end of hicache/node/server.py); this pins the names.
    from hicache.node.server import NodeServer
    names = {n for n in vars(ServiceView) if not n.startswith("_")}
    assert names == {"stats", "peek_l2", "expect", "flush_l2", "take_events", "check_integrity"}
    assert all(callable(getattr(NodeServer, n)) for n in names)
    assert {f.name for f in dataclasses.fields(ServiceStats)} >= {"capacity_pages", "clients", "l3"}
