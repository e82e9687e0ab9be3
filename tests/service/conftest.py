"""Service fixtures: a real engine server process per layout, raw frame helpers."""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any, Iterator, NamedTuple

import pytest

from hicache.client.link import ServiceClient
from hicache.core.layout import BytePlane, KVLayout
from hicache.memory.shm import shm_path
from tests.raw_socket import RawConn

WORKER = str(Path(__file__).with_name("engine_worker.py"))
HOST_PAGES = 16
MAX_REQUEST_BYTES = 16384

LAYOUTS = {
    "mha-page_first": KVLayout("tiny-mha", num_layers=2, num_kv_heads=1, head_dim=4, dtype="float32",
                               page_size=4, host_layout="page_first"),
    "mla-layer_first-bytes-draft": KVLayout(
        "tiny-mla", num_layers=2, kind="mla", kv_lora_rank=4, rope_dim=2, dtype="bfloat16", page_size=4,
        extra_planes=(BytePlane("idx", 3),), draft_layers=1, host_layout="layer_first"),
}


class Service(NamedTuple):
    layout: KVLayout
    socket: str
    shm_name: str
    proc: subprocess.Popen


def unique_shm_name() -> str:
    return f"hicache-test-{os.getpid()}-{uuid.uuid4().hex[:10]}"


def write_config(path: Path, layout: KVLayout, sock: str, shm: str, host_pages: int = HOST_PAGES) -> None:
    lines = ["[model]"]
    for k, v in layout.to_dict().items():
        lines.append(f"{k} = {json.dumps(v)}")
    lines += ["[pool]", f"host_pages = {host_pages}", "[service]", f"socket_path = {json.dumps(sock)}",
              f"shm_name = {json.dumps(shm)}", f"max_request_bytes = {MAX_REQUEST_BYTES}",
              # One test process is one client, and these tests fill the pool from it (the
              # per-client share: tests/hardening/test_client_share.py).
              "client_page_share = 1.0",
              "[storage]", 'url = ""']  # L2 only: the L3 side has its own tests (test_shared_tier.py)
    path.write_text("\n".join(lines) + "\n")


def wait_ready(sock: str, layout: KVLayout, proc: subprocess.Popen, log: Path, limit: float = 60.0) -> None:
    deadline = time.monotonic() + limit
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"engine server exited with {proc.returncode}: {log.read_text()}")
        try:
            ServiceClient(sock, layout, timeout=5).close()
            return
        except (FileNotFoundError, ConnectionRefusedError):
            if time.monotonic() > deadline:
                raise RuntimeError(f"engine server not ready after {limit}s: {log.read_text()}")
            time.sleep(0.05)


@contextlib.contextmanager
def served(layout: KVLayout, *, host_pages: int = HOST_PAGES, prefix: str = "hcs") -> Iterator[Service]:
    """A real ``python -m hicache.node.server`` process for ``layout``; checks on exit that
    it stops on SIGTERM with status 0 and leaves neither its shm segment nor its socket."""
    d = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))  # short: sun_path holds 107 bytes
    sock, shm = str(d / "engine.sock"), unique_shm_name()
    write_config(d / "hicache.toml", layout, sock, shm, host_pages=host_pages)
    log = d / "server.log"
    with open(log, "w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "hicache.node.server", "--config",
                                 str(d / "hicache.toml")], stdout=err, stderr=err)
    try:
        wait_ready(sock, layout, proc, log)
        yield Service(layout, sock, shm, proc)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0, log.read_text()
        assert not os.path.exists(shm_path(shm)), "server left its shm segment behind"
        assert not os.path.exists(sock), "server left its socket behind"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if os.path.exists(shm_path(shm)):
            os.unlink(shm_path(shm))
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="module", params=sorted(LAYOUTS))
def service(request):
    """A real node server per toy layout (see ``served``)."""
    with served(LAYOUTS[request.param]) as svc:
        yield svc


def run_worker(mode: str, **args: Any) -> dict:
    out = subprocess.run([sys.executable, WORKER, mode, json.dumps(args)], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture
def raw(service):
    """Factory of ``RawConn`` to the service; closes them after the test."""
    conns: list[RawConn] = []

    def make() -> RawConn:
        conns.append(RawConn(service.socket))
        return conns[-1]
    yield make
    for c in conns:
        c.close()


@pytest.fixture
def worker():
    """``worker(mode, **args) -> dict``: run an engine client in its own process."""
    return run_worker
