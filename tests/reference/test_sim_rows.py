"""--simulate rows say what they run: tier labels follow the configured tiers, the
GPU-only row is plain LRU, and Belady is sized at the distinct pages the tiers hold
(inclusive under write_through, exclusive otherwise; both rules checked on a run)."""
from __future__ import annotations

import random

import pytest

from hicache.cache.hicache import HiCache
from hicache.reference.sim_report import distinct_capacity, simulate, tiers_label
from hicache.reference.simulate import sim_config, stand_in_layout

from tests.reference.test_simulate import cfg_for, reqs


def names(rep) -> list[str]:
    return [r["name"] for r in rep["rows"]]


def random_reqs(seed: int, n: int = 80):
    rng = random.Random(seed)
    specs = []
    for _ in range(n):
        conv = rng.randrange(12)
        ids = [conv] + [100 * conv + rng.randrange(4) for _ in range(rng.randrange(1, 5))]
        specs.append((ids, 4 * len(ids) - rng.randrange(0, 3)))
    return reqs(*specs)


@pytest.mark.parametrize("l2, l3, want", [(0, 0, "L1"), (8, 0, "L1+L2"), (8, 16, "L1+L2+L3"),
                                          (0, 16, "L1+L3 (through a 1-page L2)")])
def test_labels_follow_the_configured_tiers(l2, l3, want):
    cfg, plan = cfg_for(l1_pages=6, l2_pages=l2, l3_pages=l3, l3_url="memory://" if l3 else "")
    assert tiers_label(plan) == want
    rep = simulate(cfg, lambda: iter(random_reqs(0, 20)), policies=["lru", "fifo"])
    got = names(rep)
    assert got[0] == f"hicache {want} (qd_lru)" or got[0].startswith(f"hicache {want} (")
    assert "GPU-only prefix cache (L1, lru)" in got
    assert any(n.startswith("hicache L1+L2 (") for n in got) == bool(l2)  # no L1+L2 rows without an L2
    assert not any("L3" in n for n in got[1:])  # only the first row may have L3


def test_l1_only_run_backs_up_nothing_and_gpu_row_is_lru():
    cfg, plan = cfg_for(l1_pages=7, device_eviction="mru", host_eviction="mru")
    rep = simulate(cfg, lambda: iter(random_reqs(1, 60)))
    first, gpu = rep["rows"][0], rep["rows"][1]
    assert first["name"] == "hicache L1 (mru)" and first["l2_used_bytes"] == 0 and first["l2_hit_tokens"] == 0
    lru_cfg, _ = cfg_for(l1_pages=7, device_eviction="lru", host_eviction="lru")
    lru = simulate(lru_cfg, lambda: iter(random_reqs(1, 60)), baselines=False)["rows"][0]
    assert gpu["hit_tokens"] == lru["hit_tokens"] and gpu["name"] == "GPU-only prefix cache (L1, lru)"
    assert first["hit_tokens"] != lru["hit_tokens"]  # mru is not lru on this trace: the rows differ


def test_distinct_capacity_rule():
    assert distinct_capacity(4, 16, "write_through") == (16, "max(L1, L2): inclusive (write_through)")
    assert distinct_capacity(4, 16, "write_back")[0] == 20
    assert distinct_capacity(4, 16, "write_through_selective")[0] == 20
    assert distinct_capacity(4, 0, "write_through") == (4, "L1")


def max_distinct(write_policy: str, l1: int, l2: int, seed: int, policy: str = "lru") -> int:
    """Most distinct pages on L1 or L2 after any request of a random run."""
    cfg, plan = cfg_for(l1_pages=l1, l2_pages=l2, write_policy=write_policy, device_eviction=policy,
                        host_eviction=policy)
    hc = HiCache(sim_config(cfg, plan, l3=False), layout=stand_in_layout(plan), storage=None, inline_transfers=True)
    most = 0
    try:
        for r in random_reqs(seed):
            req = hc.new_request(r.rid, r.key, r.namespace)
            adm = hc.admit(req)
            req.alloc(req.num_tokens - adm.hit_tokens)
            req.commit()
            req.finish()
            hc.drain()
            held = sum(n.num_pages for n in hc.cache.tree.iter_nodes()
                       if n.device_pages is not None or n.host_pages is not None)
            most = max(most, held)
        hc.check_integrity()
    finally:
        hc.close()
    return most


@pytest.mark.parametrize("seed", range(3))
def test_write_through_is_inclusive_and_write_back_is_not(seed):
    l1, l2 = 6, 10
    assert max_distinct("write_through", l1, l2, seed) == distinct_capacity(l1, l2, "write_through")[0]
    wb = max_distinct("write_back", l1, l2, seed)
    assert max(l1, l2) < wb <= distinct_capacity(l1, l2, "write_back")[0]


def test_belady_row_is_sized_by_the_rule():
    cfg, plan = cfg_for(l1_pages=5, l2_pages=7)
    rep = simulate(cfg, lambda: iter(random_reqs(2, 30)), policies=[])
    assert "Belady MIN (7 pages = max(L1, L2): inclusive (write_through))" in names(rep)
    cfg, plan = cfg_for(l1_pages=5, l2_pages=7, write_policy="write_back")
    assert "Belady MIN (12 pages = L1 + L2: exclusive (write_back))" in names(simulate(
        cfg, lambda: iter(random_reqs(2, 30)), policies=[]))
