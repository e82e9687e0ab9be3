"""bench/vllm_connector.py on a tiny slice, in ``.venv-vllm`` (vLLM 0.33's scheduler harness):
it runs every connector it names, and each row's tokens add up to the slice's prompt tokens.
~40 s: one subprocess that imports vLLM (~15 s on 2 cores) and replays 4 requests per connector."""
from __future__ import annotations

import os
import pathlib
import re

import pytest

from tests.helpers import suite_run

ROOT = pathlib.Path(__file__).resolve().parents[2]
PY = ROOT / ".venv-vllm" / "bin" / "python"
# HiCacheConnector joins once its module is in the checkout (issue 32's shim).
HAS_SHIM = (ROOT / "hicache" / "integrations" / "vllm_connector.py").exists()
CONNECTORS = ["offloading", "offloading-fs", "simple-cpu"] + (["hicache"] if HAS_SHIM else [])


LIMIT_S, MARGIN_S = 600, 60  # the subprocess's limit; pytest's (the marker) leaves MARGIN_S to report


@pytest.mark.timeout(LIMIT_S + MARGIN_S)
def test_bench_smoke():
    if not PY.exists() or not (ROOT / ".engines" / "vllm-0.33.0").is_dir():
        pytest.fail(f"vLLM environment missing ({PY}): run bash scripts/setup-engines.sh")
    env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT),
           "HF_HOME": str(ROOT / ".engines" / "hf")}
    args = [str(PY), "bench/vllm_connector.py", "--limit", "4", "--host-mib", "256", "--gpu-blocks", "2500",
            "--connectors", ",".join(CONNECTORS)]
    run = suite_run.run_suite(args, ROOT, env, LIMIT_S, "bench/vllm_connector.py --limit 4", pytest_child=False)
    assert run.returncode == 0, run.output[-4000:]
    text = run.output  # stdout and stderr together (the table is on stdout)
    total = int(re.search(r"\((\d+) prompt tokens", text).group(1))
    header = next(line for line in text.splitlines() if line.startswith("| connector"))
    col = {c.strip(): i - 2 for i, c in enumerate(header.split("|"))}  # the table's columns by name
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]]
            for line in text.splitlines() if line.startswith("| ") and not line.startswith("| connector")}
    assert sorted(rows) == sorted(CONNECTORS), text
    for name, cells in rows.items():
        served, local, recomputed = (int(c) for c in cells[:3])
        assert served + local + recomputed == total, (name, cells, total)
        step = float(cells[col["step host ms median"]])
        assert recomputed > 0 and step > 0, (name, cells)  # a cold slice computes; steps took time
        forward, steps = (int(x) for x in cells[col["forward steps / all steps"]].split(" / "))
        assert 0 < forward <= steps, (name, cells)
