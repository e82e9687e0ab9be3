"""The engine-suite wrappers' pytest timeout covers their subprocess's (issue 36, row 16).

Before the fix ``test_sglang_suite`` and ``test_vllm_own_offload_suites`` gave
their subprocess 900 / 2,400 s under the global 300 s pytest timeout: on a
loaded box pytest killed them at 300 s with no word of the suite's output.
Each wrapper is run here with ``subprocess.run`` replaced by a recorder (no
engine runs): the timeout it passes must be below its own pytest timeout,
with room to report, and a subprocess timeout must be a failure with the
output so far, not a traceback.
"""
from __future__ import annotations

import subprocess
import sys

import pytest

from tests.integrations import test_sglang_suite, test_vllm_suites

WRAPPERS = [(test_sglang_suite, "test_sglang_suite_passes_in_its_environment", ("redis://x",)),
            (test_vllm_suites, "test_hicache_vllm_integration_tests", ()),
            (test_vllm_suites, "test_vllm_own_offload_suites", ())]


def _pytest_timeout(fn, config) -> float:
    marks = [m for m in getattr(fn, "pytestmark", []) if m.name == "timeout"]
    return float(marks[0].args[0]) if marks else float(config.getini("timeout"))


def _fake_env(monkeypatch, tmp_path, run):
    monkeypatch.setattr(test_sglang_suite, "PYTHON", type(test_sglang_suite.PYTHON)(sys.executable))
    monkeypatch.setattr(test_vllm_suites, "PY", type(test_vllm_suites.PY)(sys.executable))
    monkeypatch.setattr(test_vllm_suites, "VLLM_TESTS", tmp_path)
    monkeypatch.setattr(subprocess, "run", run)


@pytest.mark.parametrize("module,name,args", WRAPPERS, ids=[w[1] for w in WRAPPERS])
def test_each_wrapper_times_out_its_subprocess_before_pytest_does(module, name, args, monkeypatch, tmp_path,
                                                                   pytestconfig):
    seen: list[float] = []

    def run(cmd, **kw):
        seen.append(kw["timeout"])
        return subprocess.CompletedProcess(cmd, 0, "1 passed in 1.0s\n", "")
    _fake_env(monkeypatch, tmp_path, run)
    fn = getattr(module, name)
    fn(*args)
    assert len(seen) == 1
    assert seen[0] + 30 <= _pytest_timeout(fn, pytestconfig), (name, seen[0], _pytest_timeout(fn, pytestconfig))


@pytest.mark.parametrize("module,name,args", WRAPPERS, ids=[w[1] for w in WRAPPERS])
def test_a_subprocess_timeout_fails_with_the_output_so_far(module, name, args, monkeypatch, tmp_path):
    def run(cmd, **kw):
        raise subprocess.TimeoutExpired(cmd, kw["timeout"], output=b"....F.. collected so far", stderr=b"")
    _fake_env(monkeypatch, tmp_path, run)
    with pytest.raises(pytest.fail.Exception, match=r"did not finish within \d+ s(.|\n)*collected so far"):
        getattr(module, name)(*args)
