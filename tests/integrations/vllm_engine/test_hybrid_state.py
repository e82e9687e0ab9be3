"""A hybrid model in a real vLLM engine (vLLM's CPU build): Qwen3-Next's Gated DeltaNet
layers keep a recurrent state, its full-attention layer KV, and vLLM runs both KV cache
groups with its hybrid manager and Mamba ``align`` prefix caching.

vLLM sets the attention block to 96 tokens here (so that an attention page holds a
state) and keeps, per prompt, the state at its last block boundary. The connector saves
each state vLLM hands it and loads, for a hit, the full group's pages and the state at
the hit's end. Each warm run is compared, token ids and top-5 logprobs bit for bit,
with vLLM serving the same prompt from its own prefix cache with a hit of the same
length; a negative control shows that a state off by 1% is seen.
"""
from __future__ import annotations

import pytest
import torch

from tests.integrations.vllm_engine.checkpoint import write_checkpoint
from tests.integrations.vllm_engine.engine import Engine, prompt

from hicache.core.hashing import tokens_to_bytes as tokens_key

BLOCK = 96  # what vLLM makes of block 32 for this model (an attention page >= a state)


@pytest.fixture(scope="module")
def eng(tmp_path_factory):
    model = write_checkpoint(tmp_path_factory.mktemp("qwen3next"), "qwen3-next", seed=0)
    l3 = tmp_path_factory.mktemp("l3")
    e = Engine(str(model), {"storage": {"url": f"file://{l3}"}, "host_bytes": 64 << 20,
                            "admission": {"policy": "always_load"}}, dtype="bfloat16", max_batched=2 * BLOCK,
               mamba_cache_mode="align")
    assert [g.kind for g in e.scheduler.groups] == ["state", "state", "state", "full"]
    yield e
    e.check_integrity()


def _hit(e: Engine, prompts):
    e.settle()
    e.forget_own()
    return e.generate(prompts)


def test_a_state_and_its_pages_hit_equals_vllm_own_hit(eng):
    p = prompt(11, 7 * BLOCK + 20)  # vLLM keeps the state after 7 blocks
    cold = eng.generate([p])[0]
    eng.settle()
    assert [len(lane.items) for lane in eng.scheduler.lanes.values()] == [1, 1, 1]
    ref = eng.reference([p])[0]
    assert ref.cached == 7 * BLOCK and ref.tokens == cold.tokens
    before = eng.scheduler.stats()
    got = _hit(eng, [p])[0]
    after = eng.scheduler.stats()
    assert got.cached == 7 * BLOCK and after.hit_tokens["L2"] - before.hit_tokens["L2"] == 7 * BLOCK
    assert got == ref  # tokens and top-5 logprobs, bit for bit
    eng.check_integrity()


def test_another_continuation_of_the_prefix_hits_its_state(eng):
    p = prompt(12, 7 * BLOCK + 20)
    q = p[:7 * BLOCK] + prompt(13, 50)
    eng.generate([p])
    ref = eng.reference([q])[0]  # vLLM's own hit of q: its own state after 7 blocks
    eng.settle()
    eng.forget_own()
    eng.generate([p])  # the connector holds p's state (q's too, from the reference: the same bytes)
    got = _hit(eng, [q])[0]
    assert ref.cached == got.cached == 7 * BLOCK
    assert got == ref
    eng.check_integrity()


def test_no_state_at_the_shared_prefix_no_hit(eng):
    """A prompt sharing 5 blocks of pages whose only state is after 7: the floor leaves no hit
    (the attention pages alone would resume the linear layers from a wrong state); vLLM
    computes it whole, and its own state after 5 blocks is then kept for the next time."""
    p = prompt(15, 7 * BLOCK + 20)
    q = p[:5 * BLOCK + 30] + prompt(16, 60)
    eng.forget_own()
    eng.generate([p])
    eng.settle()
    full = eng.scheduler.core.cache.match(tokens_key(q[:5 * BLOCK]), "")
    assert full.host_tokens == 5 * BLOCK  # the full group holds q's first 5 pages
    before = eng.scheduler.stats().hit_tokens["L2"]
    cold = _hit(eng, [q])[0]
    assert cold.cached == 0 and eng.scheduler.stats().hit_tokens["L2"] == before
    again = _hit(eng, [q])[0]
    assert again.cached == 5 * BLOCK and again == eng.reference([q])[0]
    eng.check_integrity()


def test_negative_control_sees_a_state_off_by_a_hundredth(eng):
    p = prompt(14, 3 * BLOCK + 10)  # one state, after 3 blocks
    eng.generate([p])
    ref = eng.reference([p])[0]
    eng.settle()
    pools = [w.host_pool.buffer.view(torch.bfloat16) for g, w in eng.worker.workers.items() if g != 3]
    saved = [b.clone() for b in pools]
    for b in pools:
        b.mul_(1.01)
    try:
        got = _hit(eng, [p])[0]
    finally:
        for b, s in zip(pools, saved):
            b.copy_(s)
    assert got.cached == ref.cached == 3 * BLOCK
    assert got.logprobs != ref.logprobs
    eng.check_integrity()
