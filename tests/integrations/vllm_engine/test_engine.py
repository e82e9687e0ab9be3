"""HiCacheConnector inside a real vLLM engine (vLLM's CPU build, CPU_ATTN, real forward passes).

One engine serves every scenario here (a Llama-shaped GQA checkpoint, fp32,
L3 on ``file://``). Each warm run is compared, token ids and top-5 logprobs
bit for bit, with vLLM serving the same prompt from its own prefix cache with a
hit of the same length; a negative control shows that a KV off by 0.1% is seen.
"""
from __future__ import annotations

import pytest
import torch

from tests.integrations.vllm_engine.checkpoint import write_checkpoint
from tests.integrations.vllm_engine.engine import BLOCK, Engine, prompt


@pytest.fixture(scope="module")
def eng(tmp_path_factory):
    model = write_checkpoint(tmp_path_factory.mktemp("llama"), "llama-gqa", seed=0)
    l3 = tmp_path_factory.mktemp("l3")
    # always_load: every scenario compares a hit of a known length (the cost model is checked below)
    e = Engine(str(model), {"storage": {"url": f"file://{l3}"}, "host_bytes": 96 << 20,
                            "admission": {"policy": "always_load"}}, max_batched=512)
    yield e
    e.check_integrity()


def _hit(e: Engine, prompts: list[list[int]]):
    """vLLM's own cache emptied, the prompts served with the connector's hit."""
    e.settle()
    e.forget_own()
    return e.generate(prompts)


def test_l2_hit_equals_vllm_own_hit(eng):
    p = prompt(1, 300)  # 9 full blocks + 12 tokens
    cold = eng.generate([p])[0]
    ref = eng.reference([p])[0]
    assert ref.cached == 9 * BLOCK and ref.tokens == cold.tokens
    before = eng.scheduler.stats()
    got = _hit(eng, [p])[0]
    after = eng.scheduler.stats()
    assert got.cached == 9 * BLOCK
    assert after.hit_tokens["L2"] - before.hit_tokens["L2"] == 9 * BLOCK
    assert got == ref  # tokens and top-5 logprobs, bit for bit
    eng.check_integrity()


def test_negative_control_sees_a_kv_off_by_a_thousandth(eng):
    """The comparison above can fail: the same L2 hit with every L2 value scaled by 1.001."""
    p = prompt(2, 300)
    eng.generate([p])
    ref = eng.reference([p])[0]
    eng.settle()
    host = eng.worker.host_pool.buffer.view(torch.float32)
    saved = host.clone()
    host.mul_(1.001)
    try:
        got = _hit(eng, [p])[0]
    finally:
        host.copy_(saved)
    assert got.cached == ref.cached == 9 * BLOCK
    assert got.logprobs != ref.logprobs


def test_concurrent_requests_share_a_prefix(eng):
    """8 requests at once over one 31-page prefix, each with its own tail inside the 32nd page:
    the first loads the 31 pages, the other 7 wait for that load and take vLLM's own blocks."""
    shared = prompt(3, 31 * BLOCK + 8)
    prompts = [shared + prompt(100 + i, 16) for i in range(8)]
    eng.generate([shared])  # the connector stores the prefix's 31 full pages
    eng.settle()
    loaded = eng.scheduler.stats().loaded_pages
    got = _hit(eng, prompts)
    assert eng.scheduler.stats().loaded_pages - loaded == 31  # one load, not 8
    eng.forget_own()
    eng.generate([shared])
    ref = eng.generate(prompts)  # vLLM's own hit of the same 31 pages
    assert [o.cached for o in got] == [31 * BLOCK] * 8
    assert got == ref
    eng.check_integrity()


def test_chunked_prefill_after_a_hit(eng):
    """A 1,400-token prompt in 512-token chunks: the hit, then three chunks computed."""
    p = prompt(4, 1400)
    eng.generate([p])
    ref = eng.reference([p])[0]
    got = _hit(eng, [p])[0]
    assert got.cached == ref.cached == 43 * BLOCK
    assert got == ref


def test_partial_hit_continues_vllm_own(eng):
    """vLLM holds the first 4 pages itself; the connector serves pages 5..9 after them."""
    p = prompt(5, 300)
    eng.generate([p])
    eng.settle()
    eng.forget_own()
    eng.generate([p[:4 * BLOCK + 1]])  # vLLM's own cache: 4 pages (the connector served them)
    before = eng.scheduler.stats().hit_tokens["L2"]
    got = eng.generate([p])[0]
    assert got.cached == 9 * BLOCK
    assert eng.scheduler.stats().hit_tokens["L2"] - before == 5 * BLOCK
    assert got == eng.reference([p])[0]


def test_cost_model_measures_vllms_forwards(eng):
    """The workers time vLLM's prefill-sized forwards; with the L2 loads measured too, the
    load-or-recompute choice for a hit is made on measured rates, not 'unmeasured'."""
    from hicache.tiers.cost import Choice, choose
    cost = eng.scheduler.cost
    eng.generate([prompt(6, 600)])
    inputs = cost.inputs()
    assert inputs.prefill_tokens_per_s and inputs.prefill_tokens_per_s > 0
    assert inputs.bandwidth.get("L2")  # from the L2 hits above
    assert choose(9 * BLOCK, 0, inputs).choice is not Choice.UNMEASURED


def test_a_running_request_is_reusable_before_it_ends(eng):
    """Pages are saved as they are computed: while a request decodes, its prompt's 9 full
    pages reach L2; aborted mid-decode, it leaves them for the next request over that prompt,
    whose hit equals vLLM's own."""
    from vllm import SamplingParams
    p = prompt(7, 300)
    eng.settle()
    before = eng.scheduler.stats().saved_pages
    core = eng.llm.llm_engine
    rid = core.add_request("runs-on", {"prompt_token_ids": p},
                           SamplingParams(max_tokens=400, temperature=0, ignore_eos=True))
    for _ in range(4):  # the prefill, then decodes: the step after the prefill saves its pages
        core.step()
    assert core.has_unfinished_requests()
    assert eng.scheduler.stats().saved_pages - before == 9
    core.abort_request([rid])
    while core.has_unfinished_requests():
        core.step()
    got = _hit(eng, [p])[0]
    assert got.cached == 9 * BLOCK
    assert got == eng.reference([p])[0]
    eng.check_integrity()


def test_an_abort_while_its_load_is_in_flight(eng):
    """A request aborted in the step its L2 load was planned in: vLLM frees its blocks only
    once the load is reported, nothing leaks, and the next request over the prompt hits."""
    from vllm import SamplingParams
    p = prompt(8, 300)
    eng.generate([p])
    eng.settle()
    eng.forget_own()
    core = eng.llm.llm_engine
    loads = eng.scheduler.stats().loaded_pages + eng.scheduler.stats().load_error_pages
    core.add_request("aborted-in-load", {"prompt_token_ids": p}, SamplingParams(max_tokens=4, temperature=0))
    core.step()  # the lookup, the allocation and the load's plan
    assert eng.scheduler.in_flight or eng.scheduler.stats().loaded_pages > loads
    core.abort_request(["aborted-in-load"])
    while core.has_unfinished_requests():
        core.step()
    eng.check_integrity()  # every job reported, L2 pins released
    stats = eng.scheduler.stats()
    assert stats.loaded_pages + stats.load_error_pages - loads == 9
    eng.forget_own()
    got = eng.generate([p])[0]
    assert got.cached == 9 * BLOCK
    assert got == eng.reference([p])[0]
