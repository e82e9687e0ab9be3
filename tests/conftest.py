"""Shared fixtures. Services are real: Redis comes from $REDIS_TEST_URL
(set by .ci/run; deliberately not HICACHE_*, which the configuration reads and
validates strictly) or, when that is unset, from a redis-server this fixture starts
on a free loopback port. Tests never skip for a missing service."""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time

import pytest

# At the session's end, kill multiprocessing children a test left running (a timed-out
# test's children blocked on a queue), so pytest never waits in their exit-time join.
from tests.integrations.suite_guard.hicache_suite_guard import pytest_unconfigure  # noqa: F401


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


# pytest-xdist runs the suite in worker processes (gw0, gw1, ...): each worker keeps to a Redis
# database of its own on $REDIS_TEST_URL's server, and to a per-user cache directory of its
# own (the default file:// L3 lives there), so no test sees another worker's objects. Set
# once, in the worker's environment: the suites it runs in subprocesses inherit it as it is.
WORKER = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0")[2:] or 0)


def worker_db(url: str) -> str:
    """``url`` (``redis://host:port/N``) on this xdist worker's own database (N + worker)."""
    base, _, db = url.rpartition("/")
    if not WORKER or not base.startswith("redis://") or not db.isdigit():
        return url
    return f"{base}/{int(db) + WORKER}"


if "PYTEST_XDIST_WORKER" in os.environ and "hicache-xdg-gw" not in os.environ.get("XDG_CACHE_HOME", ""):
    import tempfile
    os.environ["XDG_CACHE_HOME"] = tempfile.mkdtemp(prefix=f"hicache-xdg-gw{WORKER}-")
    if os.environ.get("REDIS_TEST_URL"):
        os.environ["REDIS_TEST_URL"] = worker_db(os.environ["REDIS_TEST_URL"])


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory):
    url = os.environ.get("REDIS_TEST_URL")
    if url:
        yield url  # this worker's database (set above)
        return
    proc, port = start_redis(str(tmp_path_factory.mktemp("redis")))
    try:
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.terminate()
        proc.wait(timeout=10)


@pytest.fixture(scope="module")
def one_torch_thread():
    """torch with one intra-op thread for a module of many small tensor ops (opt in with
    ``pytestmark = pytest.mark.usefixtures("one_torch_thread")``): on a shared 2-core
    machine two threads spin against each other and made pool allocation and small copies
    4-10x slower. Restored after the module."""
    import torch
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def pytest_collection_modifyitems(config, items):
    """GPU tests run where CUDA is; elsewhere they are deselected and counted
    in the report header, never silently skipped one by one."""
    import torch
    if torch.cuda.is_available():
        return
    gpu = [it for it in items if it.get_closest_marker("gpu")]
    if gpu:
        items[:] = [it for it in items if not it.get_closest_marker("gpu")]
        config.hook.pytest_deselected(items=gpu)
        config._hicache_gpu_deselected = len(gpu)


def pytest_report_header(config):
    return "hicache: tests marked 'gpu' run only where CUDA is available (they run on the H200 device machine)"


def pytest_terminal_summary(terminalreporter, config):
    n = getattr(config, "_hicache_gpu_deselected", 0)
    if n:
        terminalreporter.write_line(f"hicache: {n} GPU tests deselected (no CUDA device); "
                                    "run them on a GPU machine with: python -m pytest -m gpu")
