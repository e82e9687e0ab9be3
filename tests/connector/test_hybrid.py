"""The connector over a hybrid engine (hicache.connector.hybrid): gpt-oss-120b's sliding-window
and full-attention groups at their real per-layer shapes, over KV tensors laid out as vLLM
allocates them, without vLLM. Each group saves and loads only what a hit at a boundary reads;
the loaded blocks hold exactly the saved bytes."""
from __future__ import annotations

import pytest
import torch

from hicache.connector.groups import EngineGroup
from hicache.connector.hybrid import HybridConnectorScheduler
from hicache.connector.plan import LoadSpec, SaveSpec, StepPlan
from hicache.connector.worker import ConnectorWorker, GroupWorkers
from hicache.core.layout import KVLayout
from hicache.core.shapes import model_shape
from hicache.memory.paged_kv import adopt_paged_kv, vllm_kv_caches, vllm_state_cells
from tests.connector.test_connector_core import DEVICES, fill, page_bytes, same

PS = 16
OSS = model_shape("gpt-oss-120b")
HALF = OSS.layers // 2
BLOCKS = 48
# vLLM's group order for gpt-oss: the sliding-window group first, then the full group.
GROUPS = (EngineGroup(0, "swa", tuple(f"l{2 * i}" for i in range(HALF)), OSS.sliding_window),
          EngineGroup(1, "full", tuple(f"l{2 * i + 1}" for i in range(HALF))))


def rig(host_pages=(16, 40)):
    layout = OSS.kv_layout(PS, layers=HALF, draft=False)  # each group: 18 layers of 8 KV heads x 64, bf16
    pools, workers = {}, {}
    for g in GROUPS:
        pools[g.index] = adopt_paged_kv(layout, list(vllm_kv_caches(layout, BLOCKS, "LBNHC").values()))
        workers[g.index] = ConnectorWorker(layout, host_pages[g.index])
        workers[g.index].register(pools[g.index])
    sched = HybridConnectorScheduler(GROUPS, [layout, layout], list(host_pages))
    return sched, GroupWorkers(workers), pools


def step(sched, workers, plan=None):
    workers.start(plan or sched.take_plan())
    for g in GROUPS:
        for i in range(HALF):
            workers.wait_layer(g.index, i)
    out = workers.finish_step()
    while workers.in_flight:
        for w in workers.workers.values():
            w.transfers.wait_all()
        more = workers.finish_step()
        out.reports += more.reports
        out.finished_loads |= more.finished_loads
        out.load_errors |= more.load_errors
    sched.completed(out.reports)
    return out


def test_each_group_moves_only_what_the_boundary_needs():
    sched, workers, pools = rig()
    n = 20  # pages computed; the window (128 tokens) at boundary 20 is pages 12 .. 19
    tokens = list(range(3, 3 + n * PS + 5))
    full_blocks = list(range(1, n + 2))
    swa_blocks = [0] * 12 + list(range(30, 30 + n - 12 + 1))  # vLLM nulls the blocks outside the window
    for p in range(n):
        fill(pools[1], full_blocks[p], 1000 + p)
        if swa_blocks[p]:
            fill(pools[0], swa_blocks[p], 2000 + p)
    want_full = [page_bytes(pools[1], b) for b in full_blocks[:n]]
    want_swa = [page_bytes(pools[0], b) for b in swa_blocks[12:n]]
    assert sched.finished("a", tokens, n * PS + 5, [swa_blocks, full_blocks]) is True
    out = step(sched, workers)
    assert not out.load_errors
    assert len(sched.lanes[0].items) == 8 and sched.stats().saved_pages == n  # the window, every full page
    sched.check_integrity()

    # The same prefix: a hit of all 20 pages; the full group loads 20 pages, the window group 8.
    hit = sched.lookup("b", tokens[:n * PS] + [9, 9, 9], 0)
    assert (hit.tokens, hit.l2_tokens) == (n * PS, n * PS)
    fresh_full, fresh_swa = list(range(22, 22 + n + 1)), [0] * 12 + list(range(39, 39 + n - 12 + 1))
    sched.allocated("b", tokens[:n * PS] + [9, 9, 9], [fresh_swa, fresh_full], hit.tokens)
    plan = sched.take_plan()
    assert sorted((s.group, len(s.blocks)) for s in plan.loads) == [(0, 8), (1, n)]
    out = step(sched, workers, plan)
    assert out.finished_loads == {"b"} and not out.load_errors
    assert same(pools[1], fresh_full[:n], want_full) and same(pools[0], fresh_swa[12:n], want_swa)
    sched.check_integrity()


def test_the_floor_stops_where_the_window_is_missing():
    sched, workers, pools = rig()
    n = 20
    tokens = list(range(5, 5 + n * PS + 1))
    sched.finished("a", tokens, n * PS + 1, [[0] * 12 + list(range(30, 39)), list(range(1, n + 2))])
    step(sched, workers)
    # 17 pages in common: the full group holds them, but boundary 17's window (pages 9 .. 16)
    # is not on L2 (only 12 .. 19 were saved), nor any boundary's below: no hit.
    other = tokens[:17 * PS] + [7] * (3 * PS)
    assert sched.lookup("c", other, 0).tokens == 0
    # vLLM's own hit of 12 pages holds the window's first part: boundary 17 resumes.
    hit = sched.lookup("d", other, 12 * PS)
    assert (hit.tokens, hit.l2_tokens) == (5 * PS, 5 * PS)
    sched.check_integrity()


def test_a_state_group_saves_what_the_engine_offers_after_the_forward_and_loads_it_at_the_floor():
    """A state (Mamba) group: a state is saved only as the engine offers its exact block, copied
    after the step's forward wrote it (not when planned); a hit floors where a state is held."""
    state = EngineGroup(1, "state", ("m0", "m1"))
    groups = (GROUPS[1]._replace(index=0), state)
    layout = OSS.kv_layout(PS, layers=HALF, draft=False)
    slay = OSS.kv_layout(PS, layers=2, draft=False)  # two state layers; their bytes are opaque here
    pools = {0: adopt_paged_kv(layout, list(vllm_kv_caches(layout, BLOCKS, "LBNHC").values())),
             1: adopt_paged_kv(slay, list(vllm_kv_caches(slay, BLOCKS, "LBNHC").values()))}
    workers = GroupWorkers({g: ConnectorWorker(x, 16) for g, x in ((0, layout), (1, slay))})
    for g, w in workers.workers.items():
        w.register(pools[g])
    sched = HybridConnectorScheduler(groups, [layout, slay], [16, 16])
    n = 8
    tokens = list(range(7, 7 + n * PS + 1))
    # The engine offers the state after pages 4 and 8 (blocks 40, 41) as it schedules their forwards.
    assert sched.boundary_states("a", tokens, [(1, 40, 4 * PS), (1, 41, 8 * PS)]) == 2
    plan = sched.take_plan()
    assert all(s.after_forward and s.running for s in plan.saves)
    workers.start(plan)
    fill(pools[1], 40, 3004)  # the forward writes the states after the saves were planned
    fill(pools[1], 41, 3008)
    want = [page_bytes(pools[1], b) for b in (40, 41)]
    out = workers.finish_step()
    for w in workers.workers.values():
        w.transfers.wait_all()
    out.reports += workers.finish_step().reports
    sched.completed(out.reports)
    assert not out.finished_saves  # a running save is never reported to the engine as finished
    full_blocks = list(range(1, n + 2))
    for p in range(n):
        fill(pools[0], full_blocks[p], 1000 + p)
    sched.finished("a", tokens, n * PS + 1, [full_blocks, [0] * 7 + [41, 42]])
    step(sched, workers)
    assert len(sched.lanes[1].items) == 2  # the finish saved no state by position
    sched.check_integrity()
    # 6 pages in common: no state after page 6, so the hit floors to page 4; the state loads there.
    other = tokens[:6 * PS] + [5] * PS
    hit = sched.lookup("b", other, 0)
    assert hit.tokens == 4 * PS
    sched.allocated("b", other, [list(range(20, 27)), [0, 0, 0, 43, 44]], hit.tokens)
    plan = sched.take_plan()
    assert sorted((s.group, s.blocks) for s in plan.loads) == [(0, (20, 21, 22, 23)), (1, (43,))]
    out = step(sched, workers, plan)
    assert out.finished_loads == {"b"} and not out.load_errors
    assert same(pools[1], [43], want[:1])
    sched.check_integrity()


def test_a_window_item_evicted_between_lookup_and_load_is_a_load_error():
    sched, workers, pools = rig(host_pages=(8, 40))
    n = 20
    tokens = list(range(11, 11 + n * PS + 1))
    sched.finished("a", tokens, n * PS + 1, [[0] * 12 + list(range(30, 39)), list(range(1, n + 2))])
    step(sched, workers)
    hit = sched.lookup("b", tokens, 0)
    assert hit.tokens == n * PS
    lane = sched.lanes[0]
    gone = next(iter(lane.items))
    lane.alloc.free([lane.items.pop(gone)])  # as another request's save would evict it
    fresh_swa = [0] * 12 + list(range(39, 48))
    sched.allocated("b", tokens, [fresh_swa, list(range(22, 22 + n + 1))], hit.tokens)
    out = step(sched, workers)
    assert out.load_errors == set(fresh_swa[12:n])  # the leading page is missing: the whole window recomputes
    sched.check_integrity()
    assert torch.equal(torch.tensor(sorted(lane.pins)), torch.tensor([], dtype=torch.int64))


@pytest.mark.parametrize("device", DEVICES)
def test_state_pages_as_vllm_hands_them_save_and_load_exact_padding_untouched(device):
    """vLLM's Mamba layer cache: [B, 1, 1, C] int8 pages whose block stride is padded to the
    attention page (C = 35,840 real bytes in a 49,152-byte stride, the real CPU engine's
    Qwen3-Next). Saved after a forward, loaded into another block: the state's bytes equal,
    the padding between blocks never written."""
    real, stride, blocks, layers = 35_840, 49_152, 12, 3
    layout = KVLayout("qwen3-next [group 0 state]", layers, kind="mla", kv_lora_rank=real // 4, dtype="uint8",
                      page_size=4)
    raws = [torch.full((blocks * stride,), 0x5A, dtype=torch.int8, device=device) for _ in range(layers)]
    pages = [r.as_strided((blocks, 1, 1, real), (stride, real, real, 1)) for r in raws]
    pool = adopt_paged_kv(layout, [vllm_state_cells(t, layout) for t in pages])
    w = ConnectorWorker(layout, 4)
    w.register(pool)
    g = torch.Generator().manual_seed(7)
    for t in pages:
        t[3].copy_(torch.randint(-128, 128, (1, 1, real), generator=g, dtype=torch.int8))
    w.start(StepPlan((), (SaveSpec(1, "a", (3,), (0,), running=True, after_forward=True),)))
    w.finish_step()
    w.start(StepPlan((LoadSpec(2, "b", (7,), (0,)),), ()))
    out = w.drain()
    assert out.finished_loads == {"b"} and not out.load_errors
    for t, r in zip(pages, raws):
        assert torch.equal(t[7], t[3])
        gaps = r.view(blocks, stride)[:, real:]
        assert bool((gaps == 0x5A).all())  # the padding of every block untouched
    w.check_integrity()
    w.close()


def test_a_request_that_ends_waiting_leaves_no_l3_finding_behind():
    """What a lookup found on a group's L3 is kept for the allocation; a request aborted while
    waiting is never allocated, and its ending drops it."""
    sched, workers, pools = rig()
    tokens = list(range(21, 21 + 4 * PS + 1))
    sched._in_l3["w"] = {0: {b"x" * 16}}  # as _holds leaves it for a waiting request
    sched.finished("w", tokens, 0, [[], []])
    assert "w" not in sched._in_l3
    sched.check_integrity()
