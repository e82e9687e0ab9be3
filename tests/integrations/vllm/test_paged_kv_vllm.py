"""hicache.memory.paged_kv against vLLM 0.33's own allocation: ``vllm_kv_caches`` builds the
shapes, strides and offsets of ``create_kv_cache_views`` for every ``KVCacheLayout``, and
``adopt_paged_kv`` takes vLLM's own views (real shapes, block 16) byte-exact through L2."""
from __future__ import annotations

import pytest
import torch
from vllm.v1.kv_cache_interface import (FullAttentionSpec, KVCacheTensor, MLAAttentionSpec,
                                        compute_layout_strides, create_kv_cache_views)
from vllm.v1.kv_cache_layout import KVCacheLayout

from hicache.core.shapes import model_shape
from hicache.memory.paged_kv import VLLM_LAYOUTS, adopt_paged_kv, vllm_kv_caches
from tests.memory.paged_cases import BLOCK, Case, check_round_trip, round_trip

NUM_BLOCKS = 6


def _spec(name: str, fp8: bool = False):
    m = model_shape(name)
    dtype = torch.uint8 if fp8 else torch.bfloat16
    if m.is_mla:
        return MLAAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=m.kv_lora_rank + m.qk_rope_head_dim,
                                dtype=dtype)
    return FullAttentionSpec(block_size=BLOCK, num_kv_heads=m.kv_heads_per_rank, head_size=m.head_dim, dtype=dtype)


def _vllm_views(spec, layers: int, layout: KVCacheLayout) -> list[torch.Tensor]:
    """vLLM's allocate_kv_cache for one group: its planner's strides, its view builder."""
    l_stride, b_stride, *_ = compute_layout_strides(spec, NUM_BLOCKS, layers, layout)
    tensor = KVCacheTensor(size=spec.page_size_bytes * NUM_BLOCKS * layers,
                           layers=[f"model.layers.{i}.self_attn.attn" for i in range(layers)],
                           layer_stride=l_stride, block_stride=b_stride)
    raw = torch.zeros(tensor.size, dtype=torch.int8)
    return create_kv_cache_views(raw, spec, NUM_BLOCKS, layout, tensor)


@pytest.mark.parametrize("kv_layout", sorted(VLLM_LAYOUTS))
@pytest.mark.parametrize("name,fp8", [("llama-3.1-8b", False), ("llama-3.1-8b", True), ("deepseek-v3", False)])
def test_views_match_vllm(name, fp8, kv_layout):
    lay = model_shape(name).kv_layout(BLOCK, layers=3, draft=False)
    if fp8:
        lay = lay.replace(dtype="float8_e4m3fn")
    theirs = _vllm_views(_spec(name, fp8), 3, KVCacheLayout[kv_layout])
    ours = list(vllm_kv_caches(lay, NUM_BLOCKS, kv_layout).values())
    for a, b in zip(theirs, ours):
        assert (a.shape, a.stride(), a.storage_offset(), a.dtype) == (b.shape, b.stride(), b.storage_offset(), b.dtype)


@pytest.mark.parametrize("kv_layout", ["LBNHC", "LBHNC", "BLHNC"])
def test_adopt_vllm_own_views(kv_layout):
    """vLLM's own tensors, every layer of llama-3.1-8b, through both L2 layouts."""
    for host_layout in ("layer_first", "page_first"):
        lay = model_shape("llama-3.1-8b").kv_layout(BLOCK, host_layout=host_layout)
        views = _vllm_views(_spec("llama-3.1-8b"), lay.num_layers, KVCacheLayout[kv_layout])
        kv = {f"model.layers.{i}.self_attn.attn": t for i, t in enumerate(views)}
        adopt_paged_kv(lay, kv).check_integrity()
        case = Case("llama-3.1-8b", lay, 1)
        check_round_trip(round_trip(case, kv_layout, "cpu", backend="torch", num_blocks=NUM_BLOCKS, host_pages=4,
                                    kv=kv))
