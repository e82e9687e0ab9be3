"""Runs tests/integrations/sglang inside .venv-sglang (SGLang's real code over the
CPU torch build). The main environment has no sglang; this test is how the
README's test command covers the integration. It fails, never skips, when the
environment is missing."""
import os
import pathlib
import sys

import pytest

from tests.helpers import suite_run

ROOT = pathlib.Path(__file__).resolve().parents[2]
PYTHON = ROOT / ".venv-sglang" / "bin" / "python"
SUITE_S = 900  # the subprocess's own limit; pytest's (the marker) leaves it MARGIN_S to report
MARGIN_S = 60


@pytest.mark.slow
@pytest.mark.redis
@pytest.mark.timeout(SUITE_S + MARGIN_S)
def test_sglang_suite_passes_in_its_environment(redis_url):
    assert PYTHON.exists(), (f"{PYTHON} is missing: run bash scripts/setup-engines.sh "
                             "(or bash scripts/engines/sglang.sh) first")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "REDIS_TEST_URL": redis_url}
    out = suite_run.run_suite([str(PYTHON), "-m", "pytest", "tests/integrations/sglang", "-q", "-p", "no:randomly",
                               "-W", "ignore::DeprecationWarning", "-W", "ignore::UserWarning"],
                              ROOT, env, SUITE_S, "SGLang suite")
    tail = out.output[-6000:]
    assert out.returncode == 0, f"SGLang suite failed (rc={out.returncode}):\n{tail}"
    assert " passed" in tail and " skipped" not in tail, tail
    sys.stdout.write(suite_run.summary_line(out.output) + (f" ({out.note})" if out.note else "") + "\n")
