"""The subprocess suites can never hang the test command.

Each engine suite (vLLM's, SGLang's, the connector's, the connector bench) runs
through ``tests/helpers/suite_run.py``: its own process group, output to a file,
a deadline below the wrapper's own pytest timeout that kills the whole group and
names the test that was running, and a short grace after pytest's summary for a
child that waits on children it left behind. The wrappers are checked here with
``run_suite`` replaced by a recorder (no engine runs); ``run_suite`` itself runs
small real pytest children that hang in the ways the engine suites did.
"""
from __future__ import annotations

import os
import sys
import textwrap

import pytest

from tests.helpers import suite_run
from tests.integrations import (test_sglang_suite, test_vllm_connector_bench, test_vllm_engine_suite,
                                test_vllm_suites)

WRAPPERS = [(test_sglang_suite, "test_sglang_suite_passes_in_its_environment", ("redis://x",)),
            (test_vllm_suites, "test_hicache_vllm_integration_tests", ()),
            (test_vllm_suites, "test_vllm_own_offload_suites", ()),
            (test_vllm_engine_suite, "test_vllm_cpu_engine", ("test_engine.py",))]


def _pytest_timeout(fn, config) -> float:
    marks = [m for m in getattr(fn, "pytestmark", []) if m.name == "timeout"]
    return float(marks[0].args[0]) if marks else float(config.getini("timeout"))


def _fake_env(monkeypatch, tmp_path, run):
    monkeypatch.setattr(test_sglang_suite, "PYTHON", type(test_sglang_suite.PYTHON)(sys.executable))
    monkeypatch.setattr(test_vllm_suites, "PY", type(test_vllm_suites.PY)(sys.executable))
    monkeypatch.setattr(test_vllm_suites, "VLLM_TESTS", tmp_path)
    monkeypatch.setattr(test_vllm_engine_suite, "PY", type(test_vllm_engine_suite.PY)(sys.executable))
    monkeypatch.setattr(suite_run, "run_suite", run)


@pytest.mark.parametrize("module,name,args", WRAPPERS, ids=[w[1] for w in WRAPPERS])
def test_each_wrapper_times_out_its_subprocess_before_pytest_does(module, name, args, monkeypatch, tmp_path,
                                                                   pytestconfig):
    seen: list[float] = []

    def run(argv, cwd, env, timeout_s, what, pytest_child=True):
        seen.append(timeout_s)
        return suite_run.SuiteRun(0, "....\n===== 4 passed in 1.0s =====\n", "")
    _fake_env(monkeypatch, tmp_path, run)
    fn = getattr(module, name)
    fn(*args)
    assert len(seen) == 1
    assert seen[0] + 30 <= _pytest_timeout(fn, pytestconfig), (name, seen[0], _pytest_timeout(fn, pytestconfig))


def test_the_connector_bench_runs_in_its_own_group_too(monkeypatch, pytestconfig):
    seen = []
    monkeypatch.setattr(suite_run, "run_suite", lambda argv, cwd, env, t, what, pytest_child=True:
                        seen.append((t, pytest_child)) or suite_run.SuiteRun(1, "boom", ""))
    monkeypatch.setattr(test_vllm_connector_bench, "PY", type(test_vllm_connector_bench.PY)(sys.executable))
    monkeypatch.setattr(test_vllm_connector_bench.pathlib.Path, "is_dir", lambda self: True)
    with pytest.raises(AssertionError, match="boom"):
        test_vllm_connector_bench.test_bench_smoke()
    fn = test_vllm_connector_bench.test_bench_smoke
    assert seen[0][1] is False and seen[0][0] + 30 <= _pytest_timeout(fn, pytestconfig)


ENV = {**os.environ, "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}  # the child starts in about a second


def _suite(tmp_path, body: str) -> list[str]:
    (tmp_path / "test_child.py").write_text(textwrap.dedent(body))
    return [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly", "test_child.py"]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"


def test_a_hung_suite_is_killed_with_its_grandchildren_and_names_the_running_test(tmp_path, monkeypatch, capfd):
    argv = _suite(tmp_path, f"""
        import subprocess, time
        def test_fine():
            pass
        def test_stuck():
            p = subprocess.Popen(["sleep", "600"])  # a grandchild holding our output open
            open({str(tmp_path / 'grandchild')!r}, "w").write(str(p.pid))
            time.sleep(600)
        """)
    monkeypatch.setattr(suite_run, "PROGRESS_S", 10.0)
    with pytest.raises(pytest.fail.Exception) as e:
        suite_run.run_suite(argv, tmp_path, ENV, 30, "the child suite")
    assert "[the child suite: 0 min, at test_child.py::test_stuck]" in capfd.readouterr().err  # on the terminal
    msg = str(e.value)
    assert "the child suite did not finish within 30 s; killed its process group" in msg, msg
    assert "The test running then: test_child.py::test_stuck" in msg, msg
    assert not _alive(int((tmp_path / "grandchild").read_text()))


def test_non_daemon_children_left_blocked_on_a_queue_do_not_hold_the_exit(tmp_path):
    """vLLM's multiprocess race test, timed out, left children blocked on a queue; pytest
    then waited in multiprocessing's exit-time join forever. The guard kills them at exit."""
    argv = _suite(tmp_path, """
        import multiprocessing as mp
        def _wait(q):
            q.get()
        def test_leaves_a_child():
            ctx = mp.get_context("spawn")
            q = ctx.Queue()
            ctx.Process(target=_wait, args=(q,)).start()  # not daemon, never released
        """)
    out = suite_run.run_suite(argv, tmp_path, ENV, 120, "the child suite")
    assert (out.returncode, out.note) == (0, ""), out.output
    assert "1 passed" in suite_run.summary_line(out.output)
    assert "hicache_suite_guard: killed 1 multiprocessing child(ren)" in out.output


def test_a_suite_that_will_not_exit_after_its_summary_is_judged_by_it(tmp_path, monkeypatch):
    monkeypatch.setattr(suite_run, "EXIT_GRACE_S", 1.0)
    argv = _suite(tmp_path, """
        import atexit, time
        atexit.register(time.sleep, 600)  # what an exit-time join on a stuck child looks like
        def test_ok():
            pass
        """)
    out = suite_run.run_suite(argv, tmp_path, ENV, 120, "the child suite")
    assert out.returncode == 0 and "had not exited 1 s later" in out.note, out
    assert "1 passed" in suite_run.summary_line(out.output)
