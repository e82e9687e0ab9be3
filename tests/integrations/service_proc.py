"""A real ``hicache serve`` for the engine integration tests that go through
the node-local service (``hicache+unix://``)."""
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
from pathlib import Path
from typing import NamedTuple

import httpx

from hicache.core.layout import KVLayout

# The service runs from hicache's own environment (.venv), as on a real node where
# `hicache serve` is its own installation; the engine's environment only needs the client.
_MAIN_PY = Path(__file__).resolve().parents[2] / ".venv" / "bin" / "python"


class Serve(NamedTuple):
    proc: subprocess.Popen
    socket_path: str
    dir: str

    @property
    def url(self) -> str:
        return f"hicache+unix://{self.socket_path}"


def start_serve(layout: KVLayout, host_pages: int = 64) -> Serve:
    """``hicache serve`` configured with ``layout`` (the one the engine adapter derives),
    L3 ``memory://``, on a free loopback port; returns once it answers and listens."""
    d = tempfile.mkdtemp(prefix="hc-")  # Unix socket paths are limited to 107 bytes
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    settings = {"service.port": port, "service.socket_path": f"{d}/h.sock",
                "service.shm_name": f"hicache-it-{os.getpid()}-{uuid.uuid4().hex[:8]}",
                "storage.url": "memory://", "pool.host_pages": host_pages, "log_level": "WARNING"}
    for k, v in layout.to_dict().items():
        if k != "extra_planes":
            settings[f"model.{k}"] = v
    args = [str(_MAIN_PY if _MAIN_PY.exists() else sys.executable), "-m", "hicache.cli", "serve"]
    for k, v in settings.items():
        args += ["--set", f"{k}={v}"]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while True:
        assert proc.poll() is None, f"hicache serve exited {proc.returncode}: {proc.stderr.read()}"
        try:
            if httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1).status_code == 200 \
                    and os.path.exists(f"{d}/h.sock"):
                break
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, "hicache serve did not answer /healthz within 60 s"
        time.sleep(0.1)
    return Serve(proc, f"{d}/h.sock", d)


def stop_serve(serve: Serve) -> None:
    """SIGTERM, wait, and require a clean exit (the service checks its integrity on the way out)."""
    serve.proc.send_signal(signal.SIGTERM)
    _, err = serve.proc.communicate(timeout=30)
    shutil.rmtree(serve.dir, ignore_errors=True)
    assert serve.proc.returncode == 0, err
