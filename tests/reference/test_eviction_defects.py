"""Eviction defects an independent replay found, each on a trace small enough to follow
by hand: an L3 prefetch must not evict its own request's L2 hit (nor have its pages
misreported), L1 eviction is page-granular, every policy keeps L2 inclusive of L1
under write_through, and the replay tools refuse or honour what they are given."""
from __future__ import annotations

import json

import pytest

from hicache.core.errors import ConfigError
from hicache.index.eviction import POLICIES
from hicache.reference.sim_report import distinct_capacity, simulate, sweep
from hicache.reference.simulate import trace_requests

from tests.reference.test_simulate import PS, PAGE_BYTES, cfg_for, nonzero, reqs, run, write_hash_trace
from tests.reference.test_sim_rows import max_distinct, names, random_reqs

_tail = iter(range(900, 10_000))


def pages(*ids: int):
    """A request of whole pages ``ids`` plus one token of a page of its own (computed, never hit)."""
    return ([*ids, next(_tail)], len(ids) * PS + 1)


# ---------------------------------------------------- 1. an L3 prefetch and its own hit
def test_l3_prefetch_keeps_its_requests_l2_hit():
    # L1 = L2 = 4 pages. r0 puts A; r1 A B C (A hit, [B C] a child). r2 D E evicts [B C] from
    # L1 and, to back D E up, from L2. r3 asks A B C again: A on L1 and L2, B C only in L3.
    # The prefetch of B C needs 2 L2 pages: it must not take A's L2 copy (the parent the
    # prefetched pages hang from), else they are dropped and B C miss.
    cfg, plan = cfg_for(l1_pages=4, l2_pages=4, l3_pages=64)
    trace = reqs(pages(1), pages(1, 2, 3), pages(4, 5), pages(1, 2, 3))
    row = run(cfg, plan, trace)
    without_l3 = run(cfg, plan, trace, l3=False)
    assert row["l3_hit_tokens"] == 2 * PS and row["hit_tokens"] == (1 + 3) * PS
    assert row["hit_tokens"] >= without_l3["hit_tokens"]  # adding L3 never loses a hit
    assert "l3_evicted" not in nonzero(row["misses"])


def test_prefetched_pages_l2_cannot_place_are_not_l3_evicted():
    # L1 = 4, L2 = 2 pages. A and A B reach L3. r2 X Y takes B off L1 and, to back X Y up,
    # A and B off L2. r3 asks A B C: A is on L1 only, B in L3. The prefetched B cannot hang
    # from A on L2 (prefix-closed) and is dropped: L3 still holds B, so its reason is
    # no_l2_room, not l3_evicted.
    cfg, plan = cfg_for(l1_pages=4, l2_pages=2, l3_pages=64)
    row = run(cfg, plan, reqs(pages(1), pages(1, 2), pages(4, 5), pages(1, 2, 3)))
    assert (row["l1_hit_tokens"], row["l3_hit_tokens"]) == (2 * PS, 0)
    assert nonzero(row["misses"]) == {"first_use": 5, "no_l2_room": 1, "partial_page": 4}


# ------------------------------------------------------------- 2. page-granular L1
def test_l1_eviction_takes_a_nodes_tail_not_the_whole_node():
    # L1 = 6 pages, no L2. r0 holds A B C D E (one node). r1 F needs 2 pages: LRU takes the
    # tail D E of r0's node, not all five. r2 asks A B C G: A B C still hit.
    cfg, plan = cfg_for(l1_pages=6)
    row = run(cfg, plan, reqs(([1, 2, 3, 4, 5], 5 * PS), pages(6), pages(1, 2, 3, 7)), l3=False, backup=False)
    assert row["hit_tokens"] == 3 * PS
    assert row["evicted_pages"]["L1"] == 2  # E for r1's second page, D for r2's last two: what each was short of


def test_page_granular_eviction_keeps_the_prefix_closure():
    # whatever goes, what stays on L1 is a prefix of each sequence (the tree's check) and the
    # pages evicted are exactly what allocation was short of
    cfg, plan = cfg_for(l1_pages=9)
    row = run(cfg, plan, random_reqs(3, 120), l3=False, backup=False)  # check_integrity runs at the end
    assert row["hit_tokens"] > 0


# ---------------------------------------------- 3. inclusivity under every policy
@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_write_through_is_inclusive_under_every_policy(policy):
    l1, l2 = 6, 10
    for seed in range(2):
        assert max_distinct("write_through", l1, l2, seed, policy=policy) == distinct_capacity(
            l1, l2, "write_through")[0], (policy, seed)


# ------------------------------------------------------ 4. the replay's settings
def test_policies_refuses_byte_settings_it_does_not_use(tmp_path, capsys):
    from hicache.cli import main as cli_main
    path = write_hash_trace(tmp_path / "h.jsonl", [(i, 9, [i % 3, 10 + i, 20 + i]) for i in range(6)])
    rc = cli_main(["replay", path, "--simulate", "--policies", "lru", "--block-tokens", "4",
                   "--set", "simulate.page_size=4", "--set", f"simulate.l1_bytes={8 * PAGE_BYTES}",
                   "--capacities", "64"])
    err = capsys.readouterr().err
    assert rc != 0 and "simulate.l1_bytes" in err and "--capacities" in err


def test_simulate_without_l3_runs_the_l1_l2_replay_once():
    cfg, _ = cfg_for(l1_pages=6, l2_pages=8, l3_pages=0, l3_url="")
    rep = simulate(cfg, lambda: iter(random_reqs(0, 20)))
    got = names(rep)
    assert len(got) == len(set(got)), got
    assert got[0] == "hicache L1+L2 (lru)"
    cfg, _ = cfg_for(l1_pages=6, l2_pages=8, l3_pages=16)
    got = names(simulate(cfg, lambda: iter(random_reqs(0, 20))))
    assert got[0] == "hicache L1+L2+L3 (lru)" and "hicache L1+L2 (lru)" in got  # with L3 both rows mean something


# ----------------------------------------------------- 5. feasible sweep points
def test_sweep_chooses_only_capacities_a_request_fits(tmp_path):
    # the working set is 12 pages, one request needs 5: 1/4 of the working set (3 pages) cannot
    # hold it, so that L1 point is not run (nor fails the sweep halfway)
    lines = [(i, 17, [i % 2, 10 + i % 2, 20 + i, 30 + i, 40 + i]) for i in range(3)]
    path = write_hash_trace(tmp_path / "h.jsonl", lines)
    cfg, _ = cfg_for(l1_pages=6, l2_pages=8, l3_pages=0, l3_url="")
    sw = sweep(cfg, trace_requests(path, cfg.simulate), fractions=(0.25, 1.0))
    l1 = [p["bytes"] // PAGE_BYTES for p in sw["points"] if p["tier"] == "L1"]
    assert l1 and min(l1) >= 5
    json.dumps(sw)  # the report stays serialisable


def test_sweep_refuses_a_configured_l1_no_request_fits():
    cfg, _ = cfg_for(l1_pages=5, l2_pages=8, l3_pages=0, l3_url="")
    cfg = cfg.model_copy(update={"simulate": cfg.simulate.model_copy(update={"l1_bytes": 3 * PAGE_BYTES})})
    with pytest.raises(ConfigError, match="l1_bytes"):
        sweep(cfg, lambda: iter(reqs(([1, 2, 3, 4, 5], 17))), fractions=(1.0,))


# ------------------------------------------------------------- the waiting queue
def test_fcfs_ttft_by_hand():
    from hicache.reference.sim_policies import fcfs_ttft
    assert fcfs_ttft([0, 1, 1.5], [10, 5, 10], 10.0) == pytest.approx([1.0, 0.5, 1.0])


@pytest.mark.parametrize("protect, hit, last_ttft", [(True, 12, 0.21), (False, 8, 0.25)])
def test_a_queued_request_keeps_its_prefix_while_it_waits(protect, hit, last_ttft):
    # L1 = 5 pages, 100 tokens/s: every request arrives while the first computes. At rC's
    # admission one page must go: LRU takes B (A B is older than E, hit again by rE2); with
    # the waiting queue known, rA2's A B stay and E goes.
    from hicache.reference.simulate import SimRequest, run_hicache, sim_config
    cfg, plan = cfg_for(l1_pages=5, protect_waiting=str(protect).lower(), device_eviction="lru")
    base = reqs(pages(5), pages(1, 2), pages(5), pages(3, 4), pages(1, 2))
    trace = [SimRequest(r.rid, 0.01 * i, r.namespace, r.key) for i, r in enumerate(base)]
    row = run_hicache("q", sim_config(cfg, plan, l3=False, backup=False), plan, trace, rate=100.0)
    assert row["hit_tokens"] == hit
    assert row["ttft_s"] == pytest.approx([0.05, 0.13, 0.13, 0.21, last_ttft])
