"""The connector's vLLM-free core (hicache.connector): the scheduler half and the
worker half talking through plain-data plans, over KV tensors laid out as vLLM 0.33
allocates them (``memory.paged_kv.vllm_kv_caches``), without vLLM. On CPU here; the
``gpu`` variant runs the same on CUDA tensors, a pinned L2 and the Triton copy kernels."""
from __future__ import annotations

import pytest
import torch

from hicache.connector.scheduler import ConnectorScheduler
from hicache.connector.plan import WorkerStep
from hicache.connector.worker import ConnectorWorker
from hicache.core.shapes import model_shape
from hicache.memory.paged_kv import adopt_paged_kv, vllm_kv_caches
from hicache.storage import open_storage

PS = 16
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def layout_of(name: str, layers: int | None = None):
    return model_shape(name).kv_layout(PS, layers=layers, draft=False)


def rig(layout, device, l3, blocks=12, host_pages=16, layerwise=False):
    storage = lambda: None if l3 is None else open_storage(f"file://{l3}", fingerprint=layout.fingerprint(),  # noqa: E731
                                                          layout=layout)
    kv = vllm_kv_caches(layout, blocks, "LBNHC", device=device)
    pool = adopt_paged_kv(layout, list(kv.values()))
    sched = ConnectorScheduler(layout, host_pages, storage=storage(), layerwise=layerwise)
    worker = ConnectorWorker(layout, host_pages, storage=storage())
    worker.register(pool)
    return sched, worker, pool


def page_bytes(pool, block: int) -> list[torch.Tensor]:
    return [pool.byte_pages(s.index)[block].cpu().clone() for s in pool.layout.planes]


def same(pool, blocks, want) -> bool:
    """Every plane of ``blocks`` holds exactly ``want`` (lists of page_bytes)."""
    got = [page_bytes(pool, b) for b in blocks]
    return len(got) == len(want) and all(torch.equal(x, y) for g, w in zip(got, want) for x, y in zip(g, w))


def fill(pool, block: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for s in pool.layout.planes:
        bp = pool.byte_pages(s.index)[block]
        bp.copy_(torch.randint(0, 256, tuple(bp.shape), generator=g, dtype=torch.uint8))


def step(sched, worker, layers: int) -> WorkerStep:
    """One engine step: the plan to the worker, the forward's per-layer waits, reports back."""
    worker.start(sched.take_plan())
    for i in range(layers):
        worker.wait_layer(i)
    out = worker.drain()
    sched.completed(out.reports)
    return out


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", ["llama-3.1-8b", "deepseek-v3"])
def test_save_then_load_from_l2_and_from_l3(device, name, tmp_path):
    layout = layout_of(name, layers=8)
    tokens = list(range(7, 7 + 4 * PS + 1))
    sched, worker, pool = rig(layout, device, tmp_path)
    for b in range(4):
        fill(pool, b, b)
    want = [page_bytes(pool, b) for b in range(4)]
    assert sched.finished("a", tokens, len(tokens), [0, 1, 2, 3, 11]) is True
    out = step(sched, worker, layout.num_layers)
    assert out.finished_saves == set() and sched.stats().saved_pages == 4  # the engine has not named "a" ended
    assert worker.finish_step({"a"}).finished_saves == {"a"}
    hit = sched.lookup("b", tokens, 0)
    assert (hit.tokens, hit.l2_tokens, hit.is_async) == (4 * PS, 4 * PS, True)
    sched.allocated("b", tokens, [4, 5, 6, 7, 10], hit.tokens)
    out = step(sched, worker, layout.num_layers)
    assert out.finished_loads == {"b"} and not out.load_errors
    assert same(pool, (4, 5, 6, 7), want) and not same(pool, (4, 5, 6, 7), want[::-1])
    sched.check_integrity()
    worker.check_integrity()
    worker.close()
    # A new engine: empty L2, the same L3.
    sched, worker, pool = rig(layout, device, tmp_path, layerwise=True)
    hit = sched.lookup("c", tokens, PS)  # the engine holds page 0 itself
    assert (hit.tokens, hit.l3_tokens) == (3 * PS, 3 * PS)
    sched.allocated("c", tokens, [9, 1, 2, 3], hit.tokens)
    out = step(sched, worker, layout.num_layers)
    assert out.finished_loads == {"c"} and not out.load_errors
    assert same(pool, (1, 2, 3), want[1:])
    sched.check_integrity()
    worker.close()


@pytest.mark.parametrize("device", DEVICES)
def test_a_corrupt_l3_page_and_the_pages_after_it_are_load_errors(device, tmp_path):
    layout = layout_of("qwen3-8b", layers=4)
    tokens = list(range(100, 100 + 3 * PS + 5))
    sched, worker, pool = rig(layout, device, tmp_path)
    for b in range(3):
        fill(pool, b, 10 + b)
    sched.finished("a", tokens, len(tokens), [0, 1, 2])
    step(sched, worker, layout.num_layers)
    worker.close()
    victim = next(p for p in tmp_path.rglob("*") if p.is_file() and p.stat().st_size > layout.page_bytes // 2
                  and p.name == _hash_hex(tokens, 1))
    raw = bytearray(victim.read_bytes())
    raw[len(raw) // 2] ^= 1
    victim.write_bytes(bytes(raw))
    sched, worker, pool = rig(layout, device, tmp_path)
    hit = sched.lookup("b", tokens, 0)
    sched.allocated("b", tokens, [5, 6, 7], hit.tokens)
    out = step(sched, worker, layout.num_layers)
    assert out.load_errors == {6, 7} and out.finished_loads == {"b"}
    assert sched.stats().loaded_pages == 1 and sched.stats().load_error_pages == 2
    sched.check_integrity()
    worker.close()


def _hash_hex(tokens, page: int) -> str:
    from hicache.core.hashing import page_hashes
    return page_hashes(tokens[:(page + 1) * PS], PS)[page].hex()


def test_a_fast_ranks_l3_report_before_a_slow_ranks_copy_report(tmp_path):
    """TP: rank 0 copied and stored to L3 before rank 1 finished copying (one step's reports,
    or across steps): the save completes in order and indexes its pages once."""
    from hicache.connector.plan import JobKind, JobReport
    layout = layout_of("llama-3.1-8b", layers=2)
    sched = ConnectorScheduler(layout, 8, ranks=2, storage=open_storage(
        f"file://{tmp_path}", fingerprint=layout.fingerprint(), layout=layout))
    tokens = list(range(3, 3 + 2 * PS + 1))
    assert sched.finished("a", tokens, len(tokens), [4, 5])
    (save,) = sched.take_plan().saves
    j = save.job
    sched.completed([JobReport(j, 0, JobKind.SAVE, True), JobReport(j, 0, JobKind.STORE, True, 2)])
    sched.check_integrity()
    sched.completed([JobReport(j, 1, JobKind.SAVE, True)])
    assert sched.stats().saved_pages == 2 and sched.in_flight == 1
    sched.completed([JobReport(j, 1, JobKind.STORE, True, 2)])
    s = sched.stats()
    assert (s.saved_pages, s.stored_pages, sched.in_flight) == (2, 2, 0)
    assert sched.lookup("b", tokens, 0).l2_tokens == 2 * PS
    sched.check_integrity()


def test_a_waiting_requests_prefix_goes_last_from_l2():
    """vLLM asks about waiting requests only: their L2 prefix is evicted after every other page
    until the engine schedules them (``admitted``) or they end."""
    layout = layout_of("llama-3.1-8b", layers=2)
    sched, worker, pool = rig(layout, "cpu", None, blocks=12, host_pages=8)
    a, b = list(range(100, 100 + 4 * PS + 1)), list(range(300, 300 + 4 * PS + 1))
    for rid, toks, blocks in (("a", a, [0, 1, 2, 3, 11]), ("b", b, [4, 5, 6, 7, 11])):
        sched.finished(rid, toks, len(toks), blocks)
        step(sched, worker, layout.num_layers)
        worker.finish_step({rid})
    assert sched.lookup("wa", a, 0).l2_tokens == 4 * PS  # "wa" waits on a's pages (the older ones)
    assert set(sched.cache.waiting) == {"wa"}
    c = list(range(500, 500 + 4 * PS + 1))
    sched.finished("c", c, len(c), [8, 9, 10, 11, 0])  # 4 pages more than L2 has free: b's go, not a's
    step(sched, worker, layout.num_layers)
    worker.finish_step({"c"})
    assert sched.lookup("x", a, 0).l2_tokens == 4 * PS and sched.lookup("y", b, 0).l2_tokens == 0
    sched.admitted("wa")
    sched.finished("x", a, 0, [])
    sched.finished("y", b, 0, [])
    assert sched.cache.waiting == {}
    sched.check_integrity()


def test_a_lookup_waits_for_another_requests_load_of_the_same_pages():
    """Concurrent requests over one prefix load it once: while "a"'s load of pages 0-3 is in
    flight, "b" (same pages) is told to wait, and so is "c" (page 0 in common) unless the engine
    holds page 0 itself; "d" (the engine holds all four) and "e" (other content) are not; once
    the load lands, "b" is answered."""
    layout = layout_of("llama-3.1-8b", layers=2)
    tokens = list(range(7, 7 + 4 * PS + 1))
    sched, worker, pool = rig(layout, "cpu", None)
    for b in range(4):
        fill(pool, b, b)
    sched.finished("a0", tokens, len(tokens), [0, 1, 2, 3, 11])
    step(sched, worker, layout.num_layers)
    worker.finish_step({"a0"})
    hit = sched.lookup("a", tokens, 0)
    assert hit.tokens == 4 * PS and not hit.waits
    sched.allocated("a", tokens, [4, 5, 6, 7, 10], hit.tokens)
    assert sched.lookup("b", tokens + [1, 2], 0).waits  # a longer prompt over the same pages
    other = tokens[:PS] + [t + 1 for t in tokens[PS:]]
    assert sched.lookup("c", other, 0).waits  # page 0 is common, and in flight
    assert not sched.lookup("c", other, PS).waits  # the engine holds page 0; the rest differ
    assert not sched.lookup("e", [t + 1 for t in tokens], 0).waits
    assert not sched.lookup("d", tokens, 4 * PS).waits
    step(sched, worker, layout.num_layers)  # "a"'s load lands
    hit = sched.lookup("b", tokens + [1, 2], 0)
    assert not hit.waits and hit.tokens == 4 * PS
    assert sched.stats().loaded_pages == 4
    sched.check_integrity()
    worker.close()


def test_a_running_request_saves_its_pages_as_they_are_computed():
    """step_save: the full pages a running request has computed reach L2 before it ends
    (a preempted or aborted request is reusable), the workers never name it a finished save,
    one step save is in flight per request, and the final save continues where it stopped."""
    layout = layout_of("llama-3.1-8b", layers=2)
    tokens = list(range(7, 7 + 6 * PS + 3))
    sched, worker, pool = rig(layout, "cpu", None)
    blocks = [0, 1, 2, 3, 4, 5, 6]
    for b in blocks:
        fill(pool, b, 100 + b)
    want = [page_bytes(pool, b) for b in blocks[:6]]
    assert sched.step_save("a", tokens, 2 * PS + 5, blocks[:3]) is True  # pages 0-1 computed
    assert sched.step_save("a", tokens, 3 * PS, blocks[:3]) is None  # its save is in flight
    out = step(sched, worker, layout.num_layers)
    assert out.finished_saves == set() and sched.stats().saved_pages == 2
    assert worker.finish_step({"a"}).finished_saves == set()  # vLLM holds no blocks for it
    assert sched.lookup("x", tokens, 0).l2_tokens == 2 * PS
    # pages 2-3 in a step save, then the request ends with pages 4-5 computed too
    assert sched.step_save("a", tokens, 4 * PS, blocks[:5]) is True
    assert sched.finished("a", tokens, 6 * PS + 3, blocks) is True
    out = step(sched, worker, layout.num_layers)
    assert worker.finish_step({"a"}).finished_saves | out.finished_saves == {"a"}
    assert sched.stats().saved_pages == 6
    hit = sched.lookup("b", tokens, 0)
    assert hit.l2_tokens == 6 * PS
    sched.allocated("b", tokens, [8, 9, 10, 11, 6, 7, 5], hit.tokens)
    step(sched, worker, layout.num_layers)
    assert same(pool, (8, 9, 10, 11, 6, 7), want)
    sched.check_integrity()
    worker.check_integrity()
    worker.close()
