"""Shared fixtures. Services are real: Redis comes from $HICACHE_TEST_REDIS_URL
(set by .ci/run) or, when that is unset, from a redis-server this fixture starts
on a free loopback port. Tests never skip for a missing service."""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time

import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_redis(tmp_dir: str, port: int | None = None, *extra: str) -> tuple[subprocess.Popen, int]:
    """Start a private redis-server on loopback; returns (process, port)."""
    exe = shutil.which("redis-server")
    assert exe, "redis-server is not on PATH; install it (apt-get install redis-server)"
    port = port or free_port()
    proc = subprocess.Popen([exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no", "--dir", tmp_dir, *extra],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_port(port)
    return proc, port


def wait_port(port: int, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"nothing listens on 127.0.0.1:{port} after {timeout}s")


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory):
    url = os.environ.get("HICACHE_TEST_REDIS_URL")
    if url:
        yield url
        return
    proc, port = start_redis(str(tmp_path_factory.mktemp("redis")))
    try:
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.terminate()
        proc.wait(timeout=10)
