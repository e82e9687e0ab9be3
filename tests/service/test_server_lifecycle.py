"""NodeServer in a thread: start/stop, leftovers, refusals at start; shm and frame helpers."""
from __future__ import annotations

import errno
import os
import socket
import tempfile
import threading

import pytest

from hicache.node.server import NodeServer
from hicache.client.link import ServiceClient
from hicache.core.config import HiCacheConfig
from hicache.core.errors import ConfigError, PoolError, ServiceError
from hicache.core.hashing import page_hashes
from hicache.client.protocol import HEADER, body_length, pack, unpack
from hicache.memory.shm import SharedSegment, shm_path


@pytest.fixture
def cfg():
    d = tempfile.mkdtemp(prefix="hcl", dir="/tmp")
    name = f"hicache-test-{os.getpid()}-{threading.get_ident() % 10000}-{os.urandom(4).hex()}"
    c = HiCacheConfig.load(overrides={"service.socket_path": d + "/s.sock", "service.shm_name": name,
                                      "pool.host_pages": 4}, env={})
    yield c
    if os.path.exists(shm_path(name)):
        os.unlink(shm_path(name))
    for f in os.listdir(d):
        os.unlink(os.path.join(d, f))
    os.rmdir(d)


def test_start_serve_stop_removes_socket_and_segment(cfg):
    srv = NodeServer(cfg)
    srv.start()
    try:
        lay = cfg.layout()
        assert os.path.exists(shm_path(cfg.service.shm_name))
        with ServiceClient(cfg.service.socket_path, lay) as c:
            h = page_hashes(list(range(2 * lay.page_size)), lay.page_size)
            p = c.reserve(2)
            c.pool.write_page(p[0], bytes(lay.page_bytes))
            c.pool.write_page(p[1], bytes(range(256)) * (lay.page_bytes // 256))
            c.commit(h, p)
            assert srv.pool.read_page(p[1]) == bytes(range(256)) * (lay.page_bytes // 256)
            st = srv.stats()  # from this (non-loop) thread
            assert (st.committed_pages, st.clients, st.used_pages, st.free_pages) == (2, 1, 2, 2)
            srv.check_integrity()
    finally:
        srv.stop()
    assert not os.path.exists(shm_path(cfg.service.shm_name))
    assert not os.path.exists(cfg.service.socket_path)


def test_stop_disconnects_clients(cfg):
    srv = NodeServer(cfg)
    srv.start()
    c = ServiceClient(cfg.service.socket_path, cfg.layout())
    srv.stop()
    with pytest.raises(ServiceError) as e:
        c.stats()
    assert e.value.kind == "closed"
    c.close()


def test_run_forever_answers_other_threads_on_its_loop(cfg):
    # run_forever() serves in the calling (main) thread; stats() from any other
    # thread must still read the index on the loop, never concurrently with it.
    srv = NodeServer(cfg)
    ran_on, snapshot = [], srv._snapshot

    def recording_snapshot():
        ran_on.append(threading.get_ident())
        return snapshot()
    srv._snapshot = recording_snapshot
    asked: list = []

    def other() -> None:
        try:
            for _ in range(1000):
                if os.path.exists(cfg.service.socket_path):
                    break
                threading.Event().wait(0.01)
            asked.append(srv.stats().capacity_pages)
        finally:
            srv.stop()
    t = threading.Thread(target=other)
    t.start()
    srv.run_forever()
    t.join()
    assert asked == [4] and ran_on == [threading.get_ident()]


def test_client_hangs_up_when_a_reply_is_lost_or_unreadable(cfg, monkeypatch):
    # Either way the stream is out of step: a kept connection would hand the
    # next call the previous call's reply (or refuse every later reply).
    srv = NodeServer(cfg)
    srv.start()
    try:
        c = ServiceClient(cfg.service.socket_path, cfg.layout())

        def interrupted() -> None:
            raise KeyboardInterrupt
        monkeypatch.setattr(c, "_fill", interrupted)
        with pytest.raises(KeyboardInterrupt):
            c.reserve(1)
        monkeypatch.undo()
        with pytest.raises(ServiceError) as e:
            c.lookup([])  # not answered with reserve's reply
        assert e.value.kind == "closed" and c.pool is None

        c = ServiceClient(cfg.service.socket_path, cfg.layout())
        monkeypatch.setattr("hicache.client.link.MAX_REPLY_BYTES", 8)
        with pytest.raises(ServiceError) as e:
            c.stats()
        assert e.value.kind == "closed" and "too_large" in str(e.value) and c.pool is None
        monkeypatch.undo()
        # The server reclaims the interrupted reservation once it sees the hang-up.
        for _ in range(1000):
            st = srv.stats()
            if st.clients == 0:
                break
            threading.Event().wait(0.01)
        assert (st.reserved_pages, st.reclaimed, st.free_pages) == (0, 1, 4)
        srv.check_integrity()
    finally:
        srv.stop()


def test_stale_socket_is_replaced_live_one_is_refused(cfg):
    path = cfg.service.socket_path
    s = socket.socket(socket.AF_UNIX)
    s.bind(path)  # bound, never listening: a crashed server's leftover
    s.close()
    srv = NodeServer(cfg)
    srv.start()
    try:
        other = cfg.model_copy(update={"service": cfg.service.model_copy(update={"shm_name": "x" + cfg.service.shm_name})})
        with pytest.raises(ConfigError, match="already listens"):
            NodeServer(other).start()
        assert not os.path.exists(shm_path("x" + cfg.service.shm_name))
    finally:
        srv.stop()


def test_existing_segment_name_is_refused(cfg):
    with SharedSegment.create(cfg.service.shm_name, 64):
        with pytest.raises(PoolError, match="already exists"):
            NodeServer(cfg).start()
        assert not os.path.exists(cfg.service.socket_path)


def test_long_socket_path_is_refused(cfg):
    bad = cfg.model_copy(update={"service": cfg.service.model_copy(update={"socket_path": "/tmp/" + "x" * 120})})
    with pytest.raises(ConfigError, match="longer than 107 bytes"):
        NodeServer(bad)


def test_shared_segment_is_shared_and_unlinked_by_owner():
    name = f"hicache-test-{os.getpid()}-{os.urandom(4).hex()}"
    with SharedSegment.create(name, 100) as a:
        b = SharedSegment.attach(name, 100)
        a.tensor[7] = 42
        assert int(b.tensor[7]) == 42 and b.tensor.numel() == 100
        with pytest.raises(PoolError, match="holds 100 bytes, expected 200"):
            SharedSegment.attach(name, 200)
        b.close()
        assert os.path.exists(shm_path(name))  # an attacher never unlinks
    assert not os.path.exists(shm_path(name))
    with pytest.raises(PoolError, match="does not exist"):
        SharedSegment.attach(name, 100)
    for bad in ("a/b", "", ".."):
        with pytest.raises(PoolError, match="shm_name"):
            shm_path(bad)


def test_segment_memory_is_reserved_at_create_not_on_first_touch(monkeypatch):
    # A sparse tmpfs file would SIGBUS the first process to touch a page
    # /dev/shm has no room for; create() reserves (or refuses) up front.
    name = f"hicache-test-{os.getpid()}-{os.urandom(4).hex()}"
    size = 1 << 20
    with SharedSegment.create(name, size):
        assert os.stat(shm_path(name)).st_blocks * 512 >= size

    def no_room(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(os, "posix_fallocate", no_room)
    with pytest.raises(PoolError, match=f"needs {size} bytes but /dev/shm has no room"):
        SharedSegment.create(name, size)
    assert not os.path.exists(shm_path(name))


def test_frame_helpers_round_trip_and_limits():
    obj = {"op": "lookup", "hashes": [b"\0" * 16, b"\xff" * 16]}
    frame = pack(obj)
    assert body_length(frame[:4], 1024) == len(frame) - 4
    assert unpack(frame[4:]) == obj
    with pytest.raises(ServiceError) as e:
        body_length(HEADER.pack(2000), 1024)
    assert e.value.kind == "too_large" and "2000 bytes exceeds the limit of 1024" in str(e.value)
    with pytest.raises(ServiceError) as e:
        unpack(b"\x93\x01\x02\x03")  # a list, not a map
    assert e.value.kind == "bad_request"
    with pytest.raises(ServiceError) as e:
        unpack(b"\x81\x01\x02")  # int map key
    assert e.value.kind == "bad_frame"
