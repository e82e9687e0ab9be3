"""Device-to-device tile choice (measured per case) and the bytes the larger tile writes."""
from __future__ import annotations

import pytest
import torch

from hicache.kernels.page_copy import D2D_TILES, D2D_TILES_LARGE, D2D_TILES_WHOLE_32K, PageCopier
from hicache.kernels.page_copy import plane_pages
from hicache.core.layout import BytePlane, KVLayout
from hicache.memory.pools import DevicePool


def mha(page_size: int, **kw) -> KVLayout:
    return KVLayout("t", 2, num_kv_heads=8, head_dim=128, page_size=page_size, **kw)


@pytest.mark.parametrize("layout,want", [
    (mha(16), D2D_TILES_WHOLE_32K),  # 32 KiB planes
    (mha(64), D2D_TILES_WHOLE_32K),  # 128 KiB planes
    (mha(1), D2D_TILES),  # 2 KiB planes
    (mha(16, extra_planes=(BytePlane("idx", 132),)), D2D_TILES),  # a byte plane leaves a tail
    (KVLayout("t", 2, kind="mla", kv_lora_rank=512, rope_dim=64, page_size=64), D2D_TILES_LARGE),  # 72 KiB
    (KVLayout("t", 2, kind="mla", kv_lora_rank=512, rope_dim=64, page_size=64,
              extra_planes=(BytePlane("index_k", 132),), draft_layers=1), D2D_TILES_LARGE),  # + 8448 B
    (KVLayout("t", 2, kind="mla", kv_lora_rank=512, rope_dim=64, page_size=1), D2D_TILES),  # 1152 B
])
def test_d2d_tiles_follow_the_measured_cases(layout, want):
    assert PageCopier().d2d_tiles(layout) == want


@pytest.mark.parametrize("tiles,layout", [
    (D2D_TILES_WHOLE_32K, KVLayout("t", 1, num_kv_heads=8, head_dim=128, page_size=16)),  # 2 planes of 32 KiB
    # 72 KiB latents (two whole 32 KiB chunks and an 8 KiB tail) + an 8448-byte plane (a 256-byte tail chunk)
    (D2D_TILES_LARGE, KVLayout("t", 1, kind="mla", kv_lora_rank=512, rope_dim=64, page_size=64,
                               extra_planes=(BytePlane("index_k", 132),))),
])
def test_large_d2d_tiles_copy_exact_bytes_through_the_kernel(tiles, layout):
    """The kernel at the large-plane tile shapes, run by Triton's interpreter: copied pages
    equal their sources (tail chunks included), every other page is untouched."""
    gen = torch.Generator().manual_seed(3)
    src, dst = DevicePool(layout, 5), DevicePool(layout, 6)
    for b in src.buffers + dst.buffers:
        b.view(-1).view(torch.uint8).copy_(torch.randint(0, 256, (b.numel() * b.element_size(),),
                                                         dtype=torch.uint8, generator=gen))
    n = len(layout.planes)
    before = [plane_pages(dst, j).clone() for j in range(n)]
    sp, dp = torch.tensor([4, 0, 2]), torch.tensor([1, 5, 3])
    PageCopier(pcie=tiles).copy_pages(src, dst, sp, dp, backend="triton", num_blocks=2)
    for j in range(n):
        want = before[j].clone()
        want[dp] = plane_pages(src, j)[sp]
        assert torch.equal(plane_pages(dst, j), want)
