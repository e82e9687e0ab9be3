"""Layer-wise loads, and L3 hits from Redis, in a real vLLM engine.

The engine's connector loads L2 hits layer by layer inside the forward (each
layer waited for before its attention) and keeps its L3 in Redis (the suite's
``$REDIS_TEST_URL``, or a private ``redis-server``). Its L2 holds 12 pages, so
a prompt served before two others is gone from L2 but not from Redis: its next
hit comes from L3. Every warm run equals vLLM's own prefix hit of the same
length, bit for bit.
"""
from __future__ import annotations

import pytest

from tests.integrations.vllm_engine.checkpoint import write_checkpoint
from tests.integrations.vllm_engine.engine import BLOCK, Engine, prompt

PAGE_BYTES = 4 * 2 * 2 * 64 * 4 * BLOCK  # layers x (K, V) x KV heads x head dim x fp32 x tokens


@pytest.fixture(scope="module")
def eng(tmp_path_factory, redis_url):
    model = write_checkpoint(tmp_path_factory.mktemp("llama"), "llama-gqa", seed=1)
    e = Engine(str(model), {"load": "layerwise", "storage": {"url": redis_url}, "host_bytes": 12 * PAGE_BYTES})
    yield e
    e.check_integrity()


def test_layerwise_l2_hit_equals_vllm_own_hit(eng):
    p = prompt(21, 300)
    eng.generate([p])
    ref = eng.reference([p])[0]
    eng.settle()
    eng.forget_own()
    before = eng.scheduler.stats()
    got = eng.generate([p])[0]
    assert eng.scheduler.stats().hit_tokens["L2"] - before.hit_tokens["L2"] == 9 * BLOCK
    assert got == ref


def test_redis_l3_hit_after_l2_eviction_equals_vllm_own_hit(eng):
    first, others = prompt(22, 300), [prompt(23, 300), prompt(24, 300)]
    eng.generate([first])
    eng.settle()
    for p in others:  # 18 more pages through a 12-page L2: the first prompt's pages leave it
        eng.generate([p])
        eng.settle()
    eng.forget_own()
    before = eng.scheduler.stats()
    got = eng.generate([first])[0]
    after = eng.scheduler.stats()
    assert after.hit_tokens["L3"] - before.hit_tokens["L3"] >= 6 * BLOCK
    assert after.load_error_pages == before.load_error_pages and got.cached == 9 * BLOCK
    assert got == eng.reference([first])[0]
