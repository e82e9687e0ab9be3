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


def test_second_process_is_served_from_l3(tmp_path, capsys):
    first = run(tmp_path, "same")
    capsys.readouterr()
    second = run(tmp_path, "same")
    out = capsys.readouterr().out
    a, b = first["rows"][0], second["rows"][0]
    assert a["l3_hit_tokens"] == 0 and a["earlier_runs_hit_tokens"] == 0
    assert b["l3_hit_tokens"] > 0
    assert b["recomputed_tokens"] < a["recomputed_tokens"]
    # The oracle covers this run only; what beats it is exactly what earlier runs left in L3.
    oracle = {r["name"]: r for r in second["rows"]}["infinite cache (oracle)"]
    assert b["earlier_runs_hit_tokens"] > 0
    assert b["hit_tokens"] <= oracle["hit_tokens"] + b["earlier_runs_hit_tokens"]
    assert b["earlier_runs_hit_tokens"] <= b["hit_tokens"]
    assert (f"of this run's infinite-cache hit rate; the oracle starts empty, while L3 served "
            f"{b['earlier_runs_hit_tokens']:,} tokens") in out
    # bytes moved to and from L3 are what the backend stored and returned
    assert a["bytes_moved"]["l3_put"] == a["l3"]["bytes_written"] > 0 and not a["l3"]["down_at_end"]
    assert b["bytes_moved"]["l3_get"] == b["l3"]["bytes_read"] > 0


def test_replay_against_a_service_that_is_not_running_says_to_start_it(tmp_path, capsys):
    """Service mode maps the service's segment as L2 at start: no service, no run (exit 2, no traceback)."""
    sock = tmp_path / "no-such.sock"
    assert main(["replay", "--quiet", "--scale", "tiny", "--no-baselines", "--service", str(sock)]) == 2
    err = capsys.readouterr().err
    assert f"--service {sock}: no hicache service listens there" in err
    assert "start `hicache serve` first" in err and "Traceback" not in err


def test_unreachable_l3_reports_no_stored_bytes_and_says_it_was_down(tmp_path, capsys):
    for flags in (["--set", "storage.url=redis://127.0.0.1:1/0"],):
        out = tmp_path / "down.json"
        assert main(["replay", "--quiet", "--scale", "tiny", "--no-baselines", "--json", str(out), *flags]) == 0
        row = json.loads(out.read_text())["rows"][0]
        text = capsys.readouterr().out
        assert row["bytes_moved"]["l3_put"] == 0 and row["bytes_moved"]["d2h"] > 0, flags
        assert row["l3"]["pages_stored"] == 0 and row["l3"]["pages_dropped"] > 0 and row["l3"]["down_at_end"]
        assert f"L3 was down at the end of the run: {row['l3']['pages_dropped']:,} pages not stored" in text


def test_plot_is_against_requests_with_named_capacity_lines_and_an_l3_series(tmp_path, monkeypatch):
    from hicache.reference import replay
    report = run(tmp_path, "p", "--no-baselines")
    saved = {}
    import matplotlib.figure
    real = matplotlib.figure.Figure.savefig
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig",
                        lambda fig, *a, **k: (saved.setdefault("fig", fig), real(fig, *a, **k))[1])
    replay.plot(report, str(tmp_path / "p.png"))
    top, bottom = saved["fig"].axes
    assert bottom.get_xlabel() == "requests admitted"
    labels = [t.get_text() for ax in (top, bottom) for t in ax.get_legend().get_texts()]
    assert "L1 capacity (128 pages)" in labels and "L2 capacity (2,048 pages)" in labels
    assert "of which served from L3" in labels
    s = report["series"]
    assert [line.get_xdata().tolist() for line in top.get_lines()][0] == [p["admitted"] for p in s]
    assert s[-1]["admitted"] == report["rows"][0]["requests"]
    assert s[-1]["l3_hit_tokens"] == report["rows"][0]["l3_hit_tokens"]


def test_bad_trace_path_is_a_clear_error(tmp_path, capsys):
    bad = tmp_path / "t.jsonl"
    bad.write_text('{"hicache_trace": 1, "name": "x", "vocab": 10}\n{"rid": 5}\n')
    assert main(["replay", str(bad), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "t.jsonl:2" in err and "arrival" in err
