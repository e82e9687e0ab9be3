"""vLLM's scheduler path (RequestRunner: Scheduler + OffloadingConnector +
TieringOffloadingManager) with HiCacheTier under a CPU tier too small for the
working set: chunks stored by one request come back byte-exact for a later
request after vLLM's CPU tier (and GPU prefix cache) evicted them."""
from __future__ import annotations

import itertools

import pytest
from vllm.v1.kv_offload.base import ScheduleEndContext
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

from tests.v1.kv_connector.unit.offloading_connector.utils import RequestRunner
from tests.v1.kv_connector.unit.utils import EOS_TOKEN_ID

from .runner import HiCacheRunnerSpec, content

BLOCK = 16
_ids = itertools.count()


def make_runner(url: str | None, prefix: str = "", cpu_chunks: int = 4, gpu_blocks: int = 8) -> RequestRunner:
    """RequestRunner over TieringOffloadingSpec with ``cpu_chunks`` primary slots (+ HiCacheTier at ``url``)."""
    tiers = [] if url is None else [{"type": "HiCacheTier", "module_path": "hicache.integrations.vllm",
                                     "url": url, "key_prefix": prefix, "probe_l3": False}]
    # RequestRunner's 128-byte chunks are padded to the region's alignment.
    cpu_bytes = cpu_chunks * TieringOffloadingSpec.BLOCK_SIZE_ALIGNMENT
    extra = {"spec_name": "HiCacheRunnerSpec", "spec_module_path": "tests.integrations.vllm.runner",
             "cpu_bytes_to_use": cpu_bytes, "secondary_tiers": tiers}
    runner = RequestRunner(block_size=BLOCK, num_gpu_blocks=gpu_blocks, async_scheduling=False,
                           extra_config_overrides=extra)
    assert isinstance(runner.offloading_spec, HiCacheRunnerSpec)
    assert tiering(runner).primary_tier.get_kv_memoryview().shape[0] == cpu_chunks
    return runner


def tiering(runner: RequestRunner):
    """vLLM's TieringOffloadingManager behind RequestRunner's MagicMock."""
    return runner.manager._mock_wraps


def settle(runner: RequestRunner) -> None:
    """The idle engine steps vLLM takes while ``has_pending_work()`` (RequestRunner
    stops at its own GPU<->CPU jobs): cascades finish and unpin their CPU slots."""
    manager = tiering(runner)
    for tier in manager.secondary_tiers:
        tier.drain_jobs()
    with manager.lock:
        for _ in range(2):  # a step polls the tiers at most once
            manager.on_schedule_end(ScheduleEndContext(new_req_ids=(), preempted_req_ids=()))
    assert not manager.has_pending_work()


def prompt(seed: int, blocks: int) -> list[int]:
    return [1000 * seed + i for i in range(blocks * BLOCK)]


def cycle(runner: RequestRunner, seeds: list[int], blocks: int = 4) -> None:
    for seed in seeds:
        runner.new_request(prompt(seed, blocks))
        runner.run(decoded_tokens=[EOS_TOKEN_ID], expected_stored=tuple(range(blocks)))
        settle(runner)


@pytest.fixture(params=["file", "redis"])
def url(request, tmp_path, redis_url):
    return f"file://{tmp_path}/l3" if request.param == "file" else redis_url


def test_evicted_chunks_come_back_byte_exact(url, request):
    runner = make_runner(url, f"vllm-runner:{request.node.name}:{next(_ids)}:")
    worker = runner.offloading_spec.handler
    runner.new_request(prompt(1, 4))
    runner.run(decoded_tokens=[EOS_TOKEN_ID], expected_stored=(0, 1, 2, 3))
    settle(runner)
    first = set(worker.stored)
    assert len(first) == 4
    cycle(runner, [2, 3])  # 8 more chunks: the CPU tier (4 slots) and the GPU cache drop request 1's

    runner.new_request(prompt(1, 4))
    runner.run(decoded_tokens=[EOS_TOKEN_ID], expected_loaded=(0, 1, 2, 3))
    assert set(worker.loaded) == first
    for key, got in worker.loaded.items():
        assert got == content(key, len(got)), f"chunk {key!r} came back with other bytes"
    (tier,) = tiering(runner).secondary_tiers
    s = tier.stats()
    assert (s.stored, s.loaded, s.load_missed) == (12, 4, 0)
    tier.check_integrity()


def test_without_the_tier_the_same_requests_recompute():
    runner = make_runner(None)
    cycle(runner, [1, 2, 3])
    runner.new_request(prompt(1, 4))
    runner.run(decoded_tokens=[EOS_TOKEN_ID], expected_stored=(0, 1, 2, 3))  # recomputed, stored again
    assert not runner.offloading_spec.handler.loaded
