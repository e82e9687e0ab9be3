"""A node service for the consensus tests (its socket carries the ranks' agreement)."""
from __future__ import annotations

import os
import tempfile

import pytest

from hicache.core.config import HiCacheConfig
from hicache.node.server import NodeServer
from hicache.memory.shm import shm_path


@pytest.fixture
def server():
    d = tempfile.mkdtemp(prefix="hcc", dir="/tmp")
    name = f"hicache-test-{os.getpid()}-{os.urandom(4).hex()}"
    cfg = HiCacheConfig.load(overrides={"service.socket_path": d + "/s.sock", "service.shm_name": name,
                                        "pool.host_pages": 4}, env={})
    srv = NodeServer(cfg)
    srv.start()
    yield srv
    srv.stop()
    assert not os.path.exists(shm_path(name))
    os.rmdir(d)
