"""Hardening fixtures: an in-process engine server with settings per test, raw frames."""
from __future__ import annotations

import os
import socket
import tempfile
import uuid
from pathlib import Path
from typing import Any, Callable, Iterator

import msgpack
import pytest

from hicache.api.engine_server import EngineServer
from hicache.config import HiCacheConfig
from hicache.layout import KVLayout
from hicache.protocol import HEADER, hello_request

LAYOUT = dict(model_id="tiny-hard", num_layers=2, num_kv_heads=1, head_dim=4, dtype="float32", page_size=4,
              host_layout="page_first")


def config(**service: Any) -> HiCacheConfig:
    d = Path(tempfile.mkdtemp(prefix="hch", dir="/tmp"))  # short: sun_path holds 107 bytes
    overrides = {f"model.{k}": v for k, v in LAYOUT.items()}
    overrides.update({"pool.host_pages": 16, "storage.url": "", "service.socket_path": str(d / "e.sock"),
                      "service.shm_name": f"hicache-hard-{os.getpid()}-{uuid.uuid4().hex[:8]}"})
    overrides.update({f"service.{k}": v for k, v in service.items()})
    return HiCacheConfig.load(overrides=overrides, env={})


@pytest.fixture
def server() -> Iterator[Callable[..., EngineServer]]:
    """``server(**service_settings)``: a started in-process ``EngineServer``; stopped after the test."""
    made: list[EngineServer] = []

    def make(**service: Any) -> EngineServer:
        s = EngineServer(config(**service))
        s.start()
        made.append(s)
        return s
    yield make
    for s in made:
        s.stop()


class Raw:
    """A hand-driven connection to the engine socket."""

    def __init__(self, path: str, timeout: float = 10.0):
        self.s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.s.settimeout(timeout)
        self.s.connect(path)

    def send(self, obj: Any) -> None:
        body = msgpack.packb(obj, use_bin_type=True)
        self.s.sendall(HEADER.pack(len(body)) + body)

    def recv(self) -> dict | None:
        head = self._exact(4)
        if head is None:
            return None
        body = self._exact(HEADER.unpack(head)[0])
        assert body is not None, "server closed mid-frame"
        return msgpack.unpackb(body, raw=False)

    def call(self, obj: Any) -> dict | None:
        self.send(obj)
        return self.recv()

    def hello(self, layout: KVLayout) -> dict:
        rep = self.call(hello_request(layout.to_dict(), layout.fingerprint(), os.getpid()))
        assert rep is not None and rep["ok"], rep
        return rep

    def closed(self) -> bool:
        """True once the server has hung up (reads EOF)."""
        try:
            return self.s.recv(1) == b""
        except ConnectionResetError:
            return True

    def _exact(self, n: int) -> bytes | None:
        buf = b""
        while len(buf) < n:
            try:
                chunk = self.s.recv(n - len(buf))
            except ConnectionResetError:
                chunk = b""
            if not chunk:
                return None
            buf += chunk
        return buf

    def close(self) -> None:
        self.s.close()


@pytest.fixture
def make_state():
    """``make_state(settings, admin_token)``: a ``RestState`` over a started in-process engine server."""
    from hicache.api.deps import RestState
    from hicache.api.events import EventBus
    made: list = []

    def make(extra: dict[str, str] | None = None, admin_token: str = ""):
        cfg = config()
        if extra:
            cfg = HiCacheConfig.load(overrides={**_flat(cfg), **extra}, env={})
        bus = EventBus()
        engine = EngineServer(cfg, listener=bus)
        engine.start()
        st = RestState(config=cfg, layout=cfg.layout(), engine=engine, storage=None, admin_token=admin_token,
                       bus=bus)
        made.append(st)
        return st
    yield make
    for st in made:
        st.check_integrity()
        st.engine.stop()


def _flat(cfg: HiCacheConfig) -> dict[str, Any]:
    return {f"{sec}.{k}": v for sec, d in cfg.model_dump().items() if isinstance(d, dict) for k, v in d.items()}
