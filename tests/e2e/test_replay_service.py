"""``hicache replay --service``: per-tier hits are never negative and l3_put /
l3_get are what the service's L3 stored and returned (it writes behind, and
this process has no L3 client of its own), in the table and in ``--json``.
``done in`` counts the process's start-up."""
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import urllib.request
import uuid

from hicache.cli import main
from hicache.cli import process_age_s
from tests.conftest import free_port


def _serve(env: dict) -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, "-m", "hicache.cli", "serve"], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, env=env)
    line = p.stdout.readline()
    if not line.startswith("hicache serve: REST"):
        p.kill()
        raise AssertionError(line + p.communicate(timeout=60)[1])
    return p


def _serve_with(monkeypatch, sock: str, port: int, l3_url: str, host_pages: int) -> subprocess.Popen:
    """A node service on ``sock`` / ``port`` with only these settings, which this test's
    own replays read too (every other ``HICACHE_*`` variable is dropped for both)."""
    settings = {"HICACHE_SERVICE__SOCKET_PATH": sock, "HICACHE_SERVICE__PORT": str(port),
                "HICACHE_STORAGE__URL": l3_url, "HICACHE_POOL__HOST_PAGES": str(host_pages),
                "HICACHE_SERVICE__SHM_NAME": f"hicache-replay-{uuid.uuid4().hex[:8]}"}
    env = {k: v for k, v in os.environ.items() if not k.startswith("HICACHE_")} | settings
    for k in [k for k in os.environ if k.startswith("HICACHE_")]:
        monkeypatch.delenv(k)
    for k, v in settings.items():
        monkeypatch.setenv(k, v)
    return _serve(env)


def _service_l3_bytes(port: int) -> tuple[int, int, int]:
    """The service's own L3 figures from its REST stats: bytes written, bytes read, page bytes."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/stats", timeout=30) as r:
        st = json.load(r)
    return st["tiers"]["L3"]["bytes_written"], st["tiers"]["L3"]["bytes_read"], st["page_bytes"]


def test_replay_through_the_service_reports_its_l3_traffic_and_no_negative_hits(tmp_path, capsys, monkeypatch):
    sock = f"{tempfile.mkdtemp(prefix='hcr-')}/s.sock"
    port = free_port()
    serve = _serve_with(monkeypatch, sock, port, f"file://{tmp_path}/l3", 64)
    rows, puts = [], []
    try:
        for i in range(2):
            out = tmp_path / f"r{i}.json"
            # A small L1 (12 pages) makes room-making evictions during admissions likely.
            assert main(["replay", "--quiet", "--scale", "tiny", "--no-baselines", "--service", sock,
                         "--set", "pool.device_pages=12", "--json", str(out)]) == 0
            text = capsys.readouterr().out
            row = json.loads(out.read_text())["rows"][0]
            rows.append(row)
            puts.append(row["bytes_moved"]["l3_put"])
            assert "l3_put / l3_get: the service's L3 during this run" in text, text
            moved = re.search(r"l3_put ([\d.]+) MiB, l3_get ([\d.]+) MiB", text)
            assert moved and float(moved.group(1)) == round(row["bytes_moved"]["l3_put"] / 2**20, 1), text
            written, read, page_bytes = _service_l3_bytes(port)
            assert written == sum(puts), (written, puts)  # the service's own count, this engine alone
            assert row["bytes_moved"]["l3_put"] == row["l3"]["pages_stored"] * page_bytes
            assert row["bytes_moved"]["l3_get"] == row["l3"]["pages_read"] * page_bytes
            assert row["l3"]["write_behind_settled"] and row["l3"]["service"]
    finally:
        serve.send_signal(signal.SIGTERM)
        err = serve.communicate(timeout=60)[1]
    assert serve.returncode == 0, err
    for row in rows:
        hits = [row[k] for k in ("l1_hit_tokens", "l2_hit_tokens", "l3_hit_tokens", "recomputed_tokens")]
        assert min(hits) >= 0, hits
        assert row["l1_hit_tokens"] + row["l2_hit_tokens"] + row["l3_hit_tokens"] == row["hit_tokens"]
    assert puts[0] > 0  # the first run's pages were new to the service


def test_process_age_counts_time_before_the_first_line_of_the_program():
    code = "import time; time.sleep(1.0); from hicache.cli import process_age_s; print(process_age_s())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert float(out.stdout) >= 1.0
    assert process_age_s() > 0


def test_done_in_counts_start_up_when_run_as_the_hicache_command(tmp_path):
    # The command's own entry point (argv from sys.argv), after a second of "start-up".
    code = ("import sys, time; time.sleep(1.0); from hicache.cli import main; "
            "sys.argv = ['hicache', 'replay', '--quiet', '--scale', 'tiny', '--no-baselines', "
            "'--set', 'storage.url=memory://']; sys.exit(main())")
    env = {k: v for k, v in os.environ.items() if not k.startswith("HICACHE_")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env,
                         cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    m = re.search(r"^done in ([\d.]+)s \(([\d.]+)s of it start-up: Python, imports, configuration\)$",
                  out.stdout, re.M)
    assert m, out.stdout
    total, startup = float(m.group(1)), float(m.group(2))
    assert startup >= 1.0 and total >= startup, (total, startup)


def test_replay_credits_earlier_pages_to_the_shared_l2_and_plots_the_segment(tmp_path, capsys, monkeypatch):
    """A service with no L3: a second replay's hits beyond its own oracle come from the
    pages the first left in the shared segment. The summary credits them to the shared
    L2 (never to L3), and the plot's L2 line is the segment's occupancy, not this
    process's private pool (which is empty in service mode)."""
    from hicache.reference import replay
    sock = f"{tempfile.mkdtemp(prefix='hcr-')}/s.sock"
    port = free_port()
    serve = _serve_with(monkeypatch, sock, port, "", 512)
    reports, texts = [], []
    try:
        for i in range(2):
            out = tmp_path / f"r{i}.json"
            assert main(["replay", "--quiet", "--scale", "tiny", "--service", sock, "--json", str(out)]) == 0
            texts.append(capsys.readouterr().out)
            reports.append(json.loads(out.read_text()))
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/stats", timeout=30) as r:
            committed = json.load(r)["tiers"]["L2"]["used_pages"]
    finally:
        serve.send_signal(signal.SIGTERM)
        err = serve.communicate(timeout=60)[1]
    assert serve.returncode == 0, err
    first, second = reports
    by = second["rows"][0]["earlier_runs_hit_tokens_by_tier"]
    assert by["L3"] == 0 and by["L2"] > 0 and sum(by.values()) == second["rows"][0]["earlier_runs_hit_tokens"]
    assert f"while the shared L2 served {sum(by.values()):,} tokens of pages that earlier runs stored" in texts[1]
    assert "L3 served" not in texts[1]
    assert first["rows"][0]["earlier_runs_hit_tokens"] == 0
    # The segment's occupancy, sampled each step: it grows from 0 as the first run commits.
    l2 = [p["l2_used"] for p in first["series"]]
    assert l2[-1] > 0 and l2 == sorted(l2) and max(l2) <= committed <= first["config"]["L2_pages"]
    assert [p["l2_used"] for p in second["series"]][0] >= l2[-1]  # the second run starts on the first's pages
    saved = {}
    import matplotlib.figure
    real = matplotlib.figure.Figure.savefig
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig",
                        lambda fig, *a, **k: (saved.setdefault("fig", fig), real(fig, *a, **k))[1])
    replay.plot(first, str(tmp_path / "p.png"))
    labels = [t.get_text() for t in saved["fig"].axes[1].get_legend().get_texts()]
    assert "L2 pages cached: the service's shared segment (every engine)" in labels
