"""Value-level proof: a cache hit on any tier reproduces the logits that
recomputation produces, bit for bit (float32, CPU), and a corrupted page is caught
by the comparison (the check can fail)."""
from types import SimpleNamespace

import pytest
import torch

from hicache.core.config import HiCacheConfig
from hicache.reference.engine import Engine
from hicache.reference.model import ReferenceModel
from hicache.reference.model_spec import ModelSpec
from hicache.cache.hicache import HiCache

@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Bit-exact comparisons need one reduction order: a fixed intra-op thread
    count (many-core machines otherwise split reductions differently)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


SPECS = {
    "mha": ModelSpec(vocab=97, hidden=32, num_layers=2, num_q_heads=4, mlp=48, kind="mha",
                     num_kv_heads=2, head_dim=8, seed=3),
    "mla": ModelSpec(vocab=97, hidden=32, num_layers=2, num_q_heads=4, mlp=48, kind="mla",
                     num_kv_heads=0, head_dim=0, kv_lora_rank=12, rope_dim=4, qk_nope_dim=8, v_head_dim=8, seed=3),
}


def make_cache(spec, tmp_path, url, host_layout="page_first", page_size=4):
    layout = spec.kv_layout(page_size, host_layout)
    cfg = HiCacheConfig.load(env={}, overrides={
        "storage.url": url, "pool.device_pages": "64", "pool.host_pages": "128",
        "policy.prefetch_policy": "wait_complete", "pool.device": "cpu"})
    return HiCache(cfg, layout=layout)


def serve(engine, rid, prompt, new=3):
    item = SimpleNamespace(rid=rid, arrival=0.0, max_new_tokens=new, namespace="")
    run = engine.run([item], lambda it, res: prompt)
    return run.results[rid]


@pytest.mark.parametrize("kind", ["mha", "mla"])
@pytest.mark.parametrize("host_layout", ["page_first", "layer_first"])
def test_warm_equals_cold_on_every_tier(kind, host_layout, tmp_path):
    spec = SPECS[kind]
    model = ReferenceModel(spec)
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(1, spec.vocab, (37,), generator=g).tolist()  # 9 pages + 1 token

    cold_cache = make_cache(spec, tmp_path, "")
    cold = serve(Engine(cold_cache, model, chunk_tokens=8, keep_logits=True), "cold", prompt)
    cold_cache.close()

    hc = make_cache(spec, tmp_path, f"file://{tmp_path}/l3", host_layout)
    eng = Engine(hc, model, chunk_tokens=8, keep_logits=True)
    first = serve(eng, "first", prompt)
    assert first.device_hit == 0 and torch.equal(first.last_logits, cold.last_logits)

    l1 = serve(eng, "l1", prompt)
    assert l1.device_hit == 36 and l1.computed == 1
    assert torch.equal(l1.last_logits, cold.last_logits) and l1.output == cold.output

    hc.drain()
    hc.evict(10_000)
    hc.check_integrity()
    l2 = serve(eng, "l2", prompt)
    assert (l2.device_hit, l2.host_hit, l2.storage_hit) == (0, 36, 0)
    assert torch.equal(l2.last_logits, cold.last_logits) and l2.output == cold.output

    hc.drain()
    hc.evict(10_000)
    hc.evict_host(10_000)
    hc.check_integrity()
    l3 = serve(eng, "l3", prompt)
    assert (l3.device_hit, l3.host_hit, l3.storage_hit) == (0, 36, 36)
    assert torch.equal(l3.last_logits, cold.last_logits) and l3.output == cold.output
    hc.check_integrity()
    hc.close()


def test_corrupted_page_changes_logits(tmp_path):
    spec = SPECS["mha"]
    model = ReferenceModel(spec)
    prompt = list(range(5, 42))
    hc = make_cache(spec, tmp_path, "")
    eng = Engine(hc, model, chunk_tokens=8, keep_logits=True)
    cold = serve(eng, "cold", prompt)
    m = hc.cache.match(prompt)
    assert m.device_tokens == 36
    k0 = hc.device_pool.plane("k", 0)
    slot = m.device_pages[3] * 4 + 1
    k0[slot, 0, 0] += 1.0  # one value of one cached page
    warm = serve(eng, "warm", prompt)
    assert warm.device_hit == 36
    assert not torch.equal(warm.last_logits, cold.last_logits)
    hc.close()
