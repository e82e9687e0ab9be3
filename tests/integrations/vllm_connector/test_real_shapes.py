"""Real model shapes (shared/shapes/real_models.json, every layer, vLLM's block 16) through
vLLM's scheduler: a store to L2 and L3, a load from L3 in a new engine, then from L2;
every layer's K and V (MLA: latent) bytes checked for every computed token."""
from __future__ import annotations

import pytest
import torch

from tests.integrations.vllm_connector.harness import BLOCK, Engine, real_shape, tokens
from tests.integrations.vllm_connector.test_scheduler_path import extra, finish_idle

SHAPES = [
    real_shape("opt-125m"),
    real_shape("llama-3.2-1b"),
    real_shape("llama-3.1-8b"),
    real_shape("qwen3-8b"),
    real_shape("qwen3-32b"),
    real_shape("llama-3.1-70b-tp8"),  # one TP rank's share: 1 KV head
    real_shape("deepseek-v3"),  # MLA: 512 latent + 64 rope
    real_shape("gpt-oss-120b"),  # every layer as full attention (vLLM without the hybrid manager)
    real_shape("llama-3.1-8b", torch.float8_e4m3fn),  # fp8 KV: raw bytes
]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s.name}-{str(s.dtype).removeprefix('torch.')}")
def test_real_shape_round_trip_through_l2_and_l3(shape, tmp_path):
    p = tokens(40, 3 * BLOCK + 1)
    first = Engine(extra(tmp_path), shape, num_blocks=8)
    first.add("r1", p)
    first.run()
    assert first.core.stats().stored_pages == 3
    finish_idle(first)
    eng = Engine(extra(tmp_path, load="layerwise"), shape, num_blocks=8)
    eng.add("r2", p)
    eng.run()
    eng.reset_vllm_prefix_cache()
    eng.add("r3", p[:2 * BLOCK] + tokens(41, 5))
    eng.run()
    assert eng.lookups == [("r2", 0, 3 * BLOCK, True), ("r3", 0, 2 * BLOCK, False)]
    s = eng.core.stats()
    assert s.hit_tokens == {"L2": 2 * BLOCK, "L3": 3 * BLOCK} and (s.loaded_pages, s.load_error_pages) == (5, 0)
    assert eng.checked_tokens >= 5 * BLOCK
    finish_idle(eng)
