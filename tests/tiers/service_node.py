"""An in-process node service (``NodeServer``) for tiers tests that run ``HiCache``
in service mode (``storage.url = hicache+unix://``): its L2 is the service's segment."""
from __future__ import annotations

import contextlib
import shutil
import tempfile
import uuid
from pathlib import Path
from typing import Iterator

from hicache.core.config import HiCacheConfig
from hicache.core.layout import KVLayout
from hicache.node.server import NodeServer


@contextlib.contextmanager
def running_service(layout: KVLayout, host_pages: int = 64) -> Iterator[NodeServer]:
    """A started ``NodeServer`` for ``layout`` with no L3; its socket is ``socket_url(srv)``."""
    d = Path(tempfile.mkdtemp(prefix="hct", dir="/tmp"))  # short: a socket path is at most 107 bytes
    cfg = HiCacheConfig.load(env={}, overrides={
        "service.socket_path": str(d / "s.sock"), "service.shm_name": f"hicache-test-{uuid.uuid4().hex[:10]}",
        "pool.host_pages": str(host_pages), "storage.url": ""})
    srv = NodeServer(cfg, layout)
    srv.start()
    try:
        yield srv
    finally:
        srv.stop()
        shutil.rmtree(d, ignore_errors=True)


def socket_url(srv: NodeServer) -> str:
    return f"hicache+unix://{srv.config.service.socket_path}"
