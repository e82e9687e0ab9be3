"""HiCacheConnector through vLLM's own scheduler: stores, floored hits beyond vLLM's
own prefix cache, byte-exact loads from L2 and L3 (``harness.Engine`` checks every
computed token's bytes in every forward), chunked prefill, the cost model."""
from __future__ import annotations

import pickle

import pytest

from hicache.memory.paged_kv import VLLM_LAYOUTS
from tests.integrations.vllm_connector.harness import BLOCK, TOY, TOY_MLA, Engine, host_pins, tokens


def extra(tmp_path=None, load="async", host_pages=64, **sections):
    url = "" if tmp_path is None else f"file://{tmp_path}/l3"
    return {"load": load, "pool": {"host_pages": host_pages}, "storage": {"url": url}, **sections}


def finish_idle(eng: Engine) -> None:
    assert eng.core.in_flight == 0 and host_pins(eng) == 0
    eng.check_integrity()
    eng.close()


@pytest.mark.parametrize("load", ["async", "layerwise"])
def test_store_then_floored_hit_loads_exact(load):
    eng = Engine(extra(load=load))
    p = tokens(1, 5 * BLOCK + 3)
    eng.add("r1", p)
    eng.run()
    s = eng.core.stats()
    # r1 computed its 83 prompt tokens and 1 of its 2 generated: 5 full pages reach L2.
    assert s.saved_pages == 5 and s.save_dropped_pages == 0
    eng.reset_vllm_prefix_cache()
    q = p[:4 * BLOCK + 5] + tokens(2, 20)  # shares 4 whole pages and 5 tokens of the fifth
    eng.add("r2", q)
    plans = []
    eng.run(between=lambda so: plans.append(so.kv_connector_metadata))
    # What crosses to the workers is plain data: it survives pickling (vLLM's executors) unchanged.
    loads = [m for m in plans if m.plan.loads]
    assert len(loads) == 1 and pickle.loads(pickle.dumps(loads[0])) == loads[0]
    assert loads[0].plan.loads[0].host == (0, 1, 2, 3) and len(loads[0].plan.loads[0].blocks) == 4
    assert eng.lookups[-1] == ("r2", 0, 4 * BLOCK, load == "async")
    s = eng.core.stats()
    assert s.loaded_pages == 4 and s.load_error_pages == 0 and s.hit_tokens["L2"] == 4 * BLOCK
    assert eng.checked_tokens > 4 * BLOCK
    finish_idle(eng)


def test_full_prompt_hit_leaves_one_token_to_compute():
    eng = Engine(extra())
    p = tokens(3, 4 * BLOCK)
    eng.add("r1", p)
    eng.run()
    eng.reset_vllm_prefix_cache()
    eng.add("r2", p)
    eng.run()
    assert eng.lookups[-1] == ("r2", 0, 3 * BLOCK, True)  # the last page holds the token vLLM must compute
    finish_idle(eng)


def test_hit_beside_vllms_own_prefix_hit():
    eng = Engine(extra(), num_blocks=16, tokens_per_step=256)
    p = tokens(4, 8 * BLOCK + 3)
    eng.add("r1", p)
    eng.run()
    eng.add("filler", tokens(5, 10 * BLOCK - 4))  # evicts r1's tail blocks from vLLM's prefix cache
    eng.run()
    eng.add("r2", p[:8 * BLOCK] + tokens(6, 7))
    eng.run()
    rid, local, hit, _ = eng.lookups[-1]
    assert rid == "r2" and local > 0 and hit > 0 and local + hit == 8 * BLOCK, eng.lookups
    assert eng.core.stats().loaded_pages == hit // BLOCK
    finish_idle(eng)


def test_hit_from_l3_in_a_new_engine_then_from_l2(tmp_path):
    p = tokens(7, 6 * BLOCK + 1)
    first = Engine(extra(tmp_path, load="layerwise"))
    first.add("r1", p)
    first.run()
    assert first.core.stats().stored_pages == 6
    finish_idle(first)
    eng = Engine(extra(tmp_path, load="layerwise"))  # empty L2, same L3
    eng.add("r2", p[:6 * BLOCK] + tokens(8, 3))
    eng.run()
    assert eng.lookups[-1] == ("r2", 0, 6 * BLOCK, True)  # an L3 part always loads between steps
    s = eng.core.stats()
    assert s.hit_tokens == {"L2": 0, "L3": 6 * BLOCK} and s.loaded_pages == 6 and s.load_error_pages == 0
    eng.reset_vllm_prefix_cache()
    eng.add("r3", p[:5 * BLOCK] + tokens(9, 3))  # the L3 pages were indexed on L2 when they landed
    eng.run()
    assert eng.lookups[-1] == ("r3", 0, 5 * BLOCK, False)
    assert eng.core.stats().hit_tokens == {"L2": 5 * BLOCK, "L3": 6 * BLOCK}
    finish_idle(eng)


def test_chunked_prefill_stores_and_an_abort_mid_prefill_stores_what_was_computed():
    eng = Engine(extra(), tokens_per_step=32)
    p = tokens(10, 100)
    eng.add("r1", p)
    logs = eng.run()
    assert sum(1 for g in logs if g.scheduled.get("r1") == 32) == 3  # 100 prompt tokens in 4 chunks
    assert eng.core.stats().saved_pages == 6
    q = tokens(11, 100)
    eng.add("r3", q)
    eng.step()
    eng.step()  # 64 of 100 tokens computed
    from vllm.v1.request import RequestStatus
    eng.scheduler.finish_requests("r3", RequestStatus.FINISHED_ABORTED)
    eng.run()
    assert eng.core.stats().saved_pages == 6 + 4
    eng.reset_vllm_prefix_cache()
    eng.add("r4", q)
    eng.run()
    assert ("r4", 0, 4 * BLOCK, True) in eng.lookups
    finish_idle(eng)


@pytest.mark.parametrize("admission,hit,choice", [
    ({"prefill_tokens_per_s": 1e12, "l2_bytes_per_s": 1.0}, 0, "recompute"),
    ({"prefill_tokens_per_s": 1.0, "l2_bytes_per_s": 1e12}, 3 * BLOCK, "load"),
    ({"policy": "always_load", "prefill_tokens_per_s": 1e12, "l2_bytes_per_s": 1.0}, 3 * BLOCK, None),
])
def test_cost_model_decides_load_or_recompute_and_counts_it(admission, hit, choice):
    eng = Engine(extra(admission=admission))
    p = tokens(12, 3 * BLOCK + 2)
    eng.add("r1", p)
    eng.run()
    eng.reset_vllm_prefix_cache()
    eng.add("r2", p)
    eng.run()
    assert eng.lookups[-1][2] == hit
    s = eng.core.stats()
    assert s.decisions == {k: int(k == choice) for k in ("load", "load_l2", "recompute", "unmeasured")}
    assert s.recomputed_tokens["L2"] == (3 * BLOCK if choice == "recompute" else 0)
    finish_idle(eng)


@pytest.mark.parametrize("kv_layout", sorted(VLLM_LAYOUTS))
@pytest.mark.parametrize("shape", [TOY, TOY_MLA], ids=["mha", "mla"])
def test_every_vllm_kv_layout_round_trips(kv_layout, shape):
    """vLLM's KV tensors in each stride order vLLM 0.33 allocates (its attention backends')."""
    eng = Engine(extra(load="layerwise"), shape, kv_layout=kv_layout, num_blocks=16)
    p = tokens(13, 3 * BLOCK + 1)
    eng.add("r1", p)
    eng.run()
    eng.reset_vllm_prefix_cache()
    eng.add("r2", p)
    eng.run()
    assert eng.lookups[-1] == ("r2", 0, 3 * BLOCK, False) and eng.core.stats().loaded_pages == 3
    finish_idle(eng)


def test_kv_events_name_vllms_block_hashes_and_the_medium(tmp_path):
    from vllm.distributed.kv_events import BlockRemoved, BlockStored
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    def h(r, a, b):  # vLLM's own block hashes of pages [a, b), as its KV events carry them
        return [maybe_convert_block_hash(x) for x in r.block_hashes[a:b]]
    eng = Engine(extra(tmp_path, host_pages=6))
    p = tokens(14, 5 * BLOCK + 1)
    r1 = eng.add("r1", p)
    eng.run()
    # Pages are saved as they are computed (a step save of the first chunk's pages, then the
    # rest at the end): each medium's events, in order, name r1's 5 pages once.
    for medium in ("CPU", "STORAGE"):
        mine = [e for e in eng.events if isinstance(e, BlockStored) and e.medium == medium]
        assert [x for e in mine for x in e.block_hashes] == h(r1, 0, 5), medium
        assert [t for e in mine for t in e.token_ids] == p[:5 * BLOCK], medium
    r3 = eng.add("r3", tokens(15, 4 * BLOCK + 1))  # L2 holds 6 pages: r1's node (5 pages) goes
    eng.run()
    removed = [e for e in eng.events if isinstance(e, BlockRemoved)]
    assert [(e.medium, sorted(e.block_hashes)) for e in removed] == [("CPU", sorted(h(r1, 0, 5)))]
    assert eng.events[-1].block_hashes == h(r3, 0, 4) and eng.events[-1].medium == "STORAGE"
    eng.reset_vllm_prefix_cache()
    n = len(eng.events)
    eng.add("r4", p)  # from L3; the pages land in L2 again (r3's go)
    eng.run()
    assert eng.lookups[-1] == ("r4", 0, 5 * BLOCK, True)
    back = [(e.medium, e.block_hashes, e.parent_block_hash) for e in eng.events[n:] if isinstance(e, BlockStored)]
    assert back == [("CPU", h(r1, 0, 5), None)]
    gone = [e for e in eng.events[n:] if isinstance(e, BlockRemoved)]
    assert [(e.medium, sorted(e.block_hashes)) for e in gone] == [("CPU", sorted(h(r3, 0, 4)))]
    finish_idle(eng)


@pytest.mark.parametrize("seed", [5, 6, 7])
def test_mixed_workload_under_l2_and_vllm_block_pressure(seed, tmp_path):
    """Conversations sharing prefixes, arriving while others decode, with L2 and vLLM's blocks
    both too small for the working set: saves race, L2 evicts under pins, vLLM preempts; every
    computed token's bytes and both halves' invariants are checked after every step."""
    import random
    rnd = random.Random(seed)
    eng = Engine(extra(tmp_path, host_pages=10), num_blocks=24, tokens_per_step=48)
    roots = [tokens(80 + i, 3 * BLOCK) for i in range(6)]
    reqs = []
    for i in range(20):
        prompt = rnd.choice(roots)[:rnd.choice([BLOCK, 2 * BLOCK, 3 * BLOCK])] + tokens(90 + i, rnd.randint(3, 40))
        reqs.append(eng.add(f"m{i}", prompt, max_tokens=rnd.randint(1, 12)))
        for _ in range(rnd.randint(0, 3)):
            eng.step()
            eng.check_integrity()
    eng.run(max_steps=400, integrity=True)
    assert all(r.is_finished() for r in reqs)
    s = eng.core.stats()
    # Load errors are allowed here (an L3 part that found no L2 room to stage in): vLLM recomputes them.
    assert s.loaded_pages > 0 and s.save_dropped_pages > 0 and eng.checked_tokens > 0
    assert s.hit_tokens["L3"] > 0  # L2 (10 pages) evicted under the working set; L3 served
    finish_idle(eng)
