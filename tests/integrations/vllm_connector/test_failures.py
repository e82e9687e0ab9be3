"""Failures through vLLM's scheduler: a corrupted or vanished L3 object, an L3 that
does not answer, an abort while a load is in flight, preemption and resume. Every
forward checks the bytes of every computed token (``harness.Engine``), so a failure
must end as a recompute, never as wrong KV."""
from __future__ import annotations

from vllm.v1.request import RequestStatus

from tests.integrations.vllm_connector.harness import BLOCK, Engine, host_pins, l3_object, tokens
from tests.integrations.vllm_connector.test_scheduler_path import extra, finish_idle


def _stored(tmp_path, p):
    first = Engine(extra(tmp_path))
    first.add("r1", p)
    first.run()
    assert first.core.stats().stored_pages == len(p) // BLOCK
    finish_idle(first)


def test_corrupted_l3_object_is_a_load_error_and_vllm_recomputes(tmp_path):
    p = tokens(20, 6 * BLOCK + 2)
    _stored(tmp_path, p)
    obj = l3_object(tmp_path, p, 3)
    raw = bytearray(obj.read_bytes())
    raw[-5] ^= 0xFF  # one payload byte: the checksum no longer matches
    obj.write_bytes(bytes(raw))
    eng = Engine(extra(tmp_path))
    eng.add("r2", p)
    logs = eng.run()
    assert eng.lookups[0] == ("r2", 0, 6 * BLOCK, True)  # the probe sees the object; the read verifies it
    failed = set().union(*(g.invalid for g in logs))
    blocks = [b for g in logs for b in g.invalid]
    assert len(failed) == 3 and len(blocks) == 3  # pages 3, 4, 5: the L3 hit is a prefix
    s = eng.core.stats()
    assert (s.loaded_pages, s.load_error_pages) == (3, 3)
    assert eng.core.storage.stats().corrupt >= 1 or eng.worker.worker.storage.stats().corrupt == 1
    # vLLM recomputed from page 3: the forward after the load checked pages 0-2, and r2 finished.
    assert eng.scheduler.get_request_counts() == (0, 0) and "r2" not in eng.scheduler.requests
    finish_idle(eng)


def test_corrupted_l3_object_with_policy_fail_fails_the_request(tmp_path):
    p = tokens(21, 4 * BLOCK + 2)
    _stored(tmp_path, p)
    obj = l3_object(tmp_path, p, 0)
    obj.write_bytes(obj.read_bytes()[:-3])  # truncated
    eng = Engine(extra(tmp_path), policy="fail")
    req = eng.add("r2", p)
    eng.run()
    assert req.status == RequestStatus.FINISHED_ERROR and eng.checked_tokens == 0
    assert eng.core.stats().load_error_pages == 4
    finish_idle(eng)


def test_l3_objects_gone_between_lookup_and_load(tmp_path):
    p = tokens(22, 5 * BLOCK + 1)
    _stored(tmp_path, p)
    eng = Engine(extra(tmp_path))
    eng.add("r2", p)

    def vanish(so):
        if so.kv_connector_metadata.plan.loads:
            for page in range(1, 5):
                l3_object(tmp_path, p, page).unlink()
    eng.step(between=vanish)
    eng.run()
    s = eng.core.stats()
    assert (s.loaded_pages, s.load_error_pages) == (1, 4)
    finish_idle(eng)


def test_l3_outage_misses_and_drops_stores_and_serves():
    # Nothing listens on this port: every probe misses, every store is dropped and counted.
    eng = Engine(extra(storage={"url": "redis://127.0.0.1:9/0", "timeout_ms": 20, "max_retries": 0}))
    p = tokens(23, 4 * BLOCK + 1)
    eng.add("r1", p)
    eng.run()
    s = eng.core.stats()
    assert s.saved_pages == 4 and s.stored_pages == 0  # L2 has them; L3 did not answer
    eng.reset_vllm_prefix_cache()
    eng.add("r2", p)
    eng.run()
    assert eng.lookups[-1] == ("r2", 0, 4 * BLOCK, True)  # L2 serves while L3 is out
    eng.add("r3", tokens(24, 3 * BLOCK))
    eng.run()
    assert eng.lookups[-1] == ("r3", 0, 0, False)
    finish_idle(eng)


def test_abort_while_the_load_is_in_flight_releases_everything():
    eng = Engine(extra())
    p = tokens(25, 5 * BLOCK + 3)
    eng.add("r1", p)
    eng.run()
    saved = eng.core.stats().saved_pages
    eng.reset_vllm_prefix_cache()
    free = eng.scheduler.kv_cache_manager.block_pool.get_num_free_blocks()
    eng.add("r2", p[:5 * BLOCK] + tokens(26, 9))

    def abort(so):
        assert eng.scheduler.requests["r2"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
        assert eng.core.loading("r2")
        eng.scheduler.finish_requests("r2", RequestStatus.FINISHED_ABORTED)
    eng.step(between=abort)
    eng.run()
    assert "r2" not in eng.scheduler.requests
    assert eng.scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == free
    s = eng.core.stats()
    assert s.saved_pages == saved and s.loaded_pages == 5  # the aborted request's blocks were not saved
    assert host_pins(eng) == 0
    finish_idle(eng)


def test_preemption_and_resume_keep_every_token_exact():
    eng = Engine(extra(), num_blocks=12, tokens_per_step=256)
    a = eng.add("a", tokens(27, 4 * BLOCK), max_tokens=40)
    b = eng.add("b", tokens(28, 4 * BLOCK), max_tokens=40)
    eng.run()
    assert a.num_preemptions + b.num_preemptions >= 1
    assert a.status == b.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert eng.core.stats().saved_pages >= 8
    finish_idle(eng)
