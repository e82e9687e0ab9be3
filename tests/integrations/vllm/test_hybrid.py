"""HiCacheTier under vLLM's hybrid KV cache manager (issue 28, item 4), for the
hybrid rows of ``hicache/data/real_models.json`` grouped by vLLM's own code
(``hybrid.py``): gpt-oss-120b (a sliding-window group and a full-attention
group) and Qwen3-Next-80B-A3B (three Gated DeltaNet groups and a
full-attention group).

vLLM keys a chunk by (block hash, group): every group's chunk is a row of its
own, and vLLM's scheduler composes a prefix hit from one lookup per key. So
the tier starts at vLLM's per-group row bytes, round-trips every group's rows
byte-exact, answers a missing group's key as a miss, and through vLLM's own
scheduler a chunk whose sliding-window row is gone floors the hit to where
every group can resume; the grouping is in the fingerprint.
"""
from __future__ import annotations

import itertools
from unittest.mock import MagicMock

import numpy as np
import pytest
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.config import _group_kv_bytes_per_block
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler import OffloadingConnectorScheduler
from vllm.v1.core.kv_cache_utils import BlockHash
from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec, SlidingWindowSpec
from vllm.v1.kv_offload.base import (
    LookupResult,
    ReqContext,
    ScheduleEndContext,
    get_offload_group_idx,
    make_offload_key,
)
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

from hicache.integrations.vllm import page_hash, vllm_layout
from hicache.core.errors import ConfigError, IntegrityError
from hicache.integrations.vllm_groups import GroupLedger, KVGroup, kv_groups
from tests.v1.kv_connector.unit.utils import EOS_TOKEN_ID

from .hybrid import HYBRIDS, gdn_state_bytes, kv_cache_config, offloading_config
from .runner import content, cycle, make_runner, prompt, settle, tiering
from .tiers import finish, job, resolve

_ids = itertools.count(1)
BF16 = 2
# vLLM's groups as the tier sees them: (group id, layers, block tokens, window in chunks).
GROUPS = {
    "gpt-oss-120b": (KVGroup(0, 18, 16, 8), KVGroup(1, 18, 16, None)),  # window 128 = 8 blocks of 16
    "qwen3-next-80b-a3b": tuple(KVGroup(g, 12, 544, 1) for g in range(3)) + (KVGroup(3, 12, 544, None),),
}
ROW = {  # vLLM's bytes per block and group: layers x block x (K, V) x kv heads x head dim x bf16
    "gpt-oss-120b": 18 * 16 * 2 * 8 * 64 * BF16,
    "qwen3-next-80b-a3b": 12 * 544 * 2 * 2 * 256 * BF16,
}


@pytest.fixture(params=["file", "memory", "redis"])
def url(request, tmp_path, redis_url):
    return {"file": f"file://{tmp_path}/l3", "memory": "memory://", "redis": redis_url}[request.param]


def _start(name: str, url: str, primary_rows: int, **opts):
    """vLLM's TieringOffloadingSpec for ``name`` with one HiCacheTier at ``url``."""
    cfg = offloading_config(name, primary_rows=primary_rows)
    tier_cfg = {"type": "HiCacheTier", "module_path": "hicache.integrations.vllm", "url": url,
                "key_prefix": f"hicache-vllm-hybrid:{name}:{next(_ids)}:", "probe_l3": False,
                "timeout_ms": 5000, **opts}  # Qwen3-Next rows are 13 MB each
    spec_cfg = type(cfg)(**{**cfg.__dict__, "extra_config": {**cfg.extra_config, "secondary_tiers": [tier_cfg]}})
    manager = TieringOffloadingSpec(spec_cfg).get_manager()
    (tier,) = manager.secondary_tiers
    rows = np.frombuffer(manager.primary_tier.get_kv_memoryview(), dtype=np.uint8)
    return manager, tier, rows.reshape(-1, tier.block_size_bytes)[:, :ROW[name]]


@pytest.mark.parametrize("name", HYBRIDS)
def test_hybrid_models_start_at_vllms_per_group_row_bytes(name):
    _, kv = kv_cache_config(name)
    kinds = {type(g.kv_cache_spec) for g in kv.kv_cache_groups}
    assert kinds == ({SlidingWindowSpec, FullAttentionSpec} if name == "gpt-oss-120b" else {MambaSpec, FullAttentionSpec})
    # The hybrid allocator gives every group the same bytes per block: each group's row is the primary row.
    assert [_group_kv_bytes_per_block(g) for g in kv.kv_cache_groups] == [ROW[name]] * len(GROUPS[name])
    manager, tier, rows = _start(name, "memory://", primary_rows=2)
    try:
        assert tier.groups == GROUPS[name]
        assert tier._row_bytes == tier.layout.page_bytes == rows.shape[1] == ROW[name]
        assert offloading_config(name).worker_kv_bytes_per_block == ROW[name]
        if name == "qwen3-next-80b-a3b":
            # vLLM pads each recurrent state (conv 3 x 8192 + SSM 32 x 128 x 128, bf16) to the
            # 544-token attention page; the tier stores the row vLLM hands over, padding included.
            assert gdn_state_bytes() == (3 * 8192 + 32 * 128 * 128) * BF16 == 1_097_728
            assert ROW[name] == 12 * 1_114_112
        tier.check_integrity()
    finally:
        manager.shutdown()


def test_qwen3_next_needs_vllms_hybrid_allocator():
    """With the hybrid allocator off, vLLM itself refuses Qwen3-Next (recurrent and
    attention layers cannot share one group), so the tier only ever sees its groups."""
    with pytest.raises(ValueError, match="Failed to promote local KV cache specs"):
        kv_cache_config("qwen3-next-80b-a3b", hma=False)


def _keys(name: str, blocks: int) -> list:
    return [make_offload_key(f"{name}-block-{b}".encode(), g.group_id) for b in range(blocks) for g in GROUPS[name]]


@pytest.mark.parametrize("name", HYBRIDS)
def test_every_groups_rows_round_trip_byte_exact(name, url):
    ks = _keys(name, blocks=2)
    n = len(ks)
    manager, tier, rows = _start(name, url, primary_rows=n)
    try:
        rng = np.random.default_rng(n)
        rows[:] = rng.integers(0, 256, size=rows.shape, dtype=np.uint8)
        want = rows.copy()
        tier.submit_store(job(1, ks, list(range(n)), promotion=False))
        r = finish(tier)[1]
        assert r.success and r.transfer_bytes == n * ROW[name]
        rows[:] = 0
        tier.submit_load(job(2, ks, list(range(n))[::-1], promotion=True))  # every key into another row
        assert finish(tier)[2].success
        for i in range(n):
            assert np.array_equal(rows[n - 1 - i], want[i]), f"group {get_offload_group_idx(ks[i])} row changed"
        per_group = tier.group_stats()
        assert {g: (c.stored, c.loaded, c.load_missed) for g, c in per_group.items()} == {
            g.group_id: (2, 2, 0) for g in GROUPS[name]}
        tier.check_integrity()
    finally:
        manager.shutdown()


@pytest.mark.parametrize("name", HYBRIDS)
def test_a_block_with_one_group_missing_is_a_miss_for_that_group(name, tmp_path):
    """A second tier (another instance, or after a restart) over the same L3, which lost one
    group's object of block 1: that key misses, in lookups and in a promotion, and only it."""
    url = f"file://{tmp_path}/l3"
    ks = _keys(name, blocks=2)
    n, first, lost = len(ks), GROUPS[name][0].group_id, make_offload_key(f"{name}-block-1".encode(), 0)
    prefix = f"hicache-vllm-hybrid:{name}:{next(_ids)}:"
    manager, tier, rows = _start(name, url, primary_rows=n, key_prefix=prefix)
    try:
        rows[:] = np.random.default_rng(1).integers(0, 256, size=rows.shape, dtype=np.uint8)
        want = rows.copy()
        tier.submit_store(job(1, ks, list(range(n)), promotion=False))
        assert finish(tier)[1].success
        assert get_offload_group_idx(lost) == first and tier.storage.delete([page_hash(lost)]) == 1
    finally:
        manager.shutdown()
    manager, tier, rows = _start(name, url, primary_rows=n, key_prefix=prefix, probe_l3=True)
    try:
        ctx = ReqContext("r")
        assert {tier.lookup(k, ctx) for k in ks} == {LookupResult.RETRY}  # vLLM's async L3 probe runs
        assert [resolve(tier, k, ctx) for k in ks] == [
            LookupResult.MISS if k == lost else LookupResult.HIT for k in ks]
        rows[:] = 0
        tier.submit_load(job(2, ks, list(range(n)), promotion=True))
        r = finish(tier)[2]
        assert not r.success and set(r.successful_keys) == set(ks) - {lost}
        for i, k in enumerate(ks):
            assert np.array_equal(rows[i], want[i]) or k == lost
        assert tier.group_stats()[first].load_missed == 1
        assert sum(c.loaded for c in tier.group_stats().values()) == n - 1
        tier.check_integrity()
    finally:
        manager.shutdown()



def test_vllms_scheduler_floors_the_hit_where_every_group_can_resume(redis_url, request):
    """gpt-oss through vLLM's scheduler, connector and tiering manager: a 12-block prompt
    stores 12 chunks per group; after vLLM's CPU tier and GPU cache dropped them, the same
    prompt loads all 12 full-attention chunks and only the last window (8 chunks) of the
    sliding group, byte-exact. Once L3 loses the sliding row of block 10, the hit floors to
    10 blocks: the last complete window ends at block 9 (a chunk is a hit only if every
    group it needs is present)."""
    groups = kv_cache_config("gpt-oss-120b")[1].kv_cache_groups
    runner = make_runner(redis_url, f"vllm-hybrid-runner:{request.node.name}:{next(_ids)}:", cpu_chunks=24,
                         gpu_blocks=40, kv_cache_groups=groups)
    worker = runner.offloading_spec.handler
    (tier,) = tiering(runner).secondary_tiers
    runner.new_request(prompt(1, 12))
    hashes = list(runner.scheduler.requests[str(runner.req_id)].block_hashes)
    runner.run(decoded_tokens=[EOS_TOKEN_ID], expected_stored=tuple(range(12)))
    settle(runner)
    swa, full = 0, 1
    _evict_and_reload(runner, [2, 3], expect=[(full, b) for b in range(12)] + [(swa, b) for b in range(4, 12)])
    assert tier.storage.delete([page_hash(make_offload_key(hashes[10], swa))]) == 1
    # Blocks 10 and 11 are recomputed; vLLM's CPU tier holds every chunk but (swa, 10) from
    # the promotion that failed for that key alone, so that is the one chunk stored again.
    _evict_and_reload(runner, [4, 5], expect=[(full, b) for b in range(10)] + [(swa, b) for b in range(2, 10)],
                      stored=[(swa, 10)])
    where = {make_offload_key(h, g): (g, b) for b, h in enumerate(hashes) for g in (swa, full)}
    assert sorted(where[k] for k in worker.loaded) == sorted(
        [(full, b) for b in range(10)] + [(swa, b) for b in range(2, 10)])
    for key, got in worker.loaded.items():
        assert got == content(key, len(got)), f"chunk {where[key]} came back with other bytes"
    # The tier still believed it held the lost row (it answers from what it stored): the
    # promotion that asked for it failed for that key alone, and vLLM looked up again.
    per_group = tier.group_stats()
    assert (per_group[swa].load_missed, per_group[full].load_missed) == (1, 0)
    tier.check_integrity()
    tiering(runner).shutdown()


def _evict_and_reload(runner, others: list[int], expect: list[tuple[int, int]],
                      stored: list[tuple[int, int]] | None = None) -> None:
    cycle(runner, others, blocks=12)  # 2 x 24 chunks: vLLM's CPU tier (24) and GPU cache (40 blocks) drop prompt 1
    runner.offloading_spec.handler.loaded.clear()
    runner.new_request(prompt(1, 12))
    runner.run(decoded_tokens=[EOS_TOKEN_ID], expected_loaded=tuple(expect), expected_stored=tuple(stored or ()))
    settle(runner)


def test_fingerprints_differ_per_grouping():
    """The same model and row bytes, grouped differently, never share L3 objects."""
    def fp(cfg) -> str:
        return vllm_layout(cfg, cfg.worker_kv_bytes_per_block).fingerprint()

    hma, one = offloading_config("gpt-oss-120b"), offloading_config("gpt-oss-120b", hma=False)
    assert len(hma.groups) == 2 and len(one.groups) == 1
    wider = type(hma)(**{**hma.__dict__, "groups": (
        type(hma.groups[0])(**{**hma.groups[0].__dict__, "sliding_window_size_in_chunks": 16}), hma.groups[1])})
    swapped = type(hma)(**{**hma.__dict__, "groups": hma.groups[::-1]})
    prints = [fp(c) for c in (hma, one, wider, swapped)]
    assert len(set(prints)) == 4, prints
    assert fp(offloading_config("gpt-oss-120b")) == prints[0]  # and stable


def test_a_key_of_an_undeclared_group_is_refused():
    manager, tier, _ = _start("gpt-oss-120b", "memory://", primary_rows=2)
    try:
        with pytest.raises(ValueError, match=r"group\(s\) \[2\].*declared groups \[0, 1\]"):
            tier.submit_store(job(1, [make_offload_key(b"x", 2)], [0], promotion=False))
        assert tier.stats().store_jobs == 0
        tier.check_integrity()
    finally:
        manager.shutdown()


# (group, chunk) of the row the tier lacks -> vLLM's hit in tokens. Groups 0-2 are Gated
# DeltaNet (a state per chunk boundary, kept at chunks 0 and 2), group 3 full attention.
LOST_TO_HIT = {None: 3 * 544, (1, 0): 3 * 544, (0, 2): 544, (1, 2): 544, (2, 2): 544, (3, 2): 544, (3, 0): 0}


@pytest.mark.parametrize("lost", list(LOST_TO_HIT), ids=str)
def test_qwen3_next_hit_ends_at_the_last_boundary_every_group_holds(lost):
    """vLLM's connector scheduler over Qwen3-Next's real groups and a tiering manager whose
    only copy of the chunks is HiCacheTier (vLLM asks it one key at a time): a 3-chunk prompt
    (544-token blocks) hits all 3 chunks when the tier holds every full-attention chunk and
    each recurrent group's state at chunks 0 and 2; without any one group's row at chunk 2
    the hit falls back to chunk 0's end, the last boundary where every group holds its row;
    without full-attention chunk 0, nothing. A state missing at chunk 0 alone costs nothing."""
    name = "qwen3-next-80b-a3b"
    vc, kv = kv_cache_config(name)
    full, gdn = GROUPS[name][-1].group_id, [g.group_id for g in GROUPS[name][:-1]]
    blocks = [f"q3n-{i}".encode() for i in range(3)]
    rows_of = [(full, c) for c in range(3)] + [(g, c) for c in (0, 2) for g in gdn]
    held = [make_offload_key(blocks[c], g) for g, c in rows_of if (g, c) != lost]
    manager, tier, rows = _start(name, "memory://", primary_rows=len(held))
    try:
        rows[:] = np.random.default_rng(3).integers(0, 256, size=rows.shape, dtype=np.uint8)
        tier.submit_store(job(1, held, list(range(len(held))), promotion=False))
        assert finish(tier)[1].success
        scheduler = OffloadingConnectorScheduler(_Spec(manager, offloading_config(name)), vc, kv)
        request = _request(blocks, tokens=3 * 544 + 1)
        scheduler.on_new_request(request)
        state = scheduler._req_status[request.request_id]
        hit = _settled_lookup(scheduler, state, manager, tier)
        assert hit == LOST_TO_HIT[lost]
        tier.check_integrity()
    finally:
        manager.shutdown()


def _settled_lookup(scheduler, state, manager, tier) -> int:
    """vLLM's lookup, step after step: a chunk only the tier holds answers HIT_PENDING
    while vLLM promotes it into its CPU tier, so the hit is known once promotions land."""
    for _ in range(20):
        with manager.lock:
            state.update_offload_keys()
            hit = scheduler._lookup(state)
        if hit is not None:
            return hit
        tier.drain_jobs()
        with manager.lock:
            manager.on_schedule_end(ScheduleEndContext(new_req_ids=(), preempted_req_ids=()))
    raise AssertionError("vLLM's lookup still deferred after 20 steps")


class _Spec(TieringOffloadingSpec):
    """The spec whose manager (CPU tier + HiCacheTier) is already built."""

    def __init__(self, manager, config):
        super().__init__(config)
        self._manager = manager


def _request(block_hashes: list[bytes], tokens: int):
    """What vLLM's connector scheduler reads of a Request (as vLLM's own tests build it)."""
    request = MagicMock()
    request.request_id, request.kv_transfer_params, request.kv_hints = "r", None, None
    request.num_prompt_tokens = request.num_tokens = tokens
    request.block_hashes = [BlockHash(h) for h in block_hashes]
    request.all_token_ids = list(range(tokens))
    request.lora_request, request.skip_reading_prefix_cache = None, False
    request.is_finished.return_value = False
    return request


def test_groups_vllm_did_not_declare_distinctly_are_refused_at_start():
    cfg = offloading_config("gpt-oss-120b")
    for groups in ((), (cfg.groups[0], cfg.groups[0])):
        with pytest.raises(ConfigError, match="KV cache groups"):
            kv_groups(type(cfg)(**{**cfg.__dict__, "groups": groups}))


def test_group_counts_that_do_not_add_up_fail_the_check():
    ledger = GroupLedger(GROUPS["gpt-oss-120b"])
    ledger.stored([make_offload_key(b"a", 0), make_offload_key(b"b", 1)])
    ledger.loaded([make_offload_key(b"a", 0)], [make_offload_key(b"b", 1)])
    ledger.check(stored=2, loaded=1, load_missed=1)
    with pytest.raises(IntegrityError, match=r"add up to \(2, 1, 1\), the tier counted \(3, 1, 1\)"):
        ledger.check(stored=3, loaded=1, load_missed=1)
