"""The service as engines' shared tier (``hicache+unix://``) and its own L3.

Services run as real processes (``python -m hicache.node.server``)
except where a test needs ``flush_l2`` or the L3 counters in-process.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import NamedTuple

import httpx
import pytest

from hicache.node.server import NodeServer
from hicache.client.link import ServiceClient
from hicache.core.config import HiCacheConfig
from hicache.core.errors import ConfigError, ContractMismatch, ServiceError
from hicache.core.hashing import page_hashes
from hicache.core.layout import KVLayout
from hicache.memory.shm import shm_path
from hicache.storage import open_storage

from .conftest import LAYOUTS, unique_shm_name, wait_ready, write_config


class Proc(NamedTuple):
    socket: str
    shm: str
    proc: subprocess.Popen
    log: Path


def start_service(d: Path, layout: KVLayout, *sets: str, host_pages: int = 16) -> Proc:
    sock, shm = str(d / "engine.sock"), unique_shm_name()
    write_config(d / "hicache.toml", layout, sock, shm, host_pages=host_pages)
    log = d / f"server-{uuid.uuid4().hex[:6]}.log"
    argv = [sys.executable, "-m", "hicache.node.server", "--config", str(d / "hicache.toml")]
    for s in sets:
        argv += ["--set", s]
    with open(log, "w") as err:
        proc = subprocess.Popen(argv, stdout=err, stderr=err)
    wait_ready(sock, layout, proc, log)
    return Proc(sock, shm, proc, log)


def stop_service(p: Proc) -> None:
    if p.proc.poll() is None:
        p.proc.send_signal(signal.SIGTERM)
        assert p.proc.wait(30) == 0, p.log.read_text()
    assert not os.path.exists(shm_path(p.shm)), p.log.read_text()


@pytest.fixture
def tmpdir_short():
    d = Path(tempfile.mkdtemp(prefix="hcs", dir="/tmp"))  # short: sun_path holds 107 bytes
    yield d
    shutil.rmtree(d, ignore_errors=True)


def payload(layout: KVLayout, seed: int) -> bytes:
    return bytes((seed * 31 + i) % 251 for i in range(layout.page_bytes))


def sizes_of(layout: KVLayout) -> list[int]:
    return [p.page_bytes for p in layout.planes]


def backend(sock: str, layout: KVLayout, **kw):
    return open_storage(f"hicache+unix://{sock}", fingerprint=layout.fingerprint(), layout=layout, **kw)


# ------------------------------------------------------------ the backend
@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_backend_round_trip_against_service_process(name, tmpdir_short):
    layout = LAYOUTS[name]
    p = start_service(tmpdir_short, layout)
    try:
        h = page_hashes(list(range(5 * layout.page_size)), layout.page_size)
        sizes = sizes_of(layout)
        with backend(p.socket, layout) as b:
            assert b.put([(h[i], payload(layout, i), sizes) for i in range(3)]) == 3
            assert b.put([(h[0], payload(layout, 0), sizes)]) == 1  # already there: counts as stored
            assert b.prefix_hits(h) == 3
            assert b.exists(h) == [True, True, True, False, False]
            got = b.get(h, sizes)
            assert [bytes(x) if x is not None else None for x in got] == \
                [payload(layout, i) for i in range(3)] + [None, None]
            assert b.get(h[1:2], sizes)[0] == payload(layout, 1)
            s = b.stats()
            assert (s.gets, s.hits, s.misses, s.put_ok, s.put_dropped, s.errors) == (6, 4, 2, 4, 0, 0)
            assert (s.bytes_read, s.bytes_written) == (4 * layout.page_bytes, 4 * layout.page_bytes)
            b.check_integrity()
            # Another engine of the node sees the pages, with the same bytes.
            with ServiceClient(p.socket, layout, pin=False) as c:
                pages = c.acquire(h)
                assert [c.pool.read_page(x) for x in pages] == [payload(layout, i) for i in range(3)]
                c.release(h[:3])
                assert c.fetch(h, 10) == (3, pages, 0)  # this service has no L3: a lookup
                with pytest.raises(ServiceError, match="bad_args.*wait_ms"):
                    c.fetch(h, -1)
            with pytest.raises(ValueError, match="plane sizes"):
                b.get(h, sizes[:-1] + [sizes[-1] + 1])
        # A layout the service refuses fails at open time, naming the fields.
        other = layout.replace(num_layers=layout.num_layers + 1)
        with pytest.raises(ContractMismatch, match="num_layers: ours=3 theirs=2"):
            backend(p.socket, other)
        with pytest.raises(ConfigError, match="whole KVLayout"):
            open_storage(f"hicache+unix://{p.socket}", fingerprint=layout.fingerprint())
        with pytest.raises(ConfigError, match="absolute"):
            open_storage("hicache+unix://relative.sock", fingerprint=layout.fingerprint(), layout=layout)
    finally:
        stop_service(p)


def test_outage_gives_misses_then_reconnects_after_restart(tmpdir_short, caplog):
    layout = LAYOUTS["mha-page_first"]
    sizes = sizes_of(layout)
    h = page_hashes(list(range(3 * layout.page_size)), layout.page_size)
    p = start_service(tmpdir_short, layout)
    b = backend(p.socket, layout, probe_max_ms=50)
    try:
        assert b.put([(h[0], payload(layout, 0), sizes)]) == 1
        stop_service(p)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="hicache.storage"):
            for _ in range(3):
                assert b.get(h[:1], sizes) == [None]
                assert b.put([(h[1], payload(layout, 1), sizes)]) == 0
                assert b.prefix_hits(h) == 0
        assert b.down
        warnings = [r for r in caplog.records if "unreachable" in r.getMessage()]
        assert len(warnings) == 1, [r.getMessage() for r in caplog.records]
        b.check_integrity()  # counters only while down

        p = start_service(tmpdir_short, layout)  # same socket path, fresh L2
        deadline = time.monotonic() + 20
        while b.put([(h[1], payload(layout, 1), sizes)]) == 0:  # reconnects once a probe is due
            assert time.monotonic() < deadline, "never reconnected"
            time.sleep(0.02)
        assert not b.down
        assert b.prefix_hits(h) == 0  # h[0] died with the old service; h[1] alone is not a prefix
        assert b.put([(h[0], payload(layout, 0), sizes)]) == 1
        assert [bytes(x) for x in b.get(h[:2], sizes)] == [payload(layout, 0), payload(layout, 1)]
        s = b.stats()
        assert s.reconnects == 1 and s.put_dropped >= 3 and s.gets == s.hits + s.misses
        b.check_integrity()
    finally:
        b.close()
        stop_service(p)


# ------------------------------------------------------- the service's own L3
class InProc(NamedTuple):
    srv: NodeServer
    storage: object  # the service's L3 backend
    stored: L3Stored  # stored(): (hash, parent) the service reported as written to L3


def _server(tmp: Path, layout: KVLayout, url: str, host_pages: int = 8) -> InProc:
    cfg = HiCacheConfig.load(env={}, overrides={
        "storage.url": url, "storage.timeout_ms": "1000", "pool.host_pages": str(host_pages),
        "service.socket_path": str(tmp / "s.sock"), "service.shm_name": unique_shm_name(),
        "service.client_page_share": "1"})  # one test process fills the pool: no per-client share
    storage = open_storage(url, fingerprint=layout.fingerprint(), layout=layout,
                           timeout_ms=1000, key_prefix=f"t{uuid.uuid4().hex[:8]}:")
    srv = NodeServer(cfg, layout, storage=storage)
    srv.start()
    return InProc(srv, storage, L3Stored(srv))


class L3Stored:
    """Pulls the server's KV events (as the REST app does) and keeps the L3 STORED ones."""

    def __init__(self, srv: NodeServer):
        self.srv, self.pages = srv, []

    def __call__(self) -> list:
        taken = self.srv.take_events()
        assert taken.dropped == 0
        self.pages += [(e.page_hash, e.parent) for e in taken.events if e.tier == "L3"]
        return self.pages


def _wait(pred, what: str, limit: float = 20.0):
    deadline = time.monotonic() + limit
    while not (out := pred()):
        assert time.monotonic() < deadline, (what, out)
        time.sleep(0.01)
    return out


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_service_writes_committed_pages_to_redis_and_serves_them_after_flush(name, redis_url, tmpdir_short):
    layout = LAYOUTS[name]
    srv, storage, stored = _server(tmpdir_short, layout, redis_url)
    h = page_hashes(list(range(4 * layout.page_size)), layout.page_size)
    sizes = sizes_of(layout)
    try:
        with ServiceClient(srv.socket_path, layout, pin=False) as c:
            pages = c.reserve(3)
            for i, p in enumerate(pages):
                c.pool.write_page(p, payload(layout, i))
            c.commit(h[:3], pages, draft_pages=3)  # complete pages (draft rows included) go to L3
            _wait(lambda: srv.stats().l3["written"] == 3, "pages never reached L3")
            # In Redis, as verified L3 objects any engine can read.
            assert [bytes(x) for x in storage.get(h[:3], sizes)] == [payload(layout, i) for i in range(3)]
            assert stored() == [(h[0], None), (h[1], h[0]), (h[2], h[1])]

            assert srv.flush_l2() == 3
            assert c.lookup(h).num_pages == 0
            r = c.fetch(h, 5000)
            assert (r.num_pages, r.fetched) == (3, 3)
            got = c.acquire(h)
            assert [c.pool.read_page(p) for p in got] == [payload(layout, i) for i in range(3)]
            c.release(h[:3])
            assert c.fetch(h, 5000) == (3, got, 0)  # already in L2: nothing loaded

            s = srv.stats()
            assert s.l3 == {"queued": 3, "written": 3, "dropped": 0, "stale": 0, "failed": 0, "fetches": 2,
                            "fetched": 3, "fetch_timeouts": 0, "fetch_busy": 0, "fetch_no_room": 0,
                            "skipped_draft": 0, "queue_pages": 0}
            assert s.clients == 1 and s.reserved_pages == 0 and s.committed_pages == 3
            assert len(stored()) == 3  # pages that came from L3 are not written back
            srv.check_integrity()
    finally:
        srv.stop()
        storage.clear()
        storage.close()


def test_fetch_without_waiting_lands_later_and_no_room_is_counted(tmpdir_short):
    layout = LAYOUTS["mha-page_first"]
    srv, storage, stored = _server(tmpdir_short, layout, "memory://", host_pages=4)
    h = page_hashes(list(range(6 * layout.page_size)), layout.page_size)
    sizes = sizes_of(layout)
    try:
        assert storage.put([(k, payload(layout, i), sizes) for i, k in enumerate(h)]) == 6
        with ServiceClient(srv.socket_path, layout, pin=False) as c:
            r = c.fetch(h[:2], 0)  # wait_ms=0: start the load, answer from L2 now
            assert (r.num_pages, r.fetched) == (0, 0)
            _wait(lambda: c.lookup(h[:2]).num_pages == 2, "the load never landed")
            held = c.acquire(h[:2])
            r = c.fetch(h, 5000)  # 4 more in L3; L2 has room for 2 beside the 2 acquired
            assert (r.num_pages, r.fetched) == (4, 2)
            got = c.acquire(h)
            assert [c.pool.read_page(p) for p in got] == [payload(layout, i) for i in range(4)]
            c.release(h[:4])
            c.release(h[:len(held)])
            s = srv.stats().l3
            assert (s["fetches"], s["fetched"], s["fetch_timeouts"], s["fetch_no_room"]) == (2, 4, 1, 2)
            srv.check_integrity()
    finally:
        srv.stop()
        storage.close()


def test_pages_evicted_before_the_writer_copies_them_are_not_written(tmpdir_short):
    """The writer's seqlock: a page recycled under it is dropped, never stored with other bytes."""
    layout = LAYOUTS["mha-page_first"]
    srv, storage, stored = _server(tmpdir_short, layout, "memory://", host_pages=2)
    h = page_hashes(list(range(40 * layout.page_size)), layout.page_size)
    sizes = sizes_of(layout)
    try:
        with ServiceClient(srv.socket_path, layout, pin=False) as c:
            for i in range(0, 40, 2):  # each commit evicts the previous pair
                pages = c.reserve(2)
                for j, p in enumerate(pages):
                    c.pool.write_page(p, payload(layout, i + j))
                c.commit(h[i:i + 2], pages)
            deadline = time.monotonic() + 20
            # The queue holds one L2's worth of pages (2): more would be stale anyway.
            while (s := srv.stats().l3)["written"] + s["stale"] + s["dropped"] < 40:
                assert time.monotonic() < deadline, ("writer never drained", s)
                time.sleep(0.01)
            assert s["queued"] + s["dropped"] == 40 and s["failed"] == 0 and s["queue_pages"] == 0
            stored = storage.get(h, sizes)
            assert sum(x is not None for x in stored) == s["written"]
            for i, x in enumerate(stored):
                assert x is None or bytes(x) == payload(layout, i), i
            srv.check_integrity()
    finally:
        srv.stop()
        storage.close()


def test_draft_incomplete_pages_stay_out_of_l3_and_of_draft_hits_until_a_complete_copy_comes(tmpdir_short):
    """Invariant 5 in the shared tier: L3 and need_draft hits get complete pages only."""
    layout = LAYOUTS["mla-layer_first-bytes-draft"]
    srv, storage, stored = _server(tmpdir_short, layout, "memory://")
    h = page_hashes(list(range(3 * layout.page_size)), layout.page_size)
    sizes = sizes_of(layout)
    try:
        with ServiceClient(srv.socket_path, layout, pin=False) as c, backend(srv.socket_path, layout) as b:
            pages = c.reserve(3)
            for i, p in enumerate(pages):
                c.pool.write_page(p, payload(layout, i))
            c.commit(h, pages, draft_pages=1)  # an engine without its draft head: pages 1, 2 lack draft rows
            assert c.lookup(h).num_pages == 3 and c.lookup(h, need_draft=True).num_pages == 1
            assert b.prefix_hits(h) == 1 and b.exists(h) == [True, False, False]  # the L3 view: complete only
            _wait(lambda: srv.stats().l3["written"] == 1, "the complete page never reached L3")
            assert srv.stats().l3["skipped_draft"] == 2 and storage.exists(h) == [True, False, False]
            # A complete copy (the backend stores complete pages) upgrades them; L3 gets them.
            assert b.put([(h[i], payload(layout, 10 + i), sizes) for i in range(3)]) == 3
            assert c.lookup(h, need_draft=True).num_pages == 3
            _wait(lambda: srv.stats().l3["written"] == 3, "the upgraded pages never reached L3")
            got = [bytes(x) for x in b.get(h, sizes)]
            assert got == [payload(layout, 0), payload(layout, 11), payload(layout, 12)]
            assert [bytes(x) for x in storage.get(h, sizes)] == got
            st = srv.stats()
            assert (st.draft_upgraded, st.committed_pages, st.used_pages) == (2, 3, 3)
            srv.check_integrity()
    finally:
        srv.stop()
        storage.close()


def test_service_refuses_itself_as_its_own_l3():
    from hicache.node.server import open_l3
    cfg = HiCacheConfig.load(env={}, overrides={"storage.url": "hicache+unix:///tmp/x.sock"})
    with pytest.raises(ConfigError, match="not another hicache service"):
        open_l3(cfg, cfg.layout())


# ------------------------------------------------------ two engines, one node
def _replay(sock: str, out: Path, cwd: Path) -> dict:
    argv = [sys.executable, "-m", "hicache.cli", "replay", "--service", sock, "--quiet", "--no-baselines",
            "--scale", "tiny", "--json", str(out), "--set", "policy.prefetch_policy=wait_complete"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("HICACHE_")}
    r = subprocess.run(argv, capture_output=True, text=True, timeout=120, cwd=cwd, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(out.read_text())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_replays_in_two_processes_share_pages_through_the_service(tmpdir_short):
    """Service mode: the second engine process hits, in the shared L2 segment, the
    pages the first one backed up there (no private L2 in either)."""
    port, sock, shm = free_port(), str(tmpdir_short / "h.sock"), unique_shm_name()
    argv = [sys.executable, "-m", "hicache.cli", "serve", "--set", f"service.port={port}",
            "--set", f"service.socket_path={sock}", "--set", f"service.shm_name={shm}",
            "--set", "storage.url=memory://"]  # the service's own L3: written behind
    env = {k: v for k, v in os.environ.items() if not k.startswith("HICACHE_")}
    log = tmpdir_short / "serve.log"
    with open(log, "w") as err:
        proc = subprocess.Popen(argv, stdout=err, stderr=err, env=env)
    p = Proc(sock, shm, proc, log)
    try:
        wait_ready(sock, HiCacheConfig.load(env={}).layout(), proc, log)
        first = _replay(sock, tmpdir_short / "r1.json", tmpdir_short)
        second = _replay(sock, tmpdir_short / "r2.json", tmpdir_short)
        a, b = first["rows"][0], second["rows"][0]
        assert first["config"]["L3"] == f"hicache+unix://{sock}" and first["config"]["L2_shared"] is True
        st = httpx.get(f"http://127.0.0.1:{port}/v1/stats").json()
        assert first["config"]["L2_pages"] == st["tiers"]["L2"]["capacity_pages"]
        assert "storage" not in first["stats"]  # no L3 of its own: the service persists
        backed = [r["stats"]["tiers"]["backup_pages"] for r in (first, second)]
        assert a["l2_hit_tokens"] + a["l3_hit_tokens"] < b["l2_hit_tokens"] + b["l3_hit_tokens"]
        assert b["l2_hit_tokens"] > 0 and b["l2_hit_tokens"] % 16 == 0
        assert b["hit_tokens"] > a["hit_tokens"] and b["recomputed_tokens"] < a["recomputed_tokens"]
        assert backed[0] > 0 and backed[1] < backed[0]  # the second found most pages shared already
        assert st["engine"]["clients_total"] >= 2 and st["engine"]["clients"] == 0
        assert st["engine"]["segment_origin"] == "created"
        assert (st["engine"]["locked_pages"], st["engine"]["reserved_pages"]) == (0, 0)
        # Every page an engine backed up went into the segment: committed once, or a duplicate.
        assert st["tiers"]["L2"]["bytes_written"] == (sum(backed) - st["engine"]["duplicates"]) * st["page_bytes"]
    finally:
        stop_service(p)
