"""Fixtures: ``hicache serve`` as a real process, and the app built in-process."""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from typing import Iterator

import httpx
import pytest

from hicache.api.app import create_app
from hicache.api.deps import RestState
from hicache.core.config import HiCacheConfig
from tests.rest_state import close_state, open_state

# A small layout keeps segments and payloads tiny: 4-token pages, 2 layers.
BASE_SETTINGS = {"model.num_layers": "2", "model.num_kv_heads": "1", "model.head_dim": "4",
                 "model.page_size": "4", "pool.host_pages": "16", "log_level": "WARNING"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def unique_name() -> str:
    return f"hicache-test-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def short_dir() -> str:
    # Unix socket paths are limited to 107 bytes; pytest's tmp_path can be longer.
    return tempfile.mkdtemp(prefix="hc-")


@dataclass
class Served:
    url: str
    settings: dict[str, str]
    proc: subprocess.Popen
    config: HiCacheConfig

    @property
    def socket_path(self) -> str:
        return self.settings["service.socket_path"]

    def client(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=10.0)


def start_serve(extra: dict[str, str] | None = None, env: dict[str, str] | None = None) -> Served:
    d = short_dir()
    port = free_port()
    settings = {**BASE_SETTINGS, "service.port": str(port), "service.socket_path": f"{d}/h.sock",
                "service.shm_name": unique_name(), "storage.url": "memory://", **(extra or {})}
    args = [sys.executable, "-m", "hicache.cli", "serve"]
    for k, v in settings.items():
        args += ["--set", f"{k}={v}"]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, **(env or {})})
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while True:
        if proc.poll() is not None:
            raise AssertionError(f"hicache serve exited {proc.returncode}: {proc.stderr.read()}")
        try:
            if httpx.get(url + "/healthz", timeout=1).status_code == 200 and os.path.exists(settings["service.socket_path"]):
                break
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, "hicache serve did not answer /healthz within 30 s"
        time.sleep(0.1)
    return Served(url, settings, proc, HiCacheConfig.load(None, settings, env={}))


def stop_serve(s: Served) -> str:
    """SIGTERM, check it exited cleanly and removed its segment; returns its stdout."""
    s.proc.send_signal(signal.SIGTERM)
    out, err = s.proc.communicate(timeout=30)
    shutil.rmtree(os.path.dirname(s.socket_path), ignore_errors=True)
    assert s.proc.returncode == 0, err
    assert not os.path.exists(f"/dev/shm/{s.settings['service.shm_name']}"), "shared segment left behind"
    return out


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    s = start_serve()
    yield s
    stop_serve(s)


@pytest.fixture
def make_state():
    """Build a ``RestState`` over an in-process started ``NodeServer``; stopped afterwards."""
    made: list[RestState] = []

    def make(extra: dict[str, str] | None = None, admin_token: str = "") -> RestState:
        d = short_dir()
        settings = {**BASE_SETTINGS, "service.socket_path": f"{d}/h.sock", "service.shm_name": unique_name(),
                    "storage.url": "memory://", **(extra or {})}
        cfg = HiCacheConfig.load(None, settings, env={})
        st = open_state(cfg, admin_token)
        made.append(st)
        return st

    yield make
    for st in made:
        close_state(st)
        shutil.rmtree(os.path.dirname(st.config.service.socket_path), ignore_errors=True)


@pytest.fixture
def app_of():
    return create_app
