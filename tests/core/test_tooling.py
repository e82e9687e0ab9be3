"""The lint and type checks configured in pyproject.toml pass (CI runs the tests)."""
from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True, timeout=280)


def test_ruff_finds_nothing():
    r = _run("ruff", "check", "--no-cache", ".")
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.slow
def test_mypy_strict_on_typed_id_modules():
    r = _run("mypy", "--cache-dir", "/dev/null")
    assert r.returncode == 0, r.stdout + r.stderr
