"""TP/CP hit consensus: ranks whose caches disagree admit one hit, by value.

2 and 4 CPU processes (``torch.multiprocessing.spawn``), through
``torch.distributed`` (gloo) and through a node service (``NodeServer``).
"""
from __future__ import annotations

import json
import tempfile
import threading
from pathlib import Path

import pytest
import torch.multiprocessing as mp

from hicache.client.link import ServiceClient
from hicache.client.consensus import ServiceConsensus, admitted_hit
from hicache.core.errors import ConfigError, ServiceError

from tests.consensus.ranks import PS, run_rank


def _run(world: int, transport: str, cp_size: int, rendezvous: str) -> list[dict]:
    with tempfile.TemporaryDirectory(prefix="hcc") as out:
        mp.spawn(run_rank, args=(world, transport, cp_size, rendezvous, out), nprocs=world, join=True)
        return [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(world)]


def _check(results: list[dict], world: int, cp_size: int) -> None:
    differ = [r["differ"] for r in results]
    # Before consensus rank r found 6 - r pages (rank 1 on L2); they disagree.
    assert [d["before"] for d in differ] == [(6 - r) * PS for r in range(world)]
    # After it every rank holds the minimum, with the values its tokens were computed with.
    assert [d["after"] for d in differ] == [(7 - world) * PS] * world
    assert all(d["values_ok"] for d in differ)
    if world > 1:  # rank 1's hit came from L2: loaded back, then cut to the agreed hit
        assert differ[1]["host_loaded"] == (7 - world) * PS
    if cp_size > 1:
        return
    kept = [r["tail_kept"] for r in results]
    # All ranks hold the same private partial page: the exact hit (not a page multiple) stands.
    assert [k["before_exact"] for k in kept] == [4 * PS + 2] * world
    assert [k["after"] for k in kept] == [4 * PS + 2] * world and all(k["values_ok"] for k in kept)
    lost = [r["tail_lost"] for r in results]
    # The last rank lost the prefix under its tail: every rank falls back to the floored minimum.
    assert [k["before_exact"] for k in lost] == [4 * PS + 2] * (world - 1) + [0]
    assert [k["after"] for k in lost] == [0] * world


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_torch_distributed_ranks_admit_the_minimum(world, tmp_path):
    _check(_run(world, "torch", 1, str(tmp_path / "rdzv")), world, 1)


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_service_ranks_admit_the_minimum(world, server):
    _check(_run(world, "service", 1, server.socket_path), world, 1)
    st = server.stats()
    assert st.clients == 0 and server.dispatcher.rounds.completed == 3 * 2 and server.dispatcher.rounds.num_open == 0


@pytest.mark.gpu
@pytest.mark.slow
def test_nccl_ranks_on_two_gpus_admit_the_minimum(tmp_path):
    """Two TP ranks, one H200 each, GPU pools, all-reduce MIN over NCCL."""
    import torch
    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 CUDA devices, this machine has {torch.cuda.device_count()} (run it on nvidia-h200-x2)")
    _check(_run(2, "nccl", 1, str(tmp_path / "rdzv")), 2, 1)


@pytest.mark.slow
def test_tp2_cp2_ranks_admit_the_minimum(tmp_path):
    _check(_run(4, "torch", 2, str(tmp_path / "rdzv")), 4, 2)


# ------------------------------------------------------- the service side
def _agree_in_threads(sock: str, world: int, values: list[list[int]], timeout_s: float = 10.0) -> list:
    out: list = [None] * world

    def rank(r: int) -> None:
        with ServiceConsensus(sock, "g", r, world, timeout_s=timeout_s) as c:
            try:
                out[r] = c.agree(values[r])
            except ServiceError as e:
                out[r] = e
    ts = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return out


def test_service_agree_is_the_elementwise_minimum(server):
    got = _agree_in_threads(server.socket_path, 3, [[5, -5, 9], [7, -7, 2], [5, -5, 4]])
    assert got == [[5, -7, 2]] * 3
    server.check_integrity()


def test_service_refusals(server):
    sock = server.socket_path
    with ServiceConsensus(sock, "solo", 0, 2, timeout_s=0.2) as c:
        with pytest.raises(ServiceError) as e:
            c.agree([3])
        assert e.value.kind == "timeout" and "ranks [1] of 2 did not contribute" in e.value.detail
    # The late rank of that round fails it too, at once (consistently with rank 0).
    with ServiceConsensus(sock, "solo", 1, 2, timeout_s=30) as c:
        with pytest.raises(ServiceError, match=r"ranks \[1\] of 2"):
            c.agree([4])
        # A consensus connection carries no pages.
        with pytest.raises(ServiceError) as e:
            c._call({"op": "reserve", "n": 1})
        assert e.value.kind == "bad_request" and "consensus only" in e.value.detail
    # Ranks that disagree on the round's shape are refused by name.
    with ServiceConsensus(sock, "shape", 0, 2, timeout_s=1) as a, ServiceConsensus(sock, "shape", 1, 2) as b:
        t = threading.Thread(target=lambda: pytest.raises(ServiceError, a.agree, [1, 2]))
        t.start()
        while server.dispatcher.rounds.num_open == 0:
            threading.Event().wait(0.01)
        with pytest.raises(ServiceError, match="sends world=2 and 1 values, the round has world=2 and 2"):
            b.agree([1])
        t.join()
    with pytest.raises(ConfigError, match="rank=2 must be in"):
        ServiceConsensus(sock, "g", 2, 2)
    with pytest.raises(ValueError, match="not an integer"):
        ServiceConsensus(sock, "g", 0, 1).agree([1.5])
    # An engine connection still handshakes with its layout and serves pages.
    with ServiceClient(sock, server.layout) as c:
        assert len(c.reserve(1)) == 1
    server.check_integrity()


class _Fixed:
    """A group whose other ranks hold ``others``: the element-wise rule, in process."""

    rank, world_size = 0, 2

    def __init__(self, others: list[int]):
        self.others = others

    def agree(self, values):
        return [min(a, b) for a, b in zip(values, self.others)]

    def close(self):
        pass


@pytest.mark.parametrize("mine,other,want", [(18, 18, 18), (18, 16, 16), (18, 17, 16), (16, 18, 16),
                                             (0, 18, 0), (32, 32, 32)])
def test_admitted_hit_keeps_equal_hits_and_floors_unequal_ones(mine, other, want):
    assert admitted_hit(_Fixed([other, -other]), mine, PS) == want
