"""Real-shape cases for the paged-KV tests (CPU here, CUDA in test_paged_kv_gpu, and the bench):
vLLM-layout tensors at block 16, the planes' canonical bytes computed independently of
``adopt_paged_kv``, and a round trip through hicache's L2 host pool."""
from __future__ import annotations

import zlib
from typing import NamedTuple

import numpy as np
import torch

from hicache.core.layout import BytePlane, KVLayout
from hicache.core.shapes import model_shape
from hicache.kernels import copy_pages
from hicache.memory.paged_kv import adopt_paged_kv, cell_bytes, cell_heads, vllm_kv_caches
from hicache.memory.pools import DevicePool, HostPool

BLOCK = 16


class Case(NamedTuple):
    name: str
    layout: KVLayout
    groups: int  # vLLM cache groups aliasing one allocation (gpt-oss: sliding + full)


def cases(host_layout: str = "layer_first") -> list[Case]:
    """llama-3.1-8b, qwen3-32b, deepseek-v3 MLA (+ its NextN draft layer), gpt-oss-120b's two
    groups, llama-3.1-8b with an fp8 cache, and deepseek-v3's FlashMLA fp8 cell (656 bytes:
    512 fp8 latent + 144 bytes of scales and bf16 rope, one byte plane)."""
    def shape(name, **kw):
        return model_shape(name).kv_layout(BLOCK, host_layout=host_layout, **kw)

    ds = model_shape("deepseek-v3")
    fp8_mla = KVLayout(ds.hf, num_layers=ds.layers, kind="mla", kv_lora_rank=512, dtype="float8_e4m3fn",
                       extra_planes=(BytePlane("scale_rope", 144),), draft_layers=1, page_size=BLOCK,
                       host_layout=host_layout)
    return [Case("llama-3.1-8b", shape("llama-3.1-8b"), 1), Case("qwen3-32b", shape("qwen3-32b"), 1),
            Case("deepseek-v3", shape("deepseek-v3"), 1), Case("gpt-oss-120b", shape("gpt-oss-120b"), 2),
            Case("llama-3.1-8b-fp8", shape("llama-3.1-8b").replace(dtype="float8_e4m3fn"), 1),
            Case("deepseek-v3-fp8-ds-mla", fp8_mla, 1)]


def _raw(kv: dict[str, torch.Tensor]) -> torch.Tensor:
    """The one uint8 allocation behind every layer's view (vLLM allocates one)."""
    st = next(iter(kv.values())).untyped_storage()
    assert all(t.untyped_storage().data_ptr() == st.data_ptr() for t in kv.values())
    return torch.empty(0, dtype=torch.uint8, device=st.device).set_(st)


def _snapshot(kv: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Each layer's view over one copy of the allocation (same shapes and strides)."""
    copy = _raw(kv).clone().untyped_storage()
    return {k: torch.empty(0, dtype=t.dtype, device=t.device).set_(copy, t.storage_offset(), t.shape, t.stride())
            for k, t in kv.items()}


def fill(kv: dict[str, torch.Tensor], seed: int) -> None:
    """Random bytes over the whole allocation every layer views (groups alias it)."""
    raw = _raw(kv)
    if raw.device.type != "cpu":  # generated where it lives (a GPU fills GiBs at once)
        raw.random_(0, 256, generator=torch.Generator(device=raw.device).manual_seed(seed))
        return
    raw.copy_(torch.from_numpy(np.random.default_rng(seed).integers(0, 256, raw.numel(), dtype=np.uint8)))


def canonical_page(t: torch.Tensor, layout: KVLayout, block: int) -> list[torch.Tensor]:
    """The canonical bytes of each plane of one layer's block, cut straight from vLLM's
    ``[B, H, N, C]`` view: token-major ``[N, H, width]`` slices of the cell, in plane order."""
    u = t.view(torch.uint8)[block]  # [H, N, C]
    out, at, h = [], 0, cell_heads(layout)
    for spec in layout.planes_of_layer(0):
        w = spec.row_bytes // h
        out.append(u[:, :, at:at + w].permute(1, 0, 2).reshape(-1))
        at += w
    assert at == cell_bytes(layout)
    return out


def group_planes(layout: KVLayout, group: int, groups: int) -> list[int]:
    """Plane indices of the layers of one cache group (layer ``i`` is in group ``i % groups``)."""
    n = layout.num_layers
    return [s.index for s in layout.planes if (s.layer + (n if s.draft else 0)) % groups == group]


def round_trip(case: Case, kv_layout: str, device: str, backend: str = "auto", num_blocks: int = 10,
               host_pages: int = 6, kv: dict[str, torch.Tensor] | None = None) -> "Trip":
    """Save scattered blocks of every group to L2, wipe L1, load them into other scattered blocks.
    ``kv``: the engine's tensors (vLLM's own, in the vLLM suite); built like vLLM's otherwise."""
    lay = case.layout
    if kv is None:
        kv = vllm_kv_caches(lay, num_blocks, kv_layout, groups=case.groups, device=device)
    fill(kv, seed=zlib.crc32(f"{case.name}/{kv_layout}".encode()))
    pool = adopt_paged_kv(lay, kv)
    host = HostPool(lay, host_pages, pin=device != "cpu")
    plan, before = {}, _snapshot(kv)
    per = host_pages // case.groups
    g = torch.Generator().manual_seed(7)
    src, dst = torch.randperm(num_blocks, generator=g).tolist(), torch.randperm(num_blocks, generator=g).tolist()
    pages = torch.randperm(host_pages, generator=g).tolist()
    for k in range(case.groups):  # block ids are unique across groups (one vLLM block pool)
        cut = slice(k * per, (k + 1) * per)
        plan[k] = (src[cut], pages[cut], dst[cut])
        copy_pages(pool, host, src[cut], pages[cut], planes=group_planes(lay, k, case.groups), backend=backend)
    _raw(kv).fill_(0xA5)
    for k, (_, pages, loaded) in plan.items():
        copy_pages(host, pool, pages, loaded, planes=group_planes(lay, k, case.groups), backend=backend)
    if device != "cpu":
        torch.cuda.synchronize()
    return Trip(case, kv, before, pool, host, plan)


class Trip(NamedTuple):
    case: Case
    kv: dict[str, torch.Tensor]  # the engine's tensors, after the round trip
    before: dict[str, torch.Tensor]  # their bytes before it
    pool: DevicePool
    host: HostPool
    plan: dict[int, tuple[list[int], list[int], list[int]]]  # group -> (saved blocks, host pages, loaded blocks)


def check_round_trip(trip: Trip) -> None:
    """L2 holds each saved block's canonical bytes; every loaded block equals its source block;
    every other block still holds the wipe pattern. One gather per layer (strided compares are slow)."""
    case, lay, host = trip.case, trip.case.layout, trip.host
    loaded_any = {b for _, _, loaded in trip.plan.values() for b in loaded}
    for i, (name, t) in enumerate(trip.kv.items()):
        saved, pages, loaded = trip.plan[i % case.groups]
        after, src = t.view(torch.uint8), trip.before[name].view(torch.uint8)
        blocks = src[torch.tensor(saved, device=src.device)]  # [k, H, N, C]
        assert torch.equal(after[torch.tensor(loaded, device=src.device)], blocks), (case.name, name)
        layer_planes = [s for s in lay.planes if s.layer + (lay.num_layers if s.draft else 0) == i]
        canon = blocks.permute(0, 2, 1, 3)  # [k, N, H, C]: token-major
        at, h = 0, cell_heads(lay)
        for s in layer_planes:
            w = s.row_bytes // h
            got = torch.stack([host.plane_page(s.index, p).reshape(-1).view(torch.uint8) for p in pages])
            assert torch.equal(got.cpu(), canon[..., at:at + w].reshape(len(pages), -1).cpu()), (case.name, name, s)
            at += w
        rest = torch.tensor([b for b in range(after.shape[0]) if b not in loaded_any], device=src.device)
        assert bool((after[rest] == 0xA5).all()), (case.name, name, "untouched blocks changed")
