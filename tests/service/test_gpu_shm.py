"""GPU <-> shared L2 segment: the client page-locks the mapping so copies are true DMA."""
from __future__ import annotations

import os
import tempfile
from contextlib import contextmanager
from typing import Iterator

import pytest
import torch

from hicache.api.engine_server import EngineServer
from hicache.client import EngineClient
from hicache.config import HiCacheConfig
from hicache.hashing import page_hashes
from hicache.layout import KVLayout

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@contextmanager
def gpu_service(host_layout: str, tag: str) -> Iterator[tuple[str, KVLayout]]:
    """A started in-process service with an 8-page bf16 segment: ``(socket path, layout)``;
    its integrity is checked and it is stopped afterwards."""
    d = tempfile.mkdtemp(prefix="hcg", dir="/tmp")
    cfg = HiCacheConfig.load(env={}, overrides={
        "service.socket_path": d + "/s.sock", "service.shm_name": f"hicache-{tag}-{os.getpid()}-{host_layout}",
        "pool.host_pages": 8, "model.host_layout": host_layout, "model.dtype": "bfloat16"})
    srv = EngineServer(cfg)
    srv.start()
    try:
        yield cfg.service.socket_path, cfg.layout()
        srv.check_integrity()
    finally:
        srv.stop()
        os.rmdir(d)


@pytest.mark.parametrize("host_layout", ["page_first", "layer_first"])
def test_pinned_segment_round_trips_pages_through_the_gpu(host_layout):
    with gpu_service(host_layout, "gpu") as (sock, lay):
        with EngineClient(sock, lay) as a, EngineClient(sock, lay) as b:
            assert a.pool.buffer.is_pinned() and b.pool.buffer.is_pinned()
            hashes = page_hashes(list(range(3 * lay.page_size)), lay.page_size)
            src = {k: torch.randn(3, *v.shape, device="cuda").to(v.dtype)
                   for k, v in a.pool.page_view(0).items()}
            pages = a.reserve(3)
            for i, p in enumerate(pages):
                for k, v in a.pool.page_view(p).items():
                    v.copy_(src[k][i], non_blocking=True)  # GPU -> pinned shared memory
            torch.cuda.synchronize()
            a.commit(hashes, pages)
            got = b.acquire(hashes)
            assert got == pages
            for i, p in enumerate(got):
                for k, v in b.pool.page_view(p).items():
                    back = v.to("cuda", non_blocking=True)  # pinned shared memory -> GPU
                    torch.cuda.synchronize()
                    assert torch.equal(back, src[k][i]), (k, i)
            b.release(hashes)


@pytest.mark.parametrize("host_layout", ["page_first", "layer_first"])
def test_shared_l2_kernels_copy_between_gpu_l1_and_the_segment(host_layout):
    """Zero copy on the GPU: the Triton page-copy kernels read and write the
    registered segment directly (engine A's L1 -> shared pages -> engine B's L1)."""
    from hicache.pools import DevicePool
    from hicache.shared_l2 import SharedL2
    with gpu_service(host_layout, "gpuz") as (sock, lay):
        with EngineClient(sock, lay) as a, EngineClient(sock, lay) as b:
            src, dst = DevicePool(lay, 8, "cuda"), DevicePool(lay, 8, "cuda")
            for buf in src.buffers:
                buf.copy_(torch.randn(buf.shape, device="cuda").to(buf.dtype))
            hashes = page_hashes(list(range(3 * lay.page_size)), lay.page_size)
            assert SharedL2(a).store(src, [6, 1, 4], hashes) == (0, 3, 3)
            assert SharedL2(b).load(hashes, dst, [0, 5, 2]) == 3
            for s, t in zip([6, 1, 4], [0, 5, 2]):
                for k, v in src.page_view(s).items():
                    assert torch.equal(dst.page_view(t)[k], v), (k, s, t)
