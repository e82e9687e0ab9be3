"""Fixtures for SGLang's real storage code on CPU (run inside .venv-sglang).

How SGLang's code runs here without a GPU:
* host and device pools are built with ``device="cpu"`` and ``pin_memory=False``;
* SGLang's runtime parallel context is stated with
  ``get_parallel().override(tp_rank=..., ...)``, the hook SGLang documents
  for code that runs without a launcher;
* torchvision is an import-only stand-in (``_shims/torchvision``), see there.
"""
from __future__ import annotations

import importlib.util
import os
import pathlib
import sys
import threading
import uuid

if importlib.util.find_spec("torchvision") is None:
    sys.path.insert(0, str(pathlib.Path(__file__).parent / "_shims"))

import pytest  # noqa: E402
import torch  # noqa: E402
from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator  # noqa: E402
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig  # noqa: E402
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool  # noqa: E402
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost  # noqa: E402
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost  # noqa: E402
from sglang.srt.runtime_context import get_parallel  # noqa: E402

LAYOUTS = ("layer_first", "page_first", "page_first_direct")
PAGE = 4
LAYERS = 3
TOKENS = 64  # device pool tokens; the host pool holds twice that


def parallel(tp_rank: int = 0, tp_size: int = 1):
    """SGLang's parallel context for one rank, as its launcher would publish it."""
    return get_parallel().override(tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1,
                                   attn_dcp_size=1, attn_dcp_rank=0)


def device_pool(kind: str):
    if kind == "mha":
        return MHATokenToKVPool(TOKENS, PAGE, torch.bfloat16, 2, 8, LAYERS, "cpu", False,
                                start_layer=0, end_layer=LAYERS)
    return MLATokenToKVPool(TOKENS, PAGE, torch.bfloat16, 16, 4, LAYERS, "cpu", False,
                            start_layer=0, end_layer=LAYERS)


def host_pool(kind: str, layout: str, dev=None):
    """A real SGLang host pool on CPU, filled with random bytes."""
    dev = dev or device_pool(kind)
    info = dev.get_device_pool_infos()[0].buffer_info
    common = dict(pin_memory=False, device_capacity_tokens=dev.size, start_layer=dev.start_layer,
                  end_layer=dev.end_layer)
    if kind == "mha":
        pool = MHATokenToKVPoolHost(info, 2.0, 0, PAGE, layout, **common)
    else:
        pool = MLATokenToKVPoolHost(info, 2.0, 0, PAGE, layout, target_layer_num=LAYERS, **common)
    flat = pool.kv_buffer.view(-1).view(torch.int16)
    flat.copy_(torch.randint(-2**15, 2**15, flat.shape, dtype=torch.int16))
    return pool


def storage_config(kind: str, layout: str, url: str, *, model: str, tp_rank: int = 0, tp_size: int = 1,
                   **extra) -> HiCacheStorageConfig:
    """The config SGLang's HiCacheController builds for the dynamic backend."""
    return HiCacheStorageConfig(
        tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=kind == "mla", enable_storage_metrics=False,
        is_page_first_layout=layout != "layer_first", model_name=model,
        extra_config=dynamic_config(url, **extra))


def dynamic_config(url: str, **extra) -> dict:
    return {"backend_name": "hicache", "module_path": "hicache.integrations.sglang",
            "class_name": "HiCacheBackend", "interface_v1": 1, "url": url, **extra}


@pytest.fixture
def model() -> str:
    """A model name unique to the test: its own fingerprint, so its own Redis keys."""
    return f"test-model-{uuid.uuid4().hex[:8]}"


@pytest.fixture(params=["file", "redis"])
def l3_url(request, tmp_path, redis_url):
    return f"file://{tmp_path}/l3" if request.param == "file" else redis_url


def controller(kind: str, layout: str, url: str, model: str, *, tp_rank: int = 0, tp_size: int = 1,
               backend: str = "dynamic", extra: dict | None = None):
    """A real HiCacheController on CPU with its storage backend attached."""
    from sglang.srt.managers.cache_controller import HiCacheController
    dev = device_pool(kind)
    pool = host_pool(kind, layout, dev)
    alloc = PagedTokenToKVPoolAllocator(TOKENS, PAGE, torch.bfloat16, "cpu", dev, False)
    cfg = dynamic_config(url, **(extra or {})) if backend == "dynamic" else dict(extra or {})
    with parallel(tp_rank, tp_size):
        ctrl = HiCacheController(alloc, pool, PAGE, None, threading.Event(), storage_backend=backend,
                                 model_name=model, storage_backend_extra_config=cfg)
    return ctrl


@pytest.fixture
def controllers():
    """Controllers made by a test, detached (threads stopped, backend closed) at its end."""
    made: list = []
    yield made
    for c in made:
        c.detach_storage_backend()


os.environ.setdefault("SGLANG_LOGGING_LEVEL", "WARNING")


@pytest.fixture
def private_redis_url(tmp_path):
    """A redis-server of this test's own, and a function that stops it."""
    import shutil
    import socket
    import subprocess
    import time
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    exe = shutil.which("redis-server")
    assert exe, "redis-server is not on PATH; install it (apt-get install redis-server)"
    proc = subprocess.Popen([exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no", "--dir", str(tmp_path)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 10
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            break
        except OSError:
            assert time.monotonic() < deadline, f"redis-server did not listen on {port}"
            time.sleep(0.05)

    def stop():
        proc.terminate()
        proc.wait(timeout=10)
    yield f"redis://127.0.0.1:{port}/0", stop
    if proc.poll() is None:
        stop()
