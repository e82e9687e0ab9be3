"""vLLM's scheduler path (RequestRunner: Scheduler + OffloadingConnector +
TieringOffloadingManager) with HiCacheTier under a CPU tier too small for the
working set: chunks stored by one request come back byte-exact for a later
request after vLLM's CPU tier (and GPU prefix cache) evicted them."""
from __future__ import annotations

import itertools

import pytest

from tests.v1.kv_connector.unit.utils import EOS_TOKEN_ID

from .runner import content, cycle, make_runner, prompt, settle, tiering

_ids = itertools.count()


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
    assert (s.stored, s.hits, s.misses) == (12, 4, 0)
    tier.check_integrity()
    tiering(runner).shutdown()


def test_without_the_tier_the_same_requests_recompute():
    runner = make_runner(None)
    cycle(runner, [1, 2, 3])
    runner.new_request(prompt(1, 4))
    runner.run(decoded_tokens=[EOS_TOKEN_ID], expected_stored=(0, 1, 2, 3))  # recomputed, stored again
    assert not runner.offloading_spec.handler.loaded
    tiering(runner).shutdown()
