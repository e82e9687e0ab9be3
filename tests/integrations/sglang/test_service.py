"""SGLang TP ranks sharing pages through the node-local service (hicache+unix://)."""
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

import httpx
import torch
from sglang.srt.managers.cache_controller import PrefetchOperation

from hicache.integrations.sglang import sglang_layout

from .conftest import PAGE, controller, host_pool, storage_config
from .test_backend import keys_for, pages_of


def start_serve(layout) -> tuple[subprocess.Popen, str, str]:
    """``hicache serve`` configured with the layout the SGLang backend derives."""
    d = tempfile.mkdtemp(prefix="hc-")  # Unix socket paths are limited to 107 bytes
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    shm = f"hicache-sgl-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    settings = {"service.port": port, "service.socket_path": f"{d}/h.sock", "service.shm_name": shm,
                "storage.url": "memory://", "pool.host_pages": 64, "log_level": "WARNING"}
    for k, v in layout.to_dict().items():
        if k != "extra_planes":
            settings[f"model.{k}"] = v
    args = [sys.executable, "-m", "hicache.cli", "serve"]
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
    return proc, f"{d}/h.sock", d


def test_mla_tp_ranks_share_pages_through_the_service(model, controllers):
    layout = sglang_layout(host_pool("mla", "page_first"),
                           storage_config("mla", "page_first", "memory://", model=model, tp_rank=0, tp_size=2))
    proc, sock, d = start_serve(layout)
    try:
        url = f"hicache+unix://{sock}"
        c0 = controller("mla", "page_first", url, model, tp_rank=0, tp_size=2)
        c1 = controller("mla", "page_first", url, model, tp_rank=1, tp_size=2)
        controllers.extend([c0, c1])
        keys = keys_for(3, seed=11)
        src = c0.mem_pool_host.alloc(3 * PAGE)
        assert c0._page_set_zero_copy(keys, src)
        dst = c1.mem_pool_host.alloc(3 * PAGE)
        assert c1.storage_backend.batch_exists(keys) == 3
        assert c1._page_get_zero_copy(PrefetchOperation("r", []), keys, dst) == 3
        assert all(torch.equal(a, b) for a, b in zip(pages_of(c1.mem_pool_host, dst),
                                                      pages_of(c0.mem_pool_host, src)))
        c1.storage_backend.check_integrity()
    finally:
        for c in controllers:
            c.detach_storage_backend()
        controllers.clear()
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
        shutil.rmtree(d, ignore_errors=True)
    assert proc.returncode == 0, err
