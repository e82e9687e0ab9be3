"""The long ``hicache replay`` modes say what is ahead and draw progress on stderr,
leave stdout's report as it was, and never let a log line break a bar (or leak
a secret through the bar's handler)."""
import json
import logging
import re

import pytest

from hicache.cache import hybrid
from hicache.cli import main
from hicache.core.redact import Redactor, install_log_redaction
from hicache.reference.progress import Progress, logs_above_bars

pytestmark = pytest.mark.usefixtures("one_torch_thread")
MEM = ["--set", "storage.url=memory://", "--set", "simulate.l3_url=memory://"]


def _report(out: str) -> list[str]:
    """The report without what varies between runs (times)."""
    return [re.sub(r"\d+\.\d+ ?m?s\b|\d+%", "T", ln) for ln in out.splitlines() if not ln.startswith("done in")]


def test_simulate_says_what_is_ahead_draws_a_bar_per_pass_and_keeps_its_report(capsys):
    assert main(["replay", "--simulate", "--scale", "tiny", *MEM]) == 0
    out, err = capsys.readouterr()
    # 15 requests, 4 passes: hicache, the baselines' page stream, GPU-only (always lru), L1+L2
    # (the default policy)
    from hicache.core.config import HiCacheConfig
    default = HiCacheConfig.load(env={}).policy.device_eviction
    assert "simulating built-in mixed trace (tiny): 4 passes over 15 requests; --limit N replays only" in err
    for run in (f"hicache L1+L2+L3 ({default})", "page stream (baselines)", "GPU-only prefix cache (L1, lru)",
                f"hicache L1+L2 ({default})"):
        assert re.search(re.escape(run) + r": +0%\|.*\| 0/15 \[", err), (run, err[-2000:])  # total known
    assert main(["replay", "--simulate", "--scale", "tiny", "--quiet", *MEM]) == 0
    quiet_out, quiet_err = capsys.readouterr()
    assert quiet_err == "" and _report(quiet_out) == _report(out)


def test_sweep_counts_its_points_and_suggests_limit(capsys, tmp_path):
    assert main(["replay", "--sweep", "--scale", "tiny", "--limit", "10", "--plot", str(tmp_path / "s.png"),
                 *MEM]) == 0
    out, err = capsys.readouterr()
    points = len(re.findall(r"^L[123] ", out, re.M))
    assert points > 0
    assert f"sweep: {points} capacity points, each a whole replay of 10 requests" in err
    assert "--limit N replays only the first N" in err
    notes = re.findall(r"sweep point (\d+) of (\d+), [^:\n]* so far(, about [^:\n]* left)?: L[123] ", err)
    assert [(int(k), int(n)) for k, n, _ in notes] == [(k, points) for k in range(1, points + 1)], err[-3000:]
    assert [bool(eta) for *_, eta in notes] == [False] + [True] * (points - 1)  # an estimate once one is done


def test_point_text_says_where_a_long_run_stands():
    from hicache.reference.progress import point_text
    assert point_text(1, 12, 0.4, 0) == "point 1 of 12, 0 s so far"
    assert point_text(4, 12, 41.0, 3) == "point 4 of 12, 41 s so far, about 2 min 03 s left"
    assert point_text(12, 12, 7300.0, 12) == "point 12 of 12, 2 h 01 min so far, about 0 s left"


def test_hybrid_prints_its_expected_peak_rss_from_the_pools_it_allocates(capsys, monkeypatch, tmp_path):
    """The pool bytes in the expectation are exactly what the HybridCache allocates."""
    allocated = []
    real = hybrid.HybridCache.__init__

    def init(self, *a, **k):
        real(self, *a, **k)
        pools = [self.hc.device_pool, self.hc.host_pool] + [p for s in self.stores.values() for p in (s.device, s.host)]
        allocated.append(sum(p.nbytes() for p in pools))
    monkeypatch.setattr(hybrid.HybridCache, "__init__", init)
    for shape in ("gpt-oss-120b", "qwen3-next-80b-a3b"):
        out = tmp_path / f"{shape}.json"
        assert main(["replay", "--hybrid", shape, "--scale", "tiny", "--set", "storage.url=", "--json", str(out)]) == 0
        err = capsys.readouterr().err
        r = json.loads(out.read_text())
        assert r["pool_bytes"] == allocated[-1] > 0
        m = re.search(r"expected peak RSS: about ([\d.]+) GiB \(the pools ([\d.]+) GiB", err)
        assert m and float(m.group(2)) == round(allocated[-1] / 2**30, 2), err
        assert float(m.group(1)) >= float(m.group(2))
        assert err.index("expected peak RSS") < err.index(f"--hybrid {shape}")  # before the bar starts


def test_a_warning_prints_above_the_bar_on_a_line_of_its_own_and_redacted(capsys):
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    import sys
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(levelname)s %(message)s"))
    root.handlers[:] = [handler]
    root.setLevel(logging.WARNING)
    red = Redactor(["S3cr3t-pass-123456"])
    install_log_redaction(red)
    try:
        with logs_above_bars():
            p = Progress(True, 3)
            for i in p.wrap(range(3), "work"):
                if i == 1:
                    logging.getLogger("hicache.test").warning("L3 redis://:S3cr3t-pass-123456@h:1/0 is down")
        logging.getLogger("hicache.test").warning("after S3cr3t-pass-123456")
    finally:
        root.handlers[:], _ = saved[0], root.setLevel(saved[1])
    err = capsys.readouterr().err
    lines = re.split(r"[\r\n]", err)
    assert "WARNING L3 redis://:***@h:1/0 is down" in lines, err  # whole, not cut by the bar
    assert "S3cr3t" not in err
    assert "WARNING after ***" in lines
    assert root.handlers == saved[0]
