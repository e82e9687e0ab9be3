"""The README's ``vllm serve`` line, parsed by vLLM's own CLI parser, starts
``HiCacheTier`` through vLLM's config code for every model of
``hicache/data/real_models.json`` at vLLM's default block size (16) and chunking
(one block per chunk), at the row bytes vLLM computes for the model; chunks
round-trip byte-exact over file://, memory:// and redis://.

Hybrid models are described here as the shapes table describes them: gpt-oss's
sliding-window layers and Qwen3-Next's full-attention layers as full-attention
KV in one group; ``test_hybrid.py`` starts them as vLLM's hybrid allocator
groups them.
"""
from __future__ import annotations

import itertools

import numpy as np
import pytest
from vllm.config import KVTransferConfig
from vllm.v1.kv_offload.base import LookupResult, ReqContext
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

from hicache.integrations.vllm import HiCacheTier
from hicache.core.shapes import model_shape, model_shapes

from .real import BLOCK, kv_spec, offloading_config, serve_args, vllm_config
from .tiers import finish, job, keys

_ids = itertools.count(1)


def test_readme_serve_line_parses_to_the_hicache_tier():
    args = serve_args()
    assert args.subparser == "serve" and args.model_tag == "meta-llama/Llama-3.1-8B-Instruct"
    ktc = args.kv_transfer_config
    assert isinstance(ktc, KVTransferConfig) and ktc.kv_connector == "OffloadingConnector"
    (tier_cfg,) = ktc.kv_connector_extra_config["secondary_tiers"]
    assert tier_cfg == {"type": "HiCacheTier", "module_path": "hicache.integrations.vllm",
                        "url": "redis://127.0.0.1:6379/0"}
    assert vllm_config().kv_transfer_config.kv_connector_extra_config == ktc.kv_connector_extra_config
    shape = model_shape("llama-3.1-8b")
    manager = TieringOffloadingSpec(offloading_config(shape)).get_manager()
    try:
        (tier,) = manager.secondary_tiers
        assert isinstance(tier, HiCacheTier) and tier.url == "redis://127.0.0.1:6379/0"
        assert tier.layout.kind == "rows" and tier.layout.page_bytes == 2 << 20  # 32 layers x 64 KiB
        assert tier.layout.model_id == "vllm:meta-llama/Llama-3.1-8B-Instruct"
    finally:
        manager.shutdown()


@pytest.fixture(params=["file", "memory", "redis"])
def url(request, tmp_path, redis_url):
    return {"file": f"file://{tmp_path}/l3", "memory": "memory://", "redis": redis_url}[request.param]


@pytest.mark.parametrize("shape", model_shapes(), ids=lambda s: s.name)
def test_every_model_starts_and_round_trips_chunks(shape, url):
    cfg = offloading_config(shape)
    (tier_cfg,) = cfg.extra_config["secondary_tiers"]
    prefix = f"hicache-vllm-shapes:{shape.name}:{next(_ids)}:"
    extra = {**cfg.extra_config, "secondary_tiers": [{**tier_cfg, "url": url, "key_prefix": prefix,
                                                        "probe_l3": False}]}
    manager = TieringOffloadingSpec(type(cfg)(**{**cfg.__dict__, "extra_config": extra})).get_manager()
    try:
        (tier,) = manager.secondary_tiers
        row = kv_spec(shape).page_size_bytes * (shape.attention_layers + shape.draft_layers)
        assert cfg.worker_kv_bytes_per_block == row == shape.page_bytes(BLOCK)  # vLLM's figure, the table's
        assert tier.layout.page_bytes == tier._row_bytes == row
        assert shape.hf in tier.layout.engine_layout
        arr = np.frombuffer(manager.primary_tier.get_kv_memoryview(), dtype=np.uint8)
        arr = arr.reshape(-1, tier.block_size_bytes)[:, :row]
        assert arr.shape[0] == 4
        rng = np.random.default_rng(row)
        arr[:3] = rng.integers(0, 256, size=(3, row), dtype=np.uint8)
        want = arr[:3].copy()
        ks = keys(1, 2, 3)
        tier.submit_store(job(1, ks, [0, 1, 2], promotion=False))
        r = finish(tier)[1]
        assert r.success and r.transfer_bytes == 3 * row
        arr[:] = 0
        tier.submit_load(job(2, ks[::-1], [3, 1, 0], promotion=True))
        assert finish(tier)[2].success
        assert all(np.array_equal(arr[r], want[i]) for r, i in ((3, 2), (1, 1), (0, 0)))
        assert not arr[2].any()
        assert tier.lookup(ks[0], ReqContext("q")) is LookupResult.HIT
        s = tier.stats()
        assert (s.stored, s.hits, s.bytes_read, s.corrupt, s.foreign) == (3, 3, 3 * row, 0, 0)
        tier.check_integrity()
    finally:
        manager.shutdown()
