"""The hybrid models of ``hicache/data/real_models.json`` as vLLM's hybrid KV
cache manager groups them, through vLLM's own code.

gpt-oss-120b: sliding-window (128) and full-attention layers alternate;
Qwen3-Next-80B-A3B: 36 Gated DeltaNet (recurrent, ``MambaSpec``) layers and 12
full-attention layers. The per-layer specs are vLLM's spec classes at the
shapes table's dims; the Gated DeltaNet state shape and dtype come from vLLM's
``MambaStateShapeCalculator`` / ``MambaStateDtypeCalculator`` over the Hugging
Face ``Qwen3NextConfig`` (whose defaults are the 80B-A3B checkpoint's: the
shapes table has no recurrent-state dims). vLLM's ``get_kv_cache_groups``
groups them (one group per 18 layers for gpt-oss, 4 groups of 12 for
Qwen3-Next), ``get_kv_cache_config_from_groups`` places them, and
``build_offloading_config`` gives the tier its ``OffloadingConfig``.

The one step copied rather than called is the platform's hybrid block-size
alignment (``Platform._align_hybrid_block_size`` needs a whole model config):
the attention block grows in multiples of FlashAttention's kernel block (16)
until its page covers the recurrent state, and the state page is padded to it
(Qwen3-Next: 544 tokens, vLLM's known figure).
"""
from __future__ import annotations

import copy
import dataclasses

import torch
from transformers import GptOssConfig, Qwen3NextConfig
from vllm.config import VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.config import build_offloading_config
from vllm.model_executor.layers.mamba.mamba_utils import MambaStateDtypeCalculator, MambaStateShapeCalculator
from vllm.utils.math_utils import cdiv
from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend
from vllm.v1.attention.backends.utils import get_supported_kv_cache_layouts, resolve_kv_cache_layout
from vllm.v1.core.kv_cache_planning import get_kv_cache_config_from_groups, get_kv_cache_groups
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheSpec,
    MambaSpec,
    SlidingWindowSpec,
)
from vllm.v1.kv_offload.config import OffloadingConfig, OffloadingModelConfig

from hicache.core.shapes import ModelShape, model_shape

from .real import BLOCK, vllm_config

HYBRIDS = ("gpt-oss-120b", "qwen3-next-80b-a3b")
KERNEL_BLOCK = 16  # FlashAttention's MultipleOf(16): vLLM's alignment unit for hybrid block sizes


def _gpt_oss_specs(shape: ModelShape) -> dict[str, KVCacheSpec]:
    hf = GptOssConfig()
    assert (hf.num_hidden_layers, hf.num_key_value_heads, hf.head_dim, hf.sliding_window) == (
        shape.layers, shape.kv_heads, shape.head_dim, shape.sliding_window)
    kw = dict(block_size=BLOCK, num_kv_heads=shape.kv_heads, head_size=shape.head_dim,
              dtype=getattr(torch, shape.dtype))
    return {f"model.layers.{i}.self_attn.attn":
            SlidingWindowSpec(**kw, sliding_window=shape.sliding_window) if t == "sliding_attention"
            else FullAttentionSpec(**kw) for i, t in enumerate(hf.layer_types)}


def gdn_state_bytes() -> int:
    """One Qwen3-Next Gated DeltaNet layer's recurrent state (conv + SSM), TP 1, in bytes."""
    return MambaSpec(shapes=_gdn_shapes(), dtypes=_gdn_dtypes(), block_size=-1).page_size_bytes


def _gdn_shapes():
    hf = Qwen3NextConfig()
    return MambaStateShapeCalculator.gated_delta_net_state_shape(
        1, hf.linear_num_key_heads, hf.linear_num_value_heads, hf.linear_key_head_dim,
        hf.linear_value_head_dim, hf.linear_conv_kernel_dim, 0)


def _gdn_dtypes():
    return MambaStateDtypeCalculator.gated_delta_net_state_dtype(torch.bfloat16, "auto", "auto")


def qwen3_next_block(shape: ModelShape) -> int:
    """vLLM's attention block size for Qwen3-Next: its page covers one recurrent state."""
    token_page = FullAttentionSpec(block_size=1, num_kv_heads=shape.kv_heads, head_size=shape.head_dim,
                                   dtype=getattr(torch, shape.dtype)).page_size_bytes
    return KERNEL_BLOCK * cdiv(gdn_state_bytes(), KERNEL_BLOCK * token_page)


def _qwen3_next_specs(shape: ModelShape) -> dict[str, KVCacheSpec]:
    hf = Qwen3NextConfig()
    assert (hf.num_hidden_layers, hf.num_key_value_heads, hf.head_dim) == (
        shape.layers, shape.kv_heads, shape.head_dim)
    block = qwen3_next_block(shape)
    attn = FullAttentionSpec(block_size=block, num_kv_heads=shape.kv_heads, head_size=shape.head_dim,
                             dtype=getattr(torch, shape.dtype))
    gdn = MambaSpec(shapes=_gdn_shapes(), dtypes=_gdn_dtypes(), block_size=block,
                    page_size_padded=attn.page_size_bytes, mamba_cache_mode="align", mamba_type="gdn_attention")
    return {f"model.layers.{i}." + ("self_attn.attn" if t == "full_attention" else "linear_attn"):
            attn if t == "full_attention" else gdn for i, t in enumerate(hf.layer_types)}


def layer_specs(name: str) -> dict[str, KVCacheSpec]:
    shape = model_shape(name)
    return _gpt_oss_specs(shape) if name == "gpt-oss-120b" else _qwen3_next_specs(shape)


def kv_cache_config(name: str, hma: bool = True, num_blocks: int = 8) -> tuple[VllmConfig, KVCacheConfig]:
    """vLLM's ``KVCacheConfig`` for ``name`` (hybrid allocator on, or off: one group), with
    the ``VllmConfig`` (the README's, its cache settings resolved for ``name``) it was built under."""
    vc = copy.deepcopy(vllm_config())
    vc.scheduler_config.disable_hybrid_kv_cache_manager = not hma
    specs = layer_specs(name)
    if any(isinstance(s, MambaSpec) for s in specs.values()):
        vc.cache_config.mamba_cache_mode = "align"
    layouts = [[m.name for m in get_supported_kv_cache_layouts([FlashAttentionBackend])]]
    resolve_kv_cache_layout(vc, layouts, specs.values())
    groups = get_kv_cache_groups(vc, specs)
    per_block = max(len(g.layer_names) * g.kv_cache_spec.page_size_bytes for g in groups)
    return vc, get_kv_cache_config_from_groups(vc, groups, num_blocks * per_block)


def offloading_config(name: str, hma: bool = True, primary_rows: int = 4) -> OffloadingConfig:
    """vLLM's ``build_offloading_config`` for ``name``, with the README's extra config but
    room for ``primary_rows`` chunks in the CPU tier."""
    cfg = build_offloading_config(*kv_cache_config(name, hma))
    row = cfg.worker_kv_bytes_per_block * cfg.cache.blocks_per_chunk
    extra = {**cfg.extra_config, "cpu_bytes_to_use": primary_rows * row}
    shape = model_shape(name)
    return dataclasses.replace(cfg, extra_config=extra,
                               model=OffloadingModelConfig(name=shape.hf, dtype=shape.dtype,
                                                           max_model_len=cfg.model.max_model_len))
