"""Backup and prefetch through SGLang's own storage threads (backup thread,
prefetch query thread, prefetch I/O thread, ack sync thread), doing on the
test thread only what SGLang's scheduler does between them."""
from __future__ import annotations

import torch

from .conftest import PAGE, controller
from .test_backend import corrupt, pages_of


def test_backup_then_prefetch_through_sglang_threads_stops_at_a_corrupt_page(l3_url, model, controllers):
    c = controller("mha", "page_first_direct", l3_url, model)
    controllers.append(c)
    pool = c.mem_pool_host
    tokens = list(range(100, 100 + 4 * PAGE))
    src = pool.alloc(4 * PAGE)
    want = pages_of(pool, src)

    # Backup: the scheduler hands host pages and their token ids to the controller.
    from sglang.srt.mem_cache.utils import get_storage_hash_str
    keys = get_storage_hash_str(tokens, None, page_size=PAGE)
    c.write_storage(src, tokens, hash_value=keys)
    done = c.ack_backup_queue.get(timeout=30)
    assert done.completed_tokens == 4 * PAGE
    corrupt(c.storage_backend, keys[2])

    # Prefetch: the query thread asks batch_exists (4 pages present) ...
    op = c.prefetch("req-1", tokens)
    hit = c.prefetch_hit_queue.get(timeout=30)
    assert hit is op and op.storage_hit_count == 4 * PAGE and op.hash_value == keys
    # ... the scheduler allocates host memory for the hit and queues the transfer ...
    dst = pool.alloc(op.storage_hit_count)
    op.host_indices = dst
    c.prefetch_buffer.put(op)
    # ... and the I/O thread loads through batch_get_v1: the corrupt page ends the run.
    acks = []
    while not acks or not acks[-1].completed_req:
        acks.append(c.ack_prefetch_queue.get(timeout=30))
    assert [a.completed_tokens for a in acks if a.completed_tokens is not None] == [2 * PAGE]
    got = pages_of(pool, dst)
    assert all(torch.equal(got[i], want[i]) for i in (0, 1))
    # Pages from the miss on are reported not loaded; their host memory may hold what was
    # read (loads verify in the pool, hicache.storage.into), which SGLang frees unread.
    assert c.storage_backend.hicache_stats().corrupt == 1
