"""--simulate --policies: every policy at every capacity with its rank and the gap it
closes; the generated workloads are valid hash-block traces with the documented shape."""
from __future__ import annotations

import json
import re

import pytest

from hicache.cli import main as cli_main
from hicache.core.config import HiCacheConfig
from hicache.core.errors import ConfigError
from hicache.reference import workloads as sw
from hicache.reference.hash_trace import iter_hash_trace
from hicache.reference.sim_policies import format_policy_sweep, parse_capacities, plot_policy_sweep, policy_sweep
from hicache.reference.sim_report import sweep_caption
from hicache.reference.simulate import trace_requests

from tests.reference.test_simulate import write_hash_trace


def test_parse_capacities():
    assert parse_capacities("0.25M,2M,500K,4096") == [250_000, 2_000_000, 500_000, 4096]
    with pytest.raises(ConfigError, match="'2MB'"):
        parse_capacities("1M,2MB")


def hash_trace(tmp_path):
    lines = [(i * 10, 9, [i % 3, 10 + i % 5, 20 + i]) for i in range(30)]
    return write_hash_trace(tmp_path / "h.jsonl", lines)


def policy_cfg() -> HiCacheConfig:
    """The sweep's configuration: pages of 4 tokens, tier sizes left to --capacities."""
    sets = {"simulate.page_size": "4", "simulate.block_tokens": "4", "storage.url": ""}
    return HiCacheConfig.load(None, sets, env={})


def test_every_policy_at_every_capacity_with_ranks_and_gap(tmp_path):
    cfg = policy_cfg()
    factory = trace_requests(hash_trace(tmp_path), cfg.simulate)
    log: list[str] = []
    out = policy_sweep(cfg, factory, ["lru", "fifo", "mru"], [12, 24], log=log.append)
    assert len(out["runs"]) == 2 * 2 * 3 and len(log) == 2 * (1 + 2 * 3)  # a progress line per run
    assert [re.match(r"\[point (\d+) of 14, ", line).group(1) for line in log] == [str(k) for k in range(1, 15)]
    assert all(", about " in line and " left]" in line for line in log), log  # each with the time left
    for r in out["runs"]:
        same = [x for x in out["runs"] if (x["mode"], x["capacity_tokens"]) == (r["mode"], r["capacity_tokens"])]
        assert r["rank"] == 1 + sum(x["hit_tokens"] > r["hit_tokens"] for x in same)  # ties share a rank
        assert r["hit_rate"] <= out["belady"][r["capacity_tokens"]] + 1e-12  # nothing beats MIN
        if r["policy"] == "lru":
            assert r["gap_closed"] in (0.0, None)
    gpu12 = {r["policy"]: r for r in out["runs"] if r["mode"] == "GPU-only" and r["capacity_tokens"] == 12}
    assert gpu12["lru"]["l1_pages"] == 3 and gpu12["lru"]["l2_pages"] == 0  # 12 tokens = 3 pages of 4
    text = format_policy_sweep(out, "h")
    assert "GPU-only" in text and "L1+L2" in text and "(1)" in text and "lru gap closed" in text
    png = tmp_path / "p.png"
    plot_policy_sweep(out, str(png), "t")
    assert png.stat().st_size > 10_000


def test_cli_policies_all_prints_each_policy_and_its_rank(tmp_path, capsys):
    path = hash_trace(tmp_path)
    rc = cli_main(["replay", path, "--simulate", "--block-tokens", "4", "--set", "simulate.page_size=4",
                   "--policies", "all", "--capacities", "16,40", "--json", str(tmp_path / "r.json")])
    out = capsys.readouterr().out
    assert rc == 0
    rep = json.loads((tmp_path / "r.json").read_text())
    assert len(rep["policies"]) >= 8 and {r["policy"] for r in rep["runs"]} == set(rep["policies"])
    for p in rep["policies"]:
        assert p in out
    assert cli_main(["replay", path, "--simulate", "--policies", "lru,nope"]) == 2


def test_sweep_caption_says_where_capacity_stops_paying():
    pts = [{"tier": "L1", "bytes": b, "hit_rate": h} for b, h in ((1 << 30, 0.1), (1 << 31, 0.39), (1 << 32, 0.4))]
    cap = sweep_caption({"working_set_bytes": 1 << 32, "infinite_hit_rate": 0.4, "points": pts})
    assert "2.0 GiB" in cap and "4.0 GiB" in cap


@pytest.mark.parametrize("name", sorted(sw.WORKLOADS))
def test_generated_workloads_are_valid_and_deterministic(tmp_path, name):
    w = sw.WORKLOADS[name]
    small = type(w)(**{**{f: getattr(w, f) for f in w.__dataclass_fields__}, "duration_s": 120.0})
    lines = small.generate(1)
    assert lines == small.generate(1) and lines != small.generate(2)
    path = tmp_path / f"{name}.jsonl"
    sw.write_hash_trace(str(path), lines)
    reqs = list(iter_hash_trace(path, 512))  # the reader's own checks: lengths fit the blocks, times ordered
    assert len(reqs) == len(lines) > 20
    assert all(r.input_length <= sw.MAX_CONTEXT for r in reqs)
    seen: dict[tuple[int, ...], int] = {}
    shared = 0
    for r in reqs:  # a follow-up shares every full block of an earlier prompt, then new ids
        for k in range(len(r.hash_ids), 0, -1):
            if r.hash_ids[:k] in seen:
                shared += 1
                break
        for k in range(1, len(r.hash_ids) + 1):
            seen[r.hash_ids[:k]] = 1
    assert shared > len(reqs) // 3
