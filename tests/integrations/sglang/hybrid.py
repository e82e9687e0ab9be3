"""SGLang's hybrid cache stacks on CPU, built from SGLang's own classes the way
``hybrid_pool_assembler`` builds them (``build_hybrid_swa_group`` for SWA,
``build_hybrid_mamba_stack`` for Mamba), at the real shapes of the table:

* gpt-oss-120b: 36 layers, sliding (128 tokens) on even layers and full on odd
  (``hicache.core.groups.hybrid_groups``): a full-attention KV anchor pool of 18
  layers and an ``swa`` pool of 18 layers, 8 KV heads of 64 (bf16);
* qwen3-next-80b-a3b: SGLang's ``Qwen3NextConfig`` (its defaults are the 80B
  model's; ``full_attention_interval`` 4 from its config.json): a KV anchor of
  its 12 full-attention layers (2 KV heads of 256) and a ``mamba`` pool of its
  36 Gated DeltaNet layers' state (``mamba2_cache_params``: temporal
  [32, 128, 128] float32 and conv [8192, 3] bfloat16 per layer, 73.7 MiB a
  slot) at TP 1.

Every layer is there: nothing is cut. What is not SGLang's own here: the
scheduler (the test does what it does between the controller's threads) and
the token allocator, a ``PagedTokenToKVPoolAllocator`` over the full pool (the
storage paths never touch device memory).
"""
from __future__ import annotations

import threading

import torch
from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
from sglang.srt.mem_cache.hicache_storage import PoolName
from sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler import build_pool_entry
from sglang.srt.mem_cache.memory_pool import MambaPool, MHATokenToKVPool
from sglang.srt.mem_cache.pool_host.group import HostPoolGroup
from sglang.srt.mem_cache.pool_host.mamba import MambaPoolHost
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
from sglang.srt.runtime_context import get_parallel

from hicache.core.groups import hybrid_groups
from hicache.core.shapes import model_shape

from .conftest import dynamic_config

GPT_OSS, QWEN3_NEXT = "gpt-oss-120b", "qwen3-next-80b-a3b"
DTYPES = {"bfloat16": torch.bfloat16}


def parallel():
    """SGLang's parallel context for TP rank 0 of 1 (Qwen3NextConfig reads the linear-attention TP size)."""
    return get_parallel().override(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_dcp_size=1, attn_dcp_rank=0,
                                   attn_tp_size=1, enable_cp_tp_group_sharing=False)


def fill(tensors, seed: int) -> None:
    """Random bytes in every host buffer (bf16 NaN patterns included: compare bytes)."""
    gen = torch.Generator().manual_seed(seed)
    for t in tensors:
        raw = t.view(-1).view(torch.uint8)
        raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=gen))


def mha_pair(layers: int, page: int, dev_pages: int, layout: str, heads: int, head_dim: int, dtype):
    dev = MHATokenToKVPool(dev_pages * page, page, dtype, heads, head_dim, layers, "cpu", False,
                           start_layer=0, end_layer=layers)
    info = dev.get_device_pool_infos()[0].buffer_info
    host = MHATokenToKVPoolHost(info, 2.0, 0, page, layout, pin_memory=False, device_capacity_tokens=dev.size,
                                start_layer=0, end_layer=layers)
    fill([host.kv_buffer], seed=layers * 100 + page)
    return dev, host


def gpt_oss_group(page: int, layout: str, dev_pages: int = 24):
    """(HostPoolGroup, full device pool) of gpt-oss-120b: KV anchor (full layers) + ``swa``."""
    m = model_shape(GPT_OSS)
    swa_g, full_g = hybrid_groups(m)
    assert (swa_g.kind, full_g.kind, swa_g.window) == ("swa", "full", 128)
    args = (page, dev_pages, layout, m.kv_heads_per_rank, m.head_dim, DTYPES[m.dtype])
    full_dev, full_host = mha_pair(len(full_g.layers), *args)
    swa_dev, swa_host = mha_pair(len(swa_g.layers), *args)
    fill([swa_host.kv_buffer], seed=7)
    group = HostPoolGroup([
        build_pool_entry(name=PoolName.KV, host_pool=full_host, device_pool=full_dev, is_anchor=True,
                         layer_mapping={layer: i for i, layer in enumerate(full_g.layers)},
                         transfer_layer_id_max=m.layers),
        build_pool_entry(name=PoolName.SWA, host_pool=swa_host, device_pool=swa_dev,
                         layer_mapping={layer: i for i, layer in enumerate(swa_g.layers)},
                         transfer_layer_id_max=m.layers),
    ])
    return group, full_dev


def qwen3_next_group(page: int, layout: str, dev_pages: int = 8, mamba_slots: int = 2):
    """(HostPoolGroup, full device pool) of qwen3-next-80b-a3b: KV anchor + ``mamba``."""
    from sglang.srt.configs.qwen3_next import Qwen3NextConfig
    m = model_shape(QWEN3_NEXT)
    with parallel():
        cfg = Qwen3NextConfig(full_attention_interval=m.full_attention_every)
        params = cfg.mamba2_cache_params
        full_ids = cfg.full_attention_layer_ids
    assert (len(full_ids), len(params.layers)) == (m.attention_layers, m.layers - m.attention_layers)
    full_dev, full_host = mha_pair(len(full_ids), page, dev_pages, layout, m.kv_heads_per_rank, m.head_dim,
                                   DTYPES[m.dtype])
    mamba_dev = MambaPool(size=mamba_slots, spec_state_size=0, cache_params=params,
                          mamba_layer_ids=list(params.layers), device="cpu")
    (info,) = mamba_dev.get_device_pool_infos()
    mamba_host = MambaPoolHost(info.buffer_info, 2.0, 0, device_capacity=mamba_dev.size, pin_memory=False,
                               layout=layout)
    fill(mamba_host.kv_buffer, seed=11)
    group = HostPoolGroup([
        build_pool_entry(name=PoolName.KV, host_pool=full_host, device_pool=full_dev, is_anchor=True,
                         layer_mapping={layer: i for i, layer in enumerate(full_ids)},
                         transfer_layer_id_max=m.layers),
        build_pool_entry(name=PoolName.MAMBA, host_pool=mamba_host, device_pool=mamba_dev,
                         layer_mapping={layer: i for i, layer in enumerate(params.layers)},
                         transfer_layer_id_max=m.layers),
    ])
    return group, full_dev


def hybrid_controller(group: HostPoolGroup, full_dev, page: int, url: str, model: str, layers: int, **extra):
    """SGLang's HybridCacheController over ``group`` with the hicache backend attached."""
    from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import HybridCacheController
    alloc = PagedTokenToKVPoolAllocator(full_dev.size, page, full_dev.dtype, "cpu", full_dev, False)
    with parallel():
        return HybridCacheController(alloc, group, page, None, threading.Event(), storage_backend="dynamic",
                                     model_name=model, storage_backend_extra_config=dynamic_config(url, **extra),
                                     transfer_layer_id_max=layers)
