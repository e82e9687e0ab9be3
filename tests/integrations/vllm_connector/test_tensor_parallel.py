"""Two TP ranks under one vLLM scheduler: each rank's worker connector keeps its own heads
in its own L2 pool and L3 objects (its layout's fingerprint), vLLM's KVOutputAggregator
merges their reports, and the scheduler half completes a job once both ranks reported.
Each rank's stand-in model writes its own bytes, so a rank loading the other's shows."""
from __future__ import annotations

import dataclasses

from tests.integrations.vllm_connector.harness import BLOCK, Engine, l3_object, real_shape, tokens
from tests.integrations.vllm_connector.test_scheduler_path import extra, finish_idle

# llama-3.1-8b on 2 ranks: 4 of its 8 KV heads each, every layer.
LLAMA_TP2 = dataclasses.replace(real_shape("llama-3.1-8b"), name="llama-3.1-8b-tp2", heads=4)


def test_two_ranks_store_and_load_their_own_heads(tmp_path):
    p = tokens(60, 3 * BLOCK + 2)
    first = Engine(extra(tmp_path), LLAMA_TP2, num_blocks=8, tp=2)
    dirs = [w.worker.storage.dir for w in first.workers]
    assert dirs[0] != dirs[1]  # one L3 object per page per rank
    first.add("r1", p)
    first.run()
    assert first.core.stats().stored_pages == 3
    finish_idle(first)
    eng = Engine(extra(tmp_path), LLAMA_TP2, num_blocks=8, tp=2)
    eng.add("r2", p)  # L3, both ranks
    eng.run()
    eng.reset_vllm_prefix_cache()
    eng.add("r3", p)  # L2, both ranks
    eng.run()
    assert eng.lookups == [("r2", 0, 3 * BLOCK, True), ("r3", 0, 3 * BLOCK, True)]
    s = eng.core.stats()
    assert (s.loaded_pages, s.load_error_pages) == (6, 0)
    finish_idle(eng)


def test_a_corrupted_object_of_one_rank_is_recomputed_on_both(tmp_path):
    p = tokens(61, 4 * BLOCK + 2)
    first = Engine(extra(tmp_path), LLAMA_TP2, num_blocks=8, tp=2)
    first.add("r1", p)
    first.run()
    rank1_dir = first.workers[1].worker.storage.dir
    finish_idle(first)
    obj = l3_object(rank1_dir, p, 2)
    raw = bytearray(obj.read_bytes())
    raw[-1] ^= 0x55
    obj.write_bytes(bytes(raw))
    eng = Engine(extra(tmp_path), LLAMA_TP2, num_blocks=8, tp=2)
    eng.add("r2", p)
    logs = eng.run()
    assert eng.lookups[0] == ("r2", 0, 4 * BLOCK, True)  # rank 0's objects are whole: the probe sees 4 pages
    assert len(set().union(*(g.invalid for g in logs))) == 2  # pages 2, 3 on both ranks (rank 1 read 2)
    s = eng.core.stats()
    assert (s.loaded_pages, s.load_error_pages) == (2, 2)
    # Only the 2 pages both ranks read were indexed on L2; r2 then saved the 2 it recomputed.
    eng.reset_vllm_prefix_cache()
    eng.add("r3", p[:4 * BLOCK] + tokens(62, 3))
    eng.run()
    assert eng.lookups[-1] == ("r3", 0, 4 * BLOCK, True) and eng.core.stats().saved_pages == 2
    assert eng.workers[1].worker.storage.stats().corrupt == 1
    finish_idle(eng)
