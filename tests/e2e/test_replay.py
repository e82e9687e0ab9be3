"""``hicache replay``: runs on defaults, is deterministic, writes JSON and a PNG,
and its baselines bracket the real run."""
import json

from hicache.cli import main


def run(tmp_path, name, *extra):
    out = tmp_path / f"{name}.json"
    rc = main(["replay", "--quiet", "--scale", "tiny", "--json", str(out),
               "--set", f"storage.url=file://{tmp_path}/l3-{name}", *extra])
    assert rc == 0
    return json.loads(out.read_text())


def test_replay_is_deterministic_and_bracketed(tmp_path, capsys):
    png = tmp_path / "plot.png"
    a = run(tmp_path, "a", "--plot", str(png), "--set", "pool.device_pages=12")
    b = run(tmp_path, "b", "--set", "pool.device_pages=12")
    strip = lambda r: [{k: v for k, v in row.items() if k != "time_s"} for row in r["rows"]]
    assert strip(a) == strip(b)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    rows = {r["name"]: r for r in a["rows"]}
    ours, l1, oracle, none = (rows["hicache (L1+L2+L3)"], rows["L1-only radix cache"],
                              rows["infinite cache (oracle)"], rows["no cache"])
    assert none["hit_rate"] == 0 and none["recomputed_tokens"] == ours["prompt_tokens"]
    assert l1["hit_rate"] <= ours["hit_rate"] <= oracle["hit_rate"] + 1e-9
    assert ours["hit_tokens"] + ours["recomputed_tokens"] >= ours["prompt_tokens"]
    assert ours["l2_hit_tokens"] > 0  # L1 of 12 pages is smaller than the working set
    out = capsys.readouterr().out
    assert "infinite-cache hit rate" in out and "hit rate" in out


def test_second_process_is_served_from_l3(tmp_path):
    first = run(tmp_path, "same", "--no-baselines")
    second = run(tmp_path, "same", "--no-baselines")
    assert first["rows"][0]["l3_hit_tokens"] == 0
    assert second["rows"][0]["l3_hit_tokens"] > 0
    assert second["rows"][0]["recomputed_tokens"] < first["rows"][0]["recomputed_tokens"]


def test_bad_trace_path_is_a_clear_error(tmp_path, capsys):
    bad = tmp_path / "t.jsonl"
    bad.write_text('{"hicache_trace": 1, "name": "x", "vocab": 10}\n{"rid": 5}\n')
    assert main(["replay", str(bad), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "t.jsonl:2" in err and "arrival" in err
