"""Draft planes (invariant 5): hits are served only where target and draft planes are
both present; the speculative engine's accept lengths are the same warm and cold on
every tier, and change when target planes are restored without their draft planes."""
from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

from hicache.core.config import HiCacheConfig
from hicache.reference.engine import Engine
from hicache.reference.model import ReferenceModel
from hicache.reference.model_spec import ModelSpec
from hicache.core.errors import IntegrityError
from hicache.cache.hicache import HiCache

SPECS = {
    "mha": ModelSpec(vocab=97, hidden=32, num_layers=2, num_q_heads=4, mlp=48, kind="mha",
                     num_kv_heads=2, head_dim=8, seed=3),
    "mla": ModelSpec(vocab=97, hidden=32, num_layers=2, num_q_heads=4, mlp=48, kind="mla", num_kv_heads=0,
                     head_dim=0, kv_lora_rank=12, rope_dim=4, qk_nope_dim=8, v_head_dim=8, seed=3),
}
NEW = 16


@pytest.fixture(scope="module")
def models():
    return {k: ReferenceModel(s) for k, s in SPECS.items()}


def make_cache(spec, url="", host_layout="page_first"):
    cfg = HiCacheConfig.load(env={}, overrides={
        "storage.url": url, "pool.device_pages": "64", "pool.host_pages": "128",
        "policy.prefetch_policy": "wait_complete", "pool.device": "cpu"})
    return HiCache(cfg, layout=spec.kv_layout(4, host_layout, draft_layers=1))


def serve(engine, rid, prompt, new=NEW):
    item = SimpleNamespace(rid=rid, arrival=0.0, max_new_tokens=new, namespace="")
    return engine.run([item], lambda it, res: prompt).results[rid]


def prompt_of(seed=5, n=37):
    return torch.randint(1, 97, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def draft_planes(hc):
    return [hc.device_pool.buffers[s.index] for s in hc.layout.planes if s.draft]


@pytest.mark.parametrize("kind,host_layout", [("mha", "page_first"), ("mla", "layer_first")])
def test_accept_length_warm_equals_cold_on_every_tier(models, kind, host_layout, tmp_path):
    spec, model, prompt = SPECS[kind], models[kind], prompt_of()
    cold_hc = make_cache(spec)
    cold_eng = Engine(cold_hc, model, chunk_tokens=8)
    run = cold_eng.run([SimpleNamespace(rid="cold", arrival=0.0, max_new_tokens=NEW, namespace="")],
                       lambda it, res: prompt)
    cold = run.results["cold"]
    assert run.mean_accept_length() == sum(cold.accept_lengths) / len(cold.accept_lengths)
    plain = serve(Engine(cold_hc, model, chunk_tokens=8, use_draft=False), "plain", prompt)
    cold_hc.close()
    assert cold.accept_lengths and max(cold.accept_lengths) > 0
    assert plain.accept_lengths == [] and plain.output == cold.output  # speculation keeps greedy tokens

    hc = make_cache(spec, f"file://{tmp_path}/l3", host_layout)
    eng = Engine(hc, model, chunk_tokens=8)
    first = serve(eng, "first", prompt)
    assert (first.output, first.accept_lengths) == (cold.output, cold.accept_lengths)
    l1 = serve(eng, "l1", prompt)
    assert (l1.device_hit, l1.computed) == (36, 1)
    assert (l1.output, l1.accept_lengths) == (cold.output, cold.accept_lengths)
    hc.drain()
    hc.evict(10_000)
    hc.check_integrity()
    l2 = serve(eng, "l2", prompt)
    assert (l2.device_hit, l2.host_hit, l2.storage_hit) == (0, 36, 0)
    assert (l2.output, l2.accept_lengths) == (cold.output, cold.accept_lengths)
    hc.drain()
    hc.evict(10_000)
    hc.evict_host(10_000)
    l3 = serve(eng, "l3", prompt)
    assert (l3.device_hit, l3.host_hit, l3.storage_hit) == (0, 36, 36)
    assert (l3.output, l3.accept_lengths) == (cold.output, cold.accept_lengths)
    assert hc.cache.stats().draft_truncated_hits == 0
    hc.check_integrity()
    hc.close()


def test_target_without_draft_planes_changes_accept_length(models):
    """The failure mode: a restore that brings target planes back but not draft planes."""
    spec, model, prompt = SPECS["mha"], models["mha"], prompt_of()
    hc = make_cache(spec)
    eng = Engine(hc, model, chunk_tokens=8)
    cold = serve(eng, "cold", prompt)
    m = hc.cache.match(prompt)
    assert m.device_tokens == 36
    rows = hc.device_pool.slot_ids(m.device_pages)
    for b in draft_planes(hc):
        b[rows] = 0  # target planes intact, draft planes missing
    warm = serve(eng, "warm", prompt)
    assert warm.device_hit == 36 and warm.output == cold.output  # the target still verifies...
    assert warm.accept_lengths != cold.accept_lengths  # ...but speculation silently degrades
    hc.close()


def test_pages_without_draft_rows_truncate_the_hit(models, caplog):
    spec, model, prompt = SPECS["mha"], models["mha"], prompt_of()
    cold_hc = make_cache(spec)
    cold = serve(Engine(cold_hc, model, chunk_tokens=8), "cold", prompt)
    cold_hc.close()

    hc = make_cache(spec)
    spec_eng = Engine(hc, model, chunk_tokens=8)
    plain_eng = Engine(hc, model, chunk_tokens=8, use_draft=False)
    serve(spec_eng, "head", prompt[:21], new=1)  # pages 0-4 with draft rows (row 20 pending)
    serve(plain_eng, "plain", prompt)  # pages 5-8 and beyond without
    hc.check_integrity()
    caplog.set_level(logging.WARNING, logger="hicache.index.prefix_cache")
    warm = serve(spec_eng, "warm", prompt)
    assert (warm.device_hit, warm.host_hit) == (20, 0)  # the common draft-complete prefix
    assert (warm.output, warm.accept_lengths) == (cold.output, cold.accept_lengths)
    s = hc.cache.stats()
    assert (s.draft_truncated_hits, s.draft_truncated_tokens) == (1, 16)
    assert s.draft_upgraded_pages == 4  # warm supplied the draft rows of pages 5-8
    again = serve(spec_eng, "again", prompt)  # now every page is complete
    assert again.device_hit == 36 and again.accept_lengths == cold.accept_lengths
    other = prompt_of(9)
    serve(plain_eng, "plain2", other)
    serve(spec_eng, "warm2", other)  # truncated again, same cause
    s = hc.cache.stats()
    assert s.draft_truncated_hits == 2
    warnings = [r for r in caplog.records if "draft planes missing on L1" in r.getMessage()]
    assert len(warnings) == 1  # one warning per cause, not per page or per hit
    hc.check_integrity()
    hc.close()


def test_l2_copy_without_draft_truncates_and_skips_l3(models, tmp_path):
    spec, model, prompt = SPECS["mha"], models["mha"], prompt_of()
    hc = make_cache(spec, f"file://{tmp_path}/l3")
    serve(Engine(hc, model, chunk_tokens=8, use_draft=False), "plain", prompt)
    hc.drain()
    assert hc.tier_stats.backup_pages > 0 and hc.tier_stats.storage_put_pages == 0
    assert hc.tier_stats.storage_put_skipped_draft_pages == hc.tier_stats.backup_pages
    hc.evict(10_000)
    m = hc.cache.match(prompt, need_draft=True)
    assert (m.tokens, m.draft_cut, m.draft_cut_tokens) == (0, 2, 36)
    assert hc.cache.match(prompt).host_tokens == 36  # a non-draft engine may still use them
    hc.check_integrity()
    hc.close()


def test_integrity_catches_a_draft_request_on_incomplete_pages(models):
    spec, model, prompt = SPECS["mha"], models["mha"], prompt_of()
    hc = make_cache(spec)
    serve(Engine(hc, model, chunk_tokens=8), "a", prompt)
    req = hc.new_request("b", prompt)
    hc.admit(req)
    hc.check_integrity()
    node = req.node.parent
    node.draft_device = False  # as if its draft rows had never been written
    with pytest.raises(IntegrityError, match="draft planes are incomplete"):
        hc.check_integrity()
    node.draft_device = True
    req.abort()
    hc.drain()
    hc.evict(10_000)
    n = next(hc.cache.nodes())
    n.draft_device = True  # a flag for a tier the node is not on
    with pytest.raises(IntegrityError, match="draft_device set but the node is not on L1"):
        hc.check_integrity()
    hc.close()
