"""hicache replay --simulate: hash-block traces, exact counts on tiny traces, miss
reasons that sum to the misses, the offline baselines and the sweep output."""
from __future__ import annotations

import inspect
import json

import numpy as np
import pytest

from hicache.cli import main as cli_main
from hicache.core.config import HiCacheConfig
from hicache.reference import sim_report as bl
from hicache.reference.hash_trace import block_tokens_of, detect_format, iter_hash_trace
from hicache.reference.sim_report import format_sweep, plot_sweep, simulate, sweep
from hicache.reference.simulate import SimPlan, SimRequest, run_hicache, sim_config, trace_requests
from hicache.core.errors import TraceError
from hicache.index.eviction import POLICIES
from hicache.index.misses import REASONS
from hicache.core.shapes import model_shape

PS, BLOCK = 4, 4  # tokens per page, tokens per hash id (one page a block unless said)
PAGE_BYTES = model_shape("llama-3.1-8b").page_bytes(PS)


def write_hash_trace(path, lines) -> str:
    with open(path, "w") as f:
        for ts, n, ids in lines:
            f.write(json.dumps({"timestamp": ts, "input_length": n, "output_length": 3, "hash_ids": ids}) + "\n")
    return str(path)


def reqs(*specs, block=BLOCK):
    """SimRequests from (hash ids, input length[, namespace])."""
    out = []
    for i, (ids, n, *ns) in enumerate(specs):
        key = block_tokens_of(ids, block, PS).reshape(-1)[:n].astype("<u4").tobytes()
        out.append(SimRequest(f"r{i}", float(i), ns[0] if ns else "", key))
    return out


def cfg_for(l1_pages: int, l2_pages: int = 0, l3_pages: int = 0, l3_url: str = "memory://",
            **policy) -> tuple[HiCacheConfig, SimPlan]:
    sets = {"simulate.page_size": PS, "simulate.block_tokens": BLOCK, "simulate.l1_bytes": l1_pages * PAGE_BYTES,
            "simulate.l2_bytes": l2_pages * PAGE_BYTES, "simulate.l3_bytes": l3_pages * PAGE_BYTES,
            "simulate.l3_url": l3_url, "storage.url": "", **{f"policy.{k}": v for k, v in policy.items()}}
    cfg = HiCacheConfig.load(None, {k: str(v) for k, v in sets.items()}, env={})
    return cfg, SimPlan.from_config(cfg.simulate)


def run(cfg, plan, requests, **kw):
    return run_hicache("t", sim_config(cfg, plan, **kw), plan, requests)


def nonzero(misses):
    return {k: v for k, v in misses.items() if v and k in REASONS}


# ------------------------------------------------------------ hash-block reader
def test_detects_both_formats_and_refuses_others(tmp_path):
    h = write_hash_trace(tmp_path / "h.jsonl", [(0, 5, [1, 2])])
    t = tmp_path / "t.jsonl"
    t.write_text('{"hicache_trace": 1, "name": "x", "vocab": 8}\n')
    (tmp_path / "o.jsonl").write_text('{"prompt": [1]}\n')
    assert detect_format(h) == "hash_blocks"
    assert detect_format(t) == "hicache"
    with pytest.raises(TraceError, match=r"unknown trace format .*\['prompt'\]"):
        detect_format(tmp_path / "o.jsonl")


def test_equal_ids_equal_tokens_and_partial_last_block(tmp_path):
    path = write_hash_trace(tmp_path / "h.jsonl", [(0, 13, [7, 8]), (1500, 9, [7, 9])])
    a, b = list(iter_hash_trace(path, block_tokens=8))
    assert (a.arrival, b.arrival, a.input_length, b.output_length) == (0.0, 1.5, 13, 3)
    ta, tb = a.tokens(8, PS), b.tokens(8, PS)
    assert ta.dtype == np.uint32 and len(ta) == 13 and len(tb) == 9  # last block partial
    assert ta[:8].tolist() == tb[:8].tolist()  # block 7 shared
    assert ta[8:9].tolist() != tb[8:9].tolist()  # blocks 8 and 9 differ from their first token
    # page starts carry (id low, id high, page index): ids that differ only above 32 bits differ too
    x, y = block_tokens_of([5, 5 + (1 << 32)], 8, PS)
    assert x[:3].tolist() == [5, 0, 0] and y[:3].tolist() == [5, 1, 0] and x[4:7].tolist() == [5, 0, 1]


def test_reader_streams_line_by_line(tmp_path):
    path = tmp_path / "h.jsonl"
    path.write_text(json.dumps({"timestamp": 0, "input_length": 4, "output_length": 1, "hash_ids": [1]})
                    + "\nnot json\n")
    it = iter_hash_trace(path, block_tokens=4)
    assert inspect.isgenerator(it)
    assert next(it).hash_ids == (1,)  # yielded before the bad line is read
    with pytest.raises(TraceError, match=r"h.jsonl:2: not valid JSON"):
        next(it)


@pytest.mark.parametrize("line, match", [
    ({"timestamp": 0, "input_length": 9, "output_length": 1, "hash_ids": [1, 2]}, r"input_length 9 does not fit"),
    ({"timestamp": 0, "input_length": 4, "output_length": 1, "hash_ids": [1], "x": 1}, r"unknown \['x'\]"),
    ({"timestamp": 0, "input_length": 4, "output_length": 1, "hash_ids": []}, r"'hash_ids'"),
])
def test_reader_names_the_line_and_field(tmp_path, line, match):
    path = tmp_path / "h.jsonl"
    path.write_text(json.dumps({"timestamp": 0, "input_length": 1, "output_length": 1, "hash_ids": [3]}) + "\n"
                    + json.dumps(line) + "\n")
    with pytest.raises(TraceError, match=match):
        list(iter_hash_trace(path, block_tokens=4))


# ------------------------------------------------------- exact counts, by hand
def test_gpu_only_evicted_page_is_an_l1_miss():
    # L1 = 2 pages, no L2. r0 holds P1 P2 (L1 full); r1 evicts them for P3 P4; r2 asks P1 again.
    cfg, plan = cfg_for(l1_pages=2)
    row = run(cfg, plan, reqs(([1, 2], 8), ([3, 4], 8), ([1, 5], 8)), l3=False, backup=False)
    assert (row["hit_tokens"], row["prompt_tokens"]) == (0, 24)
    assert nonzero(row["misses"]) == {"first_use": 2, "l1_evicted": 1, "partial_page": 3}
    assert row["evicted_pages"]["L1"] == 4


def test_pages_after_a_hit_inside_a_node_keep_their_reason():
    # issue 35's reproducer: r1's hit [1 2] ends inside r0's node, two fillers evict everything,
    # r4 asks 1 2 10 11 again: all four were computed before (l1_evicted), not first_use.
    cfg, plan = cfg_for(l1_pages=6)
    five, six = 5 * PS, 6 * PS
    row = run(cfg, plan, reqs(([1, 2, 3, 4, 5], five), ([1, 2, 10, 11, 12], five), (list(range(20, 26)), six),
                              (list(range(30, 36)), six), ([1, 2, 10, 11, 13], five)), l3=False, backup=False)
    assert nonzero(row["misses"]) == {"first_use": 16, "l1_evicted": 4, "partial_page": 5}


def test_l1_keeps_the_head_of_a_victim_then_l2_eviction_is_explained():
    # L1 = 3 pages, L2 = 4, write_through. r1 needs one page more than is free: page-granular
    # eviction takes P2, the tail of [P1 P2] (both backed up), so r2 hits P1 on L1; backing up
    # P5 evicts P2 (an L2 leaf no longer on L1) from L2; r3 hits P1 on L1 and misses P2.
    cfg, plan = cfg_for(l1_pages=3, l2_pages=4)
    row = run(cfg, plan, reqs(([1, 2], 8), ([3, 4], 8), ([1, 5], 8), ([1, 2, 6], 12)), l3=False)
    assert (row["l1_hit_tokens"], row["l2_hit_tokens"], row["l3_hit_tokens"]) == (8, 0, 0)
    assert row["l2_hit_bytes"] == 0
    assert nonzero(row["misses"]) == {"first_use": 2, "l2_evicted": 1, "partial_page": 4}


def test_l3_hit_and_l3_eviction():
    # L1 = L2 = 2 pages, L3 = 4 pages (memory://, LRU): r2's P5 P6 push P1 P2 out of L3;
    # r3's P3 comes back from L3; r4's P1 was evicted from L3.
    cfg, plan = cfg_for(l1_pages=2, l2_pages=2, l3_pages=4)
    row = run(cfg, plan, reqs(([1, 2], 8), ([3, 4], 8), ([5, 6], 8), ([3, 7], 8), ([1, 8], 8)))
    assert (row["l1_hit_tokens"], row["l2_hit_tokens"], row["l3_hit_tokens"]) == (0, 0, 4)
    assert nonzero(row["misses"]) == {"first_use": 3, "l3_evicted": 1, "partial_page": 5}
    assert row["l3_stored_bytes"] == 9 * PAGE_BYTES  # every full page once; P3 was in L3 already


def test_other_namespace_is_the_reason():
    cfg, plan = cfg_for(l1_pages=8)
    row = run(cfg, plan, reqs(([1, 2], 8, "a"), ([1, 2], 8, "b")), l3=False, backup=False)
    assert nonzero(row["misses"]) == {"first_use": 1, "other_namespace": 1, "partial_page": 2}


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_reasons_sum_to_misses_on_the_builtin_trace(policy):
    cfg, plan = cfg_for(l1_pages=32, l2_pages=48, l3_pages=96, device_eviction=policy, host_eviction=policy)
    requests = list(trace_requests(None, cfg.simulate, "tiny")())
    row = run(cfg, plan, requests)
    pages = sum(-(-(len(r.key) // 4) // PS) for r in requests)
    assert row["hit_tokens"] % PS == 0 and row["hit_tokens"] > 0
    assert sum(row["misses"][k] for k in REASONS) == pages - row["hit_tokens"] // PS
    assert row["misses"]["partial_page"] == len(requests) and row["misses"]["forgotten"] == 0


# -------------------------------------------------------------- offline baselines
def test_belady_and_infinite_by_hand():
    # one page a request plus a partial page: pages A B A C B A with room for 2
    seq = [1, 2, 1, 3, 2, 1]
    stream = bl.page_stream(reqs(*[([p, 100 + i], 5) for i, p in enumerate(seq)]), PS)
    assert stream.caps == [1] * 6 and stream.unique_pages == 3  # (the partial pages have no hash)
    assert bl.infinite(stream, PS) == 3 * PS  # A, B, A again
    # MIN with 2 pages: C (never used again) goes at once, so A and B stay
    assert bl.belady(stream, PS, 2) == 3 * PS
    assert bl.belady(stream, PS, 1) == 2 * PS  # keeps A: hits at 3 and 6
    assert bl.belady(stream, PS, 0) == 0


def test_simulate_rows_and_hicache_never_beats_belady(tmp_path):
    path = write_hash_trace(tmp_path / "h.jsonl", [(i * 10, 9, [i % 3, 10 + i % 5, 20 + i]) for i in range(12)])
    cfg, plan = cfg_for(l1_pages=3, l2_pages=4, l3_pages=0, l3_url="")
    rep = simulate(cfg, trace_requests(path, cfg.simulate), policies=sorted(POLICIES))
    rows = {r["name"].split(" (")[0] if "Belady" in r["name"] else r["name"]: r for r in rep["rows"]}
    best = rows["Belady MIN"]["hit_tokens"]
    assert rows["infinite cache"]["hit_tokens"] == 12 * 4 - 3 * 4  # every block seen before, but the 3 first uses
    for name, r in rows.items():
        if name.startswith("hicache L1+L2 ("):
            assert r["hit_tokens"] <= best, name
    assert rows["GPU-only prefix cache (L1, lru)"]["hit_tokens"] <= best


# --------------------------------------------------------------- sweep and CLI
def test_sweep_table_and_png(tmp_path):
    from PIL import Image
    path = write_hash_trace(tmp_path / "h.jsonl", [(i, 9, [i % 4, 10 + i % 3, 20 + i]) for i in range(10)])
    cfg, _ = cfg_for(l1_pages=3, l2_pages=4, l3_pages=8)
    sw = sweep(cfg, trace_requests(path, cfg.simulate), fractions=(0.25, 1.0))
    # a quarter of the working set is 3.5 pages: more than L1 (3), no larger than L2 (4): no L3 point there
    assert [(p["tier"], p["bytes"] / PAGE_BYTES) for p in sw["points"]] == [
        ("L1", 3.5), ("L1", 14), ("L2", 3.5), ("L2", 14), ("L3", 14)]
    # full pages: block i % 4 (4 distinct), then (i % 4, i % 3) chained (10 distinct in 10 requests)
    assert sw["working_set_bytes"] == (4 + 10) * PAGE_BYTES
    full_l1 = sw["points"][1]["hit_rate"]
    assert full_l1 == pytest.approx(sw["infinite_hit_rate"])  # L1 = the working set: nothing evicted
    table = format_sweep(sw)
    assert table.count("\n") == 1 + 5 and "L3" in table
    png = tmp_path / "s.png"
    plot_sweep(sw, str(png), "test")
    with Image.open(png) as im:
        assert im.format == "PNG" and im.size[0] > 100


def test_cli_simulate_prints_the_report(tmp_path, capsys):
    path = write_hash_trace(tmp_path / "h.jsonl", [(0, 8, [1, 2]), (1000, 7, [1, 3])])
    rc = cli_main(["replay", path, "--simulate", "--block-tokens", "4", "--set", "simulate.page_size=4",
                   "--set", "simulate.l3_url=memory://", "--json", str(tmp_path / "r.json")])
    out = capsys.readouterr().out
    assert rc == 0 and "bytes accounted, not moved" in out
    rep = json.loads((tmp_path / "r.json").read_text())
    first = rep["rows"][0]
    assert (first["requests"], first["prompt_tokens"], first["hit_tokens"]) == (2, 15, 4)
    assert nonzero(first["misses"]) == {"first_use": 1, "partial_page": 2}  # r1: P1 hit, P3 partial


def test_cli_refuses_a_hash_trace_without_simulate(tmp_path, capsys):
    path = write_hash_trace(tmp_path / "h.jsonl", [(0, 8, [1, 2])])
    assert cli_main(["replay", path]) == 2
    assert "replay it with --simulate" in capsys.readouterr().err


def test_file_l3_serves_what_l1_and_l2_lost(tmp_path):
    # L1 = L2 = 2 pages, an uncapped file:// L3: r1 pushes P1 P2 out of L1 and L2; r2's P1 comes from L3.
    cfg, plan = cfg_for(l1_pages=2, l2_pages=2, l3_pages=64, l3_url=f"file://{tmp_path}/l3")
    row = run(cfg, plan, reqs(([1, 2], 8), ([3, 4], 8), ([1, 5], 8)))
    assert (row["l1_hit_tokens"], row["l2_hit_tokens"], row["l3_hit_tokens"]) == (0, 0, 4)
    assert nonzero(row["misses"]) == {"first_use": 2, "partial_page": 3}
    assert len(list((tmp_path / "l3").rglob("*"))) >= 5  # the stand-in objects are real files


def test_the_simulate_table_fits_100_columns_unless_wide(tmp_path, capsys):
    """The table was 156 columns wide (a Belady row's whole explanation in its name);
    --wide keeps every column and whole names."""
    path = write_hash_trace(tmp_path / "h.jsonl", [(0, 8, [1, 2]), (1000, 7, [1, 3])])
    argv = ["replay", path, "--simulate", "--block-tokens", "4", "--set", "simulate.page_size=4",
            "--set", "simulate.l3_url=memory://", "--quiet"]
    assert cli_main(argv) == 0
    out = capsys.readouterr().out
    table = out[out.index("\nrun "):out.index("\nmissed pages")].strip("\n").splitlines()
    assert max(len(line) for line in table) <= 100, table
    assert "L3 stored" not in table[0] and any(line.startswith("Belady MIN ") for line in table)
    assert any(line.startswith("  Belady MIN: (") and "inclusive (write_through))" in line for line in table)
    assert cli_main([*argv, "--wide"]) == 0
    wide = capsys.readouterr().out
    assert "L2 used  L3 stored  time" in wide and "Belady MIN (" in wide and max(map(len, wide.splitlines())) > 100
