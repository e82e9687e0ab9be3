"""``bench/l3_stall.py`` runs and leaves nothing behind (issue 27, item 7).

Before the fix it failed at once (``AttributeError: 'TransferController'
object has no attribute 'poll'``) after starting redis-server, and each
failed run left that redis-server and a temporary directory behind. Each
test reads the redis-server pid the bench prints and checks it is gone,
whether the run ends normally, fails, is terminated or is killed.
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench" / "l3_stall.py"
SHORT = ["--before", "0.3", "--freeze", "0.6", "--after", "0.3"]


def _gone(pid: int, limit: float = 30.0) -> bool:
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        try:
            with open(f"/proc/{pid}/stat") as f:  # reaped by init once orphaned; a zombie is gone too
                if f.read().split()[2] == "Z":
                    return True
        except FileNotFoundError:
            return True
        time.sleep(0.05)
    return False


def _start(*args: str) -> tuple[subprocess.Popen, int]:
    proc = subprocess.Popen([sys.executable, str(BENCH), *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    line = proc.stdout.readline()
    m = re.match(r"redis-server pid (\d+) port \d+", line)
    assert m, (line, proc.stderr.read() if proc.poll() is not None else "")
    return proc, int(m.group(1))


def test_runs_and_prints_every_phase_with_drains():
    proc, redis = _start(*SHORT, "--drain", "drain")
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-2000:]
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line.split()[:1] in (["before"], ["frozen"], ["after"])}
    assert set(rows) == {"before", "frozen", "after"}, out
    assert all(int(r[1]) > 0 and int(r[8]) > 0 for r in rows.values()), out  # steps, and drains, in each phase
    assert "L3: hits=" in out and _gone(redis)


def test_a_failing_run_stops_redis():
    proc, redis = _start(*SHORT, "--prompts", "0")  # fails in the loop (no prompt to cycle)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode != 0 and "ZeroDivisionError" in err
    assert _gone(redis)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGKILL])
def test_a_stopped_or_killed_run_stops_redis(sig):
    proc, redis = _start("--before", "60", "--freeze", "1", "--after", "1")
    time.sleep(0.5)  # into the loop (or still starting: either way redis-server must go)
    proc.send_signal(sig)
    proc.communicate(timeout=120)
    assert _gone(redis), f"redis-server {redis} outlived the bench ({sig.name})"
