"""GPU <-> shared L2 segment: the client page-locks the mapping so copies are true DMA."""
from __future__ import annotations

import os
import tempfile
from contextlib import contextmanager
from typing import Iterator

import pytest
import torch

from hicache.node.server import NodeServer
from hicache.client.link import ServiceClient
from hicache.core.config import HiCacheConfig
from hicache.core.hashing import page_hashes
from hicache.core.layout import KVLayout

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@contextmanager
def gpu_service(host_layout: str, tag: str) -> Iterator[tuple[str, KVLayout]]:
    """A started in-process service with an 8-page bf16 segment: ``(socket path, layout)``;
    its integrity is checked and it is stopped afterwards."""
    d = tempfile.mkdtemp(prefix="hcg", dir="/tmp")
    cfg = HiCacheConfig.load(env={}, overrides={
        "service.socket_path": d + "/s.sock", "service.shm_name": f"hicache-{tag}-{os.getpid()}-{host_layout}",
        "pool.host_pages": 8, "model.host_layout": host_layout, "model.dtype": "bfloat16"})
    srv = NodeServer(cfg)
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
        with ServiceClient(sock, lay) as a, ServiceClient(sock, lay) as b:
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
    from hicache.memory.pools import DevicePool
    from .shared_l2_worker import load, store
    with gpu_service(host_layout, "gpuz") as (sock, lay):
        with ServiceClient(sock, lay) as a, ServiceClient(sock, lay) as b:
            src, dst = DevicePool(lay, 8, "cuda"), DevicePool(lay, 8, "cuda")
            for buf in src.buffers:
                buf.copy_(torch.randn(buf.shape, device="cuda").to(buf.dtype))
            hashes = page_hashes(list(range(3 * lay.page_size)), lay.page_size)
            assert store(a, src, [6, 1, 4], hashes) == (0, 3, 3)
            assert load(b, hashes, dst, [0, 5, 2]) == 3
            for s, t in zip([6, 1, 4], [0, 5, 2]):
                for k, v in src.page_view(s).items():
                    assert torch.equal(dst.page_view(t)[k], v), (k, s, t)


@pytest.mark.parametrize("host_layout", ["page_first", "layer_first"])
def test_hicache_service_mode_on_a_gpu_moves_exact_pages_through_the_segment(host_layout):
    """Two ``HiCache`` engines on the GPU in service mode: A's write-through backup
    (kernel, L1 -> pinned segment) is B's layer-wise load back (CUDA-graph replay,
    segment -> scattered L1 pages), byte for byte."""
    from hicache.cache.hicache import HiCache
    with gpu_service(host_layout, "gpuhc") as (sock, lay):
        cfg = HiCacheConfig.load(env={}, overrides={
            "storage.url": f"hicache+unix://{sock}", "pool.device": "cuda:0", "pool.device_pages": 16,
            "model.host_layout": host_layout, "model.dtype": "bfloat16", "policy.write_policy": "write_through"})
        a, b = HiCache(cfg, layout=lay), HiCache(cfg, layout=lay)
        try:
            assert a.host_pool.buffer.is_pinned() and a.private_host_bytes == 0
            prompt = list(range(5, 5 + 5 * lay.page_size + 1))  # 5 whole pages (the segment holds 8)
            ra = a.new_request("a", prompt)
            a.admit(ra)
            ra.alloc(len(prompt))
            g = torch.Generator(device="cuda").manual_seed(3)
            for buf in a.device_pool.buffers:
                buf.copy_(torch.randn(buf.shape, generator=g, device="cuda").to(buf.dtype))
            want = [a.device_pool.page_view(p) for p in ra.pages[:5]]
            want = [{k: v.clone() for k, v in w.items()} for w in want]
            ra.commit()
            ra.finish()
            a.drain()
            assert a.stats().tiers.backup_pages == 5
            rb = b.new_request("pre", list(range(900, 900 + 3 * lay.page_size)))  # B's first pages are taken
            b.admit(rb)
            rb.alloc(rb.num_tokens)
            req = b.new_request("b", prompt)
            adm = b.admit(req)
            assert (adm.hit_tokens, adm.host_tokens) == (5 * lay.page_size, 5 * lay.page_size)
            assert b.transfers._graph is not None  # the layer-wise load went through the captured graph
            adm.wait()
            torch.cuda.synchronize()
            got = [b.device_pool.page_view(p) for p in req.pages[:5]]
            assert req.pages[:5] != ra.pages[:5]
            for i, (w, g_) in enumerate(zip(want, got)):
                for k in w:
                    assert torch.equal(w[k], g_[k]), (i, k)
            req.finish()
            rb.finish()
            b.drain()
            a.check_integrity()
            b.check_integrity()
        finally:
            a.close()
            b.close()
