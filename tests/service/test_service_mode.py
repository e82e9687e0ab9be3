"""``HiCache`` in service mode (``storage.url = hicache+unix://``): its L2 is the
node service's shared segment. Value-level checks of backup / load back
through the segment, draft validity, write-back, a service outage and
restart, and the configuration errors. Two ``HiCache`` instances in one
process stand for two engines (the two-process proof is ``test_shared_l2.py``)."""
from __future__ import annotations

import tempfile
import uuid
from pathlib import Path

import pytest
import torch

from hicache.node.server import NodeServer, open_l3
from hicache.core.config import HiCacheConfig
from hicache.core.errors import ConfigError
from hicache.cache.hicache import HiCache
from hicache.core.layout import KVLayout

PS = 4
LAYOUT = KVLayout("svc-mode", num_layers=2, num_kv_heads=1, head_dim=4, dtype="float32", page_size=PS,
                  host_layout="page_first", draft_layers=1)


def value(token: int, plane: int) -> float:
    return float(token * 10 + plane)


class Node:
    """One in-process service; ``restart`` stops it and starts a new one on the same socket."""

    def __init__(self, host_pages: int = 64, l3: str = ""):
        self.l3 = l3  # the service's own L3 ("" = none)
        self.dir = Path(tempfile.mkdtemp(prefix="hcm", dir="/tmp"))
        self.sock = str(self.dir / "s.sock")
        self.host_pages = host_pages
        self.srv = self._start()

    def _start(self) -> NodeServer:
        cfg = HiCacheConfig.load(env={}, overrides={
            "service.socket_path": self.sock, "service.shm_name": f"hicache-test-{uuid.uuid4().hex[:10]}",
            "pool.host_pages": str(self.host_pages), "storage.url": self.l3})
        self.storage = open_l3(cfg, LAYOUT)
        srv = NodeServer(cfg, LAYOUT, storage=self.storage)
        srv.start()
        return srv

    def restart(self) -> None:
        self.stop()
        self.srv = self._start()

    def stop(self) -> None:
        if self.srv is not None:
            self.srv.stop()
            self.srv = None
            if self.storage is not None:
                self.storage.close()

    def engine(self, **overrides) -> HiCache:
        o = {"storage.url": f"hicache+unix://{self.sock}", "pool.device": "cpu", "pool.device_pages": "32",
             "policy.write_policy": "write_through", "policy.prefetch_policy": "wait_complete"}
        o.update({k: str(v) for k, v in overrides.items()})
        return HiCache(HiCacheConfig.load(env={}, overrides=o), layout=LAYOUT)


@pytest.fixture
def node():
    n = Node()
    yield n
    n.stop()


def compute(hc: HiCache, req, *, draft: bool = True) -> None:
    """'Compute' the rest of ``req``: write token-derived values (draft planes only
    when the request runs the draft head), commit."""
    start = req.computed_tokens
    req.alloc(req.num_tokens - req.allocated_tokens)
    slots = hc.device_pool.slot_ids(req.pages)
    for i, (spec, buf) in enumerate(zip(hc.layout.planes, hc.device_pool.buffers)):
        if spec.draft and not draft:
            continue
        for pos in range(start, req.num_tokens):
            buf[int(slots[pos])] = value(req.tokens[pos], i)
    req.commit()


def values_ok(hc: HiCache, req, *, draft: bool = True) -> bool:
    slots = hc.device_pool.slot_ids(req.pages)
    return all(bool(torch.all(buf[int(slots[pos])] == value(req.tokens[pos], i)))
               for i, (spec, buf) in enumerate(zip(hc.layout.planes, hc.device_pool.buffers))
               if draft or not spec.draft
               for pos in range(req.computed_tokens))


def serve(hc: HiCache, rid: str, prompt: list[int], *, draft: bool = True) -> tuple[int, int, bool]:
    """(hit tokens, of which from the shared L2, values of the hit correct)."""
    req = hc.new_request(rid, prompt, draft=draft)
    adm = hc.admit(req)
    adm.wait()
    ok = values_ok(hc, req, draft=draft)
    compute(hc, req, draft=draft)
    req.finish()
    hc.drain()
    hc.check_integrity()
    return adm.hit_tokens, adm.host_tokens, ok


PROMPT = list(range(50, 50 + 5 * PS + 1))  # 5 whole pages + 1 token


def test_engines_share_pages_through_the_segment_by_value(node):
    a, b = node.engine(), node.engine()
    try:
        assert a.host_pool is a.shared.pool and a.private_host_bytes == 0
        assert a.stats().capacity_pages["L2"] == node.host_pages
        assert serve(a, "a", PROMPT) == (0, 0, True)
        assert a.stats().tiers.backup_pages == 5
        # B (scattered L1 pages) loads A's pages from the segment: every plane, every row.
        serve(b, "pre", list(range(2000, 2000 + 5 * PS + 1)))  # B's first L1 pages are taken
        assert serve(b, "b", PROMPT) == (5 * PS, 5 * PS, True)
        st = b.stats()
        assert (st.tiers.load_back_pages, st.tiers.backup_pages, st.bytes_moved["h2d"]) == (
            5, 5, 5 * LAYOUT.page_bytes)
        # A longer prompt: the shared prefix comes from the segment, the rest is computed and shared.
        longer = PROMPT[:-1] + list(range(900, 900 + 3 * PS + 1))
        b.evict(10**6)
        assert serve(b, "b2", longer) == (5 * PS, 5 * PS, True)
        assert b.stats().tiers.backup_pages == 5 + 3
        s = node.srv.stats()
        assert (s.committed_pages, s.locked_pages, s.reserved_pages) == (13, 0, 0)
        node.srv.check_integrity()
    finally:
        a.close()
        b.close()


def test_pages_without_draft_rows_are_no_hit_for_a_draft_request(node):
    a, b = node.engine(), node.engine()
    try:
        serve(a, "a", PROMPT, draft=False)  # A does not run the draft head: target rows only
        assert serve(b, "b", PROMPT) == (0, 0, True)  # a draft request: no draft-complete page
        b.evict(10**6)
        assert serve(b, "b2", PROMPT, draft=False)[:2] == (5 * PS, 5 * PS)
        # B's draft request computed complete pages meanwhile and upgraded the shared ones.
        c = node.engine()
        try:
            assert serve(c, "c", PROMPT) == (5 * PS, 5 * PS, True)
        finally:
            c.close()
        assert node.srv.stats().draft_upgraded == 5
    finally:
        a.close()
        b.close()


def test_write_back_shares_eviction_victims_before_their_l1_pages_go(node):
    a = node.engine(**{"policy.write_policy": "write_back", "pool.device_pages": 8})
    b = node.engine()
    try:
        serve(a, "a", PROMPT)
        assert a.stats().tiers.backup_pages == 0  # write-back: nothing shared yet
        serve(a, "a2", list(range(700, 700 + 6 * PS + 1)))  # needs A's L1 pages: evicts, sharing first
        assert a.stats().tiers.backup_pages >= 5
        assert serve(b, "b", PROMPT) == (5 * PS, 5 * PS, True)
    finally:
        a.close()
        b.close()


def test_an_outage_is_a_miss_and_the_engine_reconnects_after_a_restart(node, caplog):
    a = node.engine()
    try:
        serve(a, "a", PROMPT)
        node.restart()  # a new segment, empty; A's mapping of the old one is stale
        a.evict(10**6)
        with caplog.at_level("WARNING"):
            assert serve(a, "a2", PROMPT)[:2] == (0, 0)  # no exception: a miss, backups dropped
        assert a.shared.down and a.shared.outages == 1
        assert sum("unreachable" in r.message for r in caplog.records) == 1
        a.shared._down_since -= 5  # (the reconnect backoff has passed)
        a.evict(10**6)
        serve(a, "a3", PROMPT)  # reconnects, maps the new segment; the pages are not there: computed, shared
        assert not a.shared.down and a.shared.reconnects == 1 and a.host_pool is a.shared.pool
        b = node.engine()
        try:
            assert serve(b, "b", PROMPT) == (5 * PS, 5 * PS, True)
        finally:
            b.close()
    finally:
        a.close()


def test_pages_in_the_services_l3_are_fetched_into_the_segment_and_loaded(tmp_path):
    """After a service restart its L2 is empty; what it wrote behind to its L3 comes
    back on admission (fetch into the segment, acquire, kernel load), by value."""
    import time
    n = Node(l3=f"file://{tmp_path}/l3")
    try:
        a = n.engine()
        serve(a, "a", PROMPT)
        a.close()
        deadline = time.monotonic() + 30
        while n.srv.stats().l3["written"] < 5:
            assert time.monotonic() < deadline, "the service never wrote the pages to its L3"
            time.sleep(0.01)
        n.restart()
        assert n.srv.stats().committed_pages == 0
        b = n.engine()
        try:
            req = b.new_request("b", PROMPT)
            adm = b.admit(req)
            adm.wait()
            assert (adm.hit_tokens, adm.host_tokens, adm.storage_tokens) == (5 * PS, 5 * PS, 5 * PS)
            assert values_ok(b, req)
            compute(b, req)
            req.finish()
            b.drain()
            b.check_integrity()
        finally:
            b.close()
        assert (n.srv.stats().locked_pages, n.srv.stats().reserved_pages) == (0, 0)
    finally:
        n.stop()


def test_configuration_errors_name_the_socket_and_the_setting():
    sock = f"/tmp/hcm-none-{uuid.uuid4().hex[:6]}.sock"
    cfg = HiCacheConfig.load(env={}, overrides={"storage.url": f"hicache+unix://{sock}", "pool.device": "cpu"})
    with pytest.raises(ConfigError, match=f"no hicache service answers there.*{sock}|{sock}.*no hicache service"):
        HiCache(cfg, layout=LAYOUT)
    cp = KVLayout("svc-mode", num_layers=2, num_kv_heads=1, head_dim=4, dtype="float32", page_size=PS,
                  host_layout="page_first", cp_size=2)
    with pytest.raises(ConfigError, match="cp_size=2"):
        HiCache(cfg, layout=cp)
    bad = HiCacheConfig.load(env={}, overrides={"storage.url": "hicache+unix://relative.sock", "pool.device": "cpu"})
    with pytest.raises(ConfigError, match="absolute"):
        HiCache(bad, layout=LAYOUT)


def _ops_of_a_miss(hc: HiCache, monkeypatch, prompt: list[int]) -> list[str]:
    """The socket ops one admission of a prompt nobody shared sends to the service."""
    calls: list[str] = []
    real = hc.shared.client._call
    monkeypatch.setattr(hc.shared.client, "_call", lambda req: (calls.append(req["op"]), real(req))[1])
    req = hc.new_request("miss", prompt)
    hc.admit(req)
    req.abort()
    monkeypatch.undo()
    return calls


def test_a_miss_costs_one_round_trip_when_the_service_has_no_l3(node, monkeypatch):
    """Without an L3 behind the service there is nothing to fetch: a miss is one ``acquire``."""
    a = node.engine()
    try:
        assert a.shared.client.has_l3 is False
        assert _ops_of_a_miss(a, monkeypatch, list(range(3000, 3000 + 5 * PS + 1))) == ["acquire"]
    finally:
        a.close()
    n = Node(l3="memory://")
    try:
        b = n.engine()
        try:
            assert b.shared.client.has_l3 is True  # nothing in L2: the service's L3 is asked too
            assert _ops_of_a_miss(b, monkeypatch, list(range(4000, 4000 + 5 * PS + 1))) == ["acquire", "fetch"]
        finally:
            b.close()
    finally:
        n.stop()


def test_loading_the_shared_continuation_never_evicts_the_l1_hit_it_continues(node):
    """B holds 2 pages of the prompt in L1 and 4 free; the 6 shared pages that continue
    them do not fit. Making room must not evict B's own 2-page hit (it then admitted
    neither and counted -8 host tokens: the negative "L3 hit" of replay --service)."""
    a, b = node.engine(), node.engine(**{"pool.device_pages": 6})
    prompt = list(range(300, 300 + 8 * PS + 1))
    try:
        assert serve(a, "a", prompt) == (0, 0, True)  # 8 pages in the segment
        req = b.new_request("b0", prompt[:2 * PS + 1])
        adm = b.admit(req)  # 2 pages from the segment into B's L1
        adm.wait()
        assert (adm.device_tokens, adm.host_tokens, adm.storage_tokens) == (0, 2 * PS, 0)
        req.finish()
        b.drain()
        req = b.new_request("b1", prompt)
        adm = b.admit(req)
        adm.wait()
        assert (adm.device_tokens, adm.host_tokens, adm.storage_tokens) == (2 * PS, 0, 0)
        assert adm.hit_tokens == req.computed_tokens == 2 * PS and values_ok(b, req)
        req.finish()
        b.drain()
        b.check_integrity()
        node.srv.check_integrity()
    finally:
        a.close()
        b.close()
