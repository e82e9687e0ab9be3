"""Run a pytest suite in a subprocess that can never hang the run that started it.

The child gets its own process group (``start_new_session``) and writes to a file, not a
pipe (a grandchild holding a pipe open kept ``subprocess.run`` waiting after the child
was killed). At ``timeout_s`` the whole group is killed and the failure names the test
that was running (the ``hicache_suite_guard`` plugin records each test as it starts).
Once the child has printed pytest's summary line it has ``EXIT_GRACE_S`` to exit; one
still waiting (on children it left behind) is killed and judged by its summary. Every
``PROGRESS_S`` a line on the terminal says which test it is at (pytest captures the
rest), so a long engine suite is never silent for more than that.
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, NamedTuple

import pytest

GUARD_DIR = Path(__file__).resolve().parents[1] / "integrations" / "suite_guard"
EXIT_GRACE_S = 60.0
POLL_S = 1.0
PROGRESS_S = 120.0
# pytest's last line: "==== 3 passed, 1 skipped in 2.10s ====", or without the rules under -q
_SUMMARY = re.compile(r"^=*\s*(?:\d+ [a-z]+|no tests ran)[^\n]* in [\d.]+s\b[^\n]*$", re.MULTILINE)


class SuiteRun(NamedTuple):
    returncode: int
    output: str  # stdout and stderr, interleaved
    note: str  # how it ended when not by itself ("" when it exited on its own)


def run_suite(argv: list[str], cwd: Path | str, env: dict[str, str], timeout_s: float, what: str,
              pytest_child: bool = True) -> SuiteRun:
    """Run ``argv`` (a ``python -m pytest ...`` command; any command with ``pytest_child=False``)
    in ``cwd``; ``pytest.fail`` naming ``what``, the test running and the output so far when it
    passes ``timeout_s``."""
    with tempfile.TemporaryDirectory(prefix="hicache-suite-") as d:
        out_path, running = Path(d) / "output", Path(d) / "running"
        if pytest_child:
            env = {**env, "SUITE_GUARD_RUNNING_FILE": str(running),
                   "PYTHONPATH": os.pathsep.join(p for p in (str(GUARD_DIR), env.get("PYTHONPATH", "")) if p)}
            argv = [*argv, "-p", "hicache_suite_guard"]
        with open(out_path, "wb") as out:
            proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            note = _wait(proc, out_path, timeout_s, lambda s: _progress(what, s, running))
        finally:
            _kill_group(proc)
        output = out_path.read_text(errors="replace")
        if note == "deadline":
            now = running.read_text() if running.exists() else "none started yet"
            pytest.fail(f"{what} did not finish within {timeout_s:.0f} s; killed its process group"
                        + (f". The test running then: {now}" if pytest_child else "")
                        + f". Output so far:\n{output[-6000:]}")
    if note:
        rc = 1 if re.search(r"\d+ (failed|errors?)\b", summary_line(output)) else 0
        return SuiteRun(rc, output, note)
    return SuiteRun(proc.returncode, output, "")


def summary_line(output: str) -> str:
    """pytest's last summary line in ``output`` ("" when there is none)."""
    found = _SUMMARY.findall(output)
    return found[-1] if found else ""


def _progress(what: str, elapsed_s: float, running: Path) -> None:
    at = running.read_text() if running.exists() else "starting"
    sys.__stderr__.write(f"\n  [{what}: {elapsed_s / 60:.0f} min, at {at}]\n")
    sys.__stderr__.flush()


def _wait(proc: subprocess.Popen, out_path: Path, timeout_s: float, progress: Callable[[float], None]) -> str:
    """"" once ``proc`` exits; "deadline" past ``timeout_s``; a note when it printed its
    summary but did not exit within ``EXIT_GRACE_S``. Calls ``progress(seconds)`` every
    ``PROGRESS_S``."""
    start = time.monotonic()
    deadline, next_report = start + timeout_s, start + PROGRESS_S
    summary_at = None
    while True:
        try:
            proc.wait(POLL_S)
            return ""
        except subprocess.TimeoutExpired:
            pass
        now = time.monotonic()
        if now >= next_report:
            progress(now - start)
            next_report = now + PROGRESS_S
        if summary_at is None and _SUMMARY.search(_tail(out_path)):
            summary_at = now
        if summary_at is not None and now - summary_at > EXIT_GRACE_S:
            return (f"it printed its summary but had not exited {EXIT_GRACE_S:.0f} s later (children it left "
                    "behind?); its process group was killed")
        if now > deadline:
            return "deadline"


def _tail(path: Path, nbytes: int = 4096) -> str:
    with open(path, "rb") as f:
        f.seek(max(0, path.stat().st_size - nbytes))
        return f.read().decode(errors="replace")


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the child's whole process group (its grandchildren too), then reap the child."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()
