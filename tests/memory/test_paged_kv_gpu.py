"""adopt_paged_kv on CUDA (marker ``gpu``; each test also runs on CPU tensors here): vLLM-layout
tensors at real shapes through L2 with the compiled Triton kernel and with the torch path, and a
layer-wise load back (``TransferController.load_back``: each layer checked right after its
``wait_layer``) into vLLM's blocks, per-layer launches and the CUDA-graph replay alike."""
from __future__ import annotations

import pytest
import torch

from hicache.memory.paged_kv import adopt_paged_kv, vllm_kv_caches
from hicache.memory.pools import HostPool
from hicache.transfer.engine import TransferController
from tests.memory.paged_cases import cases, check_round_trip, fill, round_trip

HAS_CUDA = torch.cuda.is_available()
CUDA = pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")])
_GPU = [pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")]
CUDA_GRAPHS = pytest.param("cuda", True, marks=_GPU, id="cuda-graph")  # graphs: one CUDA-graph replay
CUDA_LAUNCHES = pytest.param("cuda", False, marks=_GPU, id="cuda-launches")  # one launch per layer
CASES = {c.name: c for c in cases()}
PAGE_FIRST = {c.name: c for c in cases("page_first")}


@pytest.mark.parametrize("backend", ["auto", "torch"])
@pytest.mark.parametrize("kv_layout", ["LBNHC", "LBHNC", "BLHNC"])
@pytest.mark.parametrize("host_layout", ["layer_first", "page_first"])
@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("device", [CUDA])
def test_round_trip_cuda(device, name, host_layout, kv_layout, backend):
    """Pinned L2 <-> vLLM-layout blocks on the GPU, scattered, every layer: the kernel and torch."""
    case = (CASES if host_layout == "layer_first" else PAGE_FIRST)[name]
    trip = round_trip(case, kv_layout, device, backend=backend, num_blocks=64, host_pages=24)
    assert trip.host.pinned
    check_round_trip(trip)


@pytest.mark.parametrize("kv_layout", ["LBNHC", "LBHNC"])
@pytest.mark.parametrize("name", ["llama-3.1-8b", "deepseek-v3", "llama-3.1-8b-fp8"])
@pytest.mark.parametrize("device,graphs", [("cpu", False), CUDA_GRAPHS, CUDA_LAUNCHES])
def test_layerwise_load_into_vllm_blocks(device, graphs, name, kv_layout):
    """save (backup) scattered blocks, wipe, load_back into other blocks: layer i is right as
    soon as wait_layer(i) returns; the pool's untouched blocks keep the wipe pattern."""
    lay = CASES[name].layout
    kv = vllm_kv_caches(lay, 32, kv_layout, device=device)
    fill(kv, seed=3)
    pool = adopt_paged_kv(lay, kv)
    host = HostPool(lay, 16, pin=device == "cuda")
    tc = TransferController(pool, host, graphs=graphs, inline=False)
    try:
        saved, pages, loaded = [31, 2, 17, 8, 25, 0], [5, 0, 11, 3, 15, 7], [4, 29, 1, 20, 13, 9]
        tc.backup(saved, pages)
        tc.wait_all()
        want = {n: t.view(torch.uint8)[saved].clone() for n, t in kv.items()}
        for t in kv.values():
            t.view(torch.uint8).fill_(0xA5)
        h = tc.load_back(pages, loaded)
        for i, (n, t) in enumerate(kv.items()):
            if i < lay.num_layers:
                h.wait_layer(i)
            else:
                h.wait()  # draft layers come last
            assert torch.equal(t.view(torch.uint8)[loaded], want[n]), (name, n)
        h.wait()
        tc.wait_all()
        rest = [b for b in range(32) if b not in loaded]
        assert all(bool((t.view(torch.uint8)[rest] == 0xA5).all()) for t in kv.values())
        tc.check_integrity()
        pool.check_integrity()
    finally:
        tc.close()
