"""vLLM's own ``TestTieringOffloadingManager`` (tests/v1/kv_offload/tiering/
test_tiering_offloading.py, 0.33.0, unchanged) with both secondary tiers
replaced by ``HiCacheTier`` over a real store (file:// and Redis).

vLLM wrote those tests for its in-memory ``ExampleSecondaryTierManager`` and
reaches into it in three ways; ``_ExampleFacingTier`` gives HiCacheTier the same
surface, backed by real L3 objects:
* ``tier.chunks[key] = True`` seeds "a chunk stored earlier": here it writes a
  real verified object for ``key`` to L3 and records it as known;
* ``tier.completed_jobs`` is the list of finished, unreported job results, and
  ``get_num_chunks()`` the number of chunks the tier holds;
* the tier-filter tests assume Example's CPU medium (HiCacheTier's is STORAGE);
* the tests assume a synchronous tier (a store finishes before the next step),
  so ``get_finished_jobs`` drains the pool first; the asynchronous behaviour
  itself is covered in test_tier.py.
Tiers are named ``example`` because the inherited assertions read metric labels
``"1:example"``; the tests' ``cache_hit_source`` patches on the Example class are
followed for the same reason.
"""
from __future__ import annotations

import itertools

import pytest
from vllm.v1.kv_offload.tiering.example.manager import ExampleSecondaryTierManager
from vllm.v1.kv_offload.tiering.manager import CPUPrimaryTierOffloadingManager, TieringOffloadingManager

from hicache.integrations.vllm import HiCacheTier, page_hash
from tests.v1.kv_offload.tiering import test_tiering_offloading as vllm_tests

from .tiers import spec

_ids = itertools.count()


class _Seeder:
    def __init__(self, tier: "_ExampleFacingTier"):
        self._tier = tier

    def __setitem__(self, key, present: bool) -> None:
        assert present is True, present
        t = self._tier
        payload = bytes(range(256)) * (t._row_bytes // 256 + 1)
        assert t.storage.put([(page_hash(key), payload[:t._row_bytes], t._sizes)]) == 1
        with t._lock:
            t._known.add([key])

    def __contains__(self, key) -> bool:
        return key in self._tier._known

    def __len__(self) -> int:
        return len(self._tier._known)


class _ExampleFacingTier(HiCacheTier):
    cache_hit_source = property(lambda self: ExampleSecondaryTierManager.cache_hit_source)
    medium = ExampleSecondaryTierManager.medium  # the tier-filter tests are written for a CPU medium

    def _sync(self) -> None:
        HiCacheTier.drain_jobs(self)  # not self.drain_jobs: some tests count calls to that

    @property
    def chunks(self) -> _Seeder:
        return _Seeder(self)

    def get_num_chunks(self) -> int:
        self._sync()
        return len(self._known)

    @property
    def completed_jobs(self) -> list:
        self._sync()
        return self._finished

    def get_finished_jobs(self):
        self._sync()
        return super().get_finished_jobs()


class TestHiCacheTieringOffloadingManager(vllm_tests.TestTieringOffloadingManager):
    @pytest.fixture(params=["file", "redis"])
    def manager_setup(self, request, tmp_path, redis_url):
        url = f"file://{tmp_path}/l3" if request.param == "file" else redis_url
        mock_region = vllm_tests._mock_mmap_region(5)
        self.primary_tier = CPUPrimaryTierOffloadingManager(num_chunks=5, mmap_region=mock_region)
        view = mock_region.create_kv_memoryview()
        run = f"vllm-tiering:{request.node.name}:{next(_ids)}"
        self.secondary_tier1, self.secondary_tier2 = (
            _ExampleFacingTier(offloading_spec=spec(), primary_kv_view=view, tier_type="example", url=url,
                               key_prefix=f"{run}:{i}:", probe_l3=False)
            for i in (1, 2))
        self.manager = TieringOffloadingManager(primary_tier=self.primary_tier,
                                                secondary_tiers=[self.secondary_tier1, self.secondary_tier2])
        yield
        for t in (self.secondary_tier1, self.secondary_tier2):
            t.drain_jobs()
            t.storage.check_integrity()
            t.storage.clear()
            t.shutdown()
