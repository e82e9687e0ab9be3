"""Hardening fixtures: an in-process engine server with settings per test, raw frames."""
from __future__ import annotations

import os
import tempfile
import uuid
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

from hicache.node.server import NodeServer
from hicache.core.config import HiCacheConfig
from tests.rest_state import close_state, open_state

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
def server() -> Iterator[Callable[..., NodeServer]]:
    """``server(**service_settings)``: a started in-process ``NodeServer``; stopped after the test."""
    made: list[NodeServer] = []

    def make(**service: Any) -> NodeServer:
        s = NodeServer(config(**service))
        s.start()
        made.append(s)
        return s
    yield make
    for s in made:
        s.stop()


@pytest.fixture
def make_state():
    """``make_state(settings, admin_token)``: a ``RestState`` over a started in-process engine server."""
    made: list = []

    def make(extra: dict[str, str] | None = None, admin_token: str = ""):
        cfg = config()
        if extra:
            cfg = HiCacheConfig.load(overrides={**_flat(cfg), **extra}, env={})
        st = open_state(cfg, admin_token)
        made.append(st)
        return st
    yield make
    for st in made:
        close_state(st)


def _flat(cfg: HiCacheConfig) -> dict[str, Any]:
    return {f"{sec}.{k}": v for sec, d in cfg.model_dump().items() if isinstance(d, dict) for k, v in d.items()}
