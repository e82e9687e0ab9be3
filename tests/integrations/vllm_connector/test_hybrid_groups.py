"""vLLM 0.33's hybrid KVCacheConfigs at real shapes (gpt-oss-120b: sliding window + full;
Qwen3-Next: Gated DeltaNet state + full) as the connector sees them (``engine_groups``),
and the floor every group resumes from."""
from __future__ import annotations

import pytest
import torch

from vllm.v1.kv_cache_interface import (FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, MambaSpec,
                                        SlidingWindowSpec)

from hicache.connector.groups import floor_hit
from hicache.core.errors import ConfigError
from hicache.core.groups import QWEN3_NEXT_LINEAR, gdn_state_bytes
from hicache.core.shapes import model_shape
from hicache.integrations.vllm_groups import engine_groups

BLOCK = 16


def gpt_oss_config(num_blocks: int = 64) -> KVCacheConfig:
    m = model_shape("gpt-oss-120b")
    kw = dict(block_size=BLOCK, num_kv_heads=m.kv_heads, head_size=m.head_dim, dtype=torch.bfloat16)
    swa = [f"model.layers.{i}.self_attn" for i in range(0, m.layers, 2)]
    full = [f"model.layers.{i}.self_attn" for i in range(1, m.layers, 2)]
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec(swa, SlidingWindowSpec(sliding_window=m.sliding_window, **kw)),
        KVCacheGroupSpec(full, FullAttentionSpec(**kw))])


def qwen3_next_config(mode: str = "align") -> KVCacheConfig:
    m = model_shape("qwen3-next-80b-a3b")
    lin = QWEN3_NEXT_LINEAR
    conv_dim = 2 * lin["num_k_heads"] * lin["k_dim"] + lin["num_v_heads"] * lin["v_dim"]
    shapes = ((lin["conv_kernel"] - 1, conv_dim), (lin["num_v_heads"], lin["k_dim"], lin["v_dim"]))
    state = MambaSpec(block_size=BLOCK, shapes=shapes, dtypes=(torch.bfloat16, torch.bfloat16),
                      mamba_cache_mode=mode)
    assert state.page_size_bytes == gdn_state_bytes(**lin, dtype_bytes=2)  # the shape hicache models
    every = m.full_attention_every
    full = [f"model.layers.{i}.self_attn" for i in range(every - 1, m.layers, every)]
    linear = [f"model.layers.{i}.linear_attn" for i in range(m.layers) if i % every != every - 1]
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=m.kv_heads, head_size=m.head_dim, dtype=torch.bfloat16)
    return KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec(full, spec), KVCacheGroupSpec(linear, state)])


def test_gpt_oss_groups_and_floor():
    swa, full = groups = engine_groups(gpt_oss_config())
    assert (swa.kind, swa.window, len(swa.layers)) == ("swa", 128, 18)
    assert (full.kind, len(full.layers), full.layers[0]) == ("full", 18, "model.layers.1.self_attn")
    n = 20
    held = [True] * n
    hole = [i != 15 for i in range(n)]  # the window of boundaries 16 .. 20 misses page 15
    hit = floor_hit(groups, BLOCK, 2, [hole, held])
    assert hit.end == 15 and hit.moves == (range(7, 15), range(2, 15))


def test_qwen3_next_groups_and_floor():
    full, state = groups = engine_groups(qwen3_next_config())
    assert (full.kind, len(full.layers), state.kind, len(state.layers)) == ("full", 12, "state", 36)
    n = 12
    snapshots = [i in (3, 7) for i in range(n)]  # states kept at boundaries 4 and 8
    hit = floor_hit(groups, BLOCK, 0, [[True] * n, snapshots])
    assert hit.end == 8 and hit.moves == (range(0, 8), range(7, 8))


def test_groups_the_connector_cannot_serve_are_named():
    with pytest.raises(ConfigError, match="group 1 is MambaSpec.*enable-prefix-caching"):
        engine_groups(qwen3_next_config("none"))
    cfg = gpt_oss_config()
    only_swa = KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=cfg.kv_cache_groups[:1])
    with pytest.raises(ConfigError, match="full-attention group"):
        engine_groups(only_swa)


def test_the_connector_names_the_hybrid_groups_it_refuses():
    from hicache.integrations.vllm_connector import layout_of
    from tests.integrations.vllm_connector.harness import connector_config
    with pytest.raises(ConfigError, match=r"2 KV cache groups \(0: swa, 1: full\).*disable-hybrid-kv-cache-manager"):
        layout_of(connector_config({}), gpt_oss_config())
    with pytest.raises(ConfigError, match=r"\(0: full, 1: state\)"):
        layout_of(connector_config({}), qwen3_next_config())
