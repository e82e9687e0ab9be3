"""TP ranks of a hybrid model agree on the floor, not only on the full groups' hit.

Two ``HybridCache`` ranks in threads of this process, one ``ServiceConsensus`` each
through an in-process ``NodeServer`` (as ``test_consensus``' service tests). The layout
is gpt-oss-120b's (SWA-128 and full layers, TP rank r of 2) with a small state group
added, so that the ranks can hold snapshots at different boundaries: each rank's own
floor differs, and the group must settle on a boundary every rank resumes from (the
minimum over ranks can be one where some rank holds no snapshot). At the value level,
the reference hybrid model served on two ranks that had to lower their floors to agree
still equals a cold run bit for bit.
"""
from __future__ import annotations

import threading

import pytest
import torch

from hicache.core.config import HiCacheConfig
from hicache.client.consensus import ServiceConsensus
from hicache.core.hashing import page_hashes
from hicache.core.groups import LayerGroup, hybrid_layout
from hicache.cache.hybrid import HybridCache
from hicache.reference.hybrid_runner import HybridRunner
from hicache.reference.model_hybrid import HybridModel, HybridSpec
from hicache.reference.model_spec import ModelSpec
from hicache.core.shapes import model_shape

# an exception in a rank's thread fails the test (not only a warning)
pytestmark = pytest.mark.filterwarnings("error::pytest.PytestUnhandledThreadExceptionWarning")

PS = 16
PROMPT = [(7919 * j) % 50_000 + 1 for j in range(10 * PS)]  # 10 pages
STATE_BYTES = 64


def _cache(rank: int, consensus) -> HybridCache:
    base = hybrid_layout(model_shape("gpt-oss-120b"), PS, tp_rank=rank, tp_size=2)
    lay = base.replace(groups=base.groups + (LayerGroup("state", (0,), state_bytes=STATE_BYTES,
                                                        snapshot_every=2),))
    cfg = HiCacheConfig.load(env={}, overrides={"storage.url": "", "pool.device_pages": "32",
                                                "pool.host_pages": "32", "pool.device": "cpu",
                                                "policy.write_policy": "write_through"})
    return HybridCache(cfg, layout=lay, consensus=consensus)


def _snap(rank: int, b: int) -> list[torch.Tensor]:
    return [torch.full((STATE_BYTES,), 10 * rank + b, dtype=torch.uint8)]


def _rank(sock: str, group: str, rank: int, snapshots: list[int], out: list) -> None:
    """Cache PROMPT with snapshots at ``snapshots`` (pages), then admit it again with 5
    more tokens (a full-groups hit of all 10 pages on every rank); record the floor."""
    with ServiceConsensus(sock, group, rank, 2, timeout_s=60) as c:
        hc = _cache(rank, c)
        try:
            req = hc.new_request("a", PROMPT)
            hc.admit(req)  # a collective: both ranks admit (0 hit)
            req.alloc(len(PROMPT))
            req.commit(None, {b: _snap(rank, b) for b in snapshots})
            req.finish()
            own = sorted(b.pages for b in hc.boundaries.values())
            again = hc.new_request("b", PROMPT + [1, 2, 3, 4, 5])
            adm = hc.admit(again)
            state = None if adm.state is None else int(adm.state.reshape(-1)[0])
            again.abort()
            hc.check_integrity()
            out[rank] = (own, adm.hit, adm.resume, state, hc.counts()[2].l1)
        finally:
            hc.close()


def _run(sock: str, group: str, per_rank: list[list[int]]) -> list:
    out: list = [None, None]
    errors: list = []

    def target(r: int) -> None:
        try:
            _rank(sock, group, r, per_rank[r], out)
        except BaseException as e:  # reported below, with the rank
            errors.append((r, e))
    ts = [threading.Thread(target=target, args=(r,)) for r in range(2)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    if errors:
        raise AssertionError(f"ranks failed: {errors}") from errors[0][1]
    return out


@pytest.mark.usefixtures("one_torch_thread")
@pytest.mark.parametrize("per_rank, floor", [
    ([[2, 4, 8], [2, 4, 6]], 4),  # min 6: rank 0 has no snapshot at 6 -> both at 4
    ([[4, 8], [6]], 0),  # min 6 -> rank 0 at 4 -> rank 1 has none at 4 or 2 -> both at 0
    ([[8], [8]], 8),  # the same floor on both ranks: kept in one round
])
def test_ranks_resume_from_a_boundary_every_rank_holds(server, per_rank, floor):
    got = _run(server.socket_path, f"g{floor}", per_rank)
    for r, (own, hit, resume, state, _) in enumerate(got):
        assert own == per_rank[r]
        assert hit == 10 * PS  # the full groups' hit, agreed by HiCache
        assert resume == floor * PS  # the floor, agreed here
        assert state == (None if not floor else 10 * r + floor)  # this rank's own snapshot there
    server.check_integrity()


def test_without_consensus_each_rank_keeps_its_own_floor():
    """The check can fail: without a consensus the same two ranks resume at 8 and 6."""
    floors = []
    for rank, snaps in enumerate([[4, 8], [6]]):
        hc = _cache(rank, None)
        req = hc.new_request("a", PROMPT)
        hc.admit(req)
        req.alloc(len(PROMPT))
        req.commit(None, {b: _snap(rank, b) for b in snaps})
        req.finish()
        again = hc.new_request("b", PROMPT + [1, 2, 3])
        floors.append(hc.admit(again).resume // PS)
        assert page_hashes(PROMPT, PS)[floors[-1] - 1] in hc.boundaries
        again.abort()
        hc.close()
    assert floors == [8, 6]


def _rank_tail(sock: str, group: str, rank: int, lose: bool, out: list) -> None:
    """gpt-oss-120b (no state group): a request preempted at 5 pages + 3 tokens keeps its
    partial page; ``lose``: this rank's SWA store lost the window of page 5 meanwhile."""
    lay = hybrid_layout(model_shape("gpt-oss-120b"), PS, tp_rank=rank, tp_size=2)
    cfg = HiCacheConfig.load(env={}, overrides={"storage.url": "", "pool.device_pages": "32",
                                                "pool.host_pages": "32", "pool.device": "cpu",
                                                "policy.write_policy": "write_through"})
    with ServiceConsensus(sock, group, rank, 2, timeout_s=60) as c:
        hc = HybridCache(cfg, layout=lay, consensus=c)
        try:
            req = hc.new_request("t", PROMPT)
            hc.admit(req)
            req.alloc(5 * PS + 3)
            req.commit()
            req.preempt()
            if lose:
                hc.drain()  # the window's copies to L2 complete, then the store loses them
                hc.stores[0].evict_l1(100)
                hc.stores[0].evict_l2(100)
            adm = hc.admit(req)
            hc.check_integrity()
            out[rank] = (adm.hit, adm.resume, req.computed_tokens)
            req.abort()
        finally:
            hc.close()


@pytest.mark.usefixtures("one_torch_thread")
@pytest.mark.parametrize("lose_on", [-1, 1])
def test_an_exact_partial_page_floor_stands_only_when_every_rank_has_it(server, lose_on):
    out: list = [None, None]
    ts = [threading.Thread(target=_rank_tail, args=(server.socket_path, f"t{lose_on}", r, r == lose_on, out))
          for r in range(2)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    want = 5 * PS + 3 if lose_on < 0 else 0
    assert out == [(5 * PS + 3, want, 5 * PS + 3)] * 2


# ------------------------------------------------ value level: the agreed floor is exact
BASE = ModelSpec(vocab=97, hidden=32, num_layers=4, num_q_heads=4, mlp=48, num_kv_heads=2, head_dim=8, seed=3)
SPEC = HybridSpec(BASE, ("swa", "full", "linear", "swa", "full", "linear"), window=6, snapshot_every=2)
MODEL_PS = 4
MODEL_PROMPT = torch.randint(1, 97, (37,), generator=torch.Generator().manual_seed(1)).tolist()


def _model_cache(consensus) -> HybridCache:
    cfg = HiCacheConfig.load(env={}, overrides={"storage.url": "", "pool.device_pages": "64",
                                                "pool.host_pages": "64", "pool.device": "cpu",
                                                "policy.write_policy": "write_through"})
    return HybridCache(cfg, layout=SPEC.kv_layout(MODEL_PS, "page_first"), consensus=consensus)


def _model_rank(sock: str, rank: int, model: HybridModel, out: list) -> None:
    """Serve MODEL_PROMPT, then (rank 1) forget the boundary at page 8, then serve it again."""
    with ServiceConsensus(sock, "model", rank, 2, timeout_s=60) as c:
        hc = _model_cache(c)
        try:
            run = HybridRunner(hc, model, chunk_tokens=5)
            run.serve("a", MODEL_PROMPT)
            if rank == 1:
                hc.forget(page_hashes(MODEL_PROMPT, MODEL_PS)[7])
            out[rank] = run.serve("b", MODEL_PROMPT)
            hc.check_integrity()
        finally:
            hc.close()


@pytest.mark.usefixtures("one_torch_thread")
def test_ranks_that_lower_their_floor_to_agree_still_equal_a_cold_run(server):
    """Rank 0 holds the snapshot at page 8, rank 1 no longer: both resume at page 6 (24
    tokens), replay 24..35 for the SWA and linear layers, and equal a cold run bit for bit."""
    model = HybridModel(SPEC)
    hc = _model_cache(None)
    cold = HybridRunner(hc, model, chunk_tokens=64).serve("cold", MODEL_PROMPT)
    hc.close()
    out: list = [None, None]
    # one model per rank (a model keeps per-call state while it runs a chunk); same weights (seeded)
    ts = [threading.Thread(target=_model_rank, args=(server.socket_path, r, HybridModel(SPEC), out))
          for r in range(2)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    for r in out:
        assert (r.hit, r.resume, r.replayed) == (36, 24, 12)
        assert torch.equal(r.last_logits, cold.last_logits) and r.output == cold.output
