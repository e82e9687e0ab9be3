"""vLLM loads HiCacheTier by itself from the documented configuration: its
SecondaryTierFactory (the checks of vLLM's tiering/test_factory.py, with
module_path pointing at hicache) and the whole TieringOffloadingSpec."""
from __future__ import annotations

import numpy as np
import pytest
from vllm.v1.kv_offload.tiering.base import SecondaryTierManager
from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

from hicache.integrations.vllm import HiCacheTier
from tests.v1.kv_offload.conftest import make_offloading_config

from .tiers import primary, spec

DOC = {"type": "HiCacheTier", "module_path": "hicache.integrations.vllm"}


def test_module_path_resolves_without_registration():
    assert "HiCacheTier" not in SecondaryTierFactory._registry
    cls = SecondaryTierFactory.get_tier_class(dict(DOC))
    assert cls is HiCacheTier and issubclass(cls, SecondaryTierManager)


def test_factory_creates_the_tier_with_its_extra_config(tmp_path):
    _, view = primary()
    cfg = {**DOC, "url": f"file://{tmp_path}/l3", "io_threads": 3, "probe_l3": False}
    t = SecondaryTierFactory.create_secondary_tier(cfg, view, spec())
    try:
        assert isinstance(t, HiCacheTier) and t.tier_type == "HiCacheTier"
        assert t.url == cfg["url"] and t._pool._max_workers == 3 and t._lookup is None
        assert cfg["type"] == "HiCacheTier"  # the factory copies; the user's dict is untouched
    finally:
        t.shutdown()


def test_factory_rejects_a_missing_url():
    _, view = primary()
    with pytest.raises(TypeError, match="url"):
        SecondaryTierFactory.create_secondary_tier(dict(DOC), view, spec())


def test_tiering_spec_builds_primary_and_hicache_tier(redis_url):
    """The documented kv_connector_extra_config, through vLLM's TieringOffloadingSpec."""
    extra = {"secondary_tiers": [{**DOC, "url": redis_url, "key_prefix": "hicache-vllm-spec-test:"}]}
    config = make_offloading_config(spec_name="TieringOffloadingSpec", cpu_bytes_to_use=1 << 20,
                                    worker_kv_bytes_per_block=4096, extra_config=extra)
    s = TieringOffloadingSpec(config)
    manager = s.get_manager()
    try:
        (tier,) = manager.secondary_tiers
        assert isinstance(tier, HiCacheTier)
        view = manager.primary_tier.get_kv_memoryview()
        assert tier.block_size_bytes == view.strides[0] and tier.layout.page_bytes == tier._row_bytes
        assert (tier.layout.model_id, tier.layout.kind) == ("vllm:test-model", "rows")
        assert '"model":"test-model"' in tier.layout.engine_layout
        assert dict(manager.config_info()[1])["hicache_fingerprint"] == tier.fingerprint
        np.frombuffer(view, dtype=np.int8)  # the primary view is the real shared region
        tier.check_integrity()
    finally:
        manager.shutdown()
