"""The hand-kept package list in pyproject.toml names every subpackage (a wheel
built from it would otherwise silently lack one)."""
from __future__ import annotations

import pathlib
import subprocess
import sys
import tomllib

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _listed() -> set[str]:
    return set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])


def _on_disk() -> set[str]:
    remap = {"hicache": ROOT / "hicache", "hicache.kernels": ROOT / "kernels", "hicache.api": ROOT / "api"}
    found = set()
    for name, top in remap.items():
        for init in top.rglob("__init__.py"):
            rel = init.parent.relative_to(top)
            if any(part.startswith((".", "_")) for part in rel.parts):
                continue
            found.add(".".join([name, *rel.parts]) if rel.parts else name)
    return found


def test_every_subpackage_is_listed():
    assert _on_disk() - _listed() == set(), "add these to [tool.setuptools] packages in pyproject.toml"
    assert _listed() - _on_disk() == set(), "pyproject.toml lists packages that no longer exist"
    assert {"hicache.index", "hicache.reference", "hicache.node"} <= _listed()


def test_the_checkout_maps_exactly_kernels_and_api():
    """Only hicache.kernels and hicache.api come from the checkout's top level; a bare
    ``api.x`` / ``kernels.x`` is the same module object, never a second copy."""
    code = (
        "import importlib, sys\n"
        f"sys.path.insert(0, {str(ROOT)!r})\n"
        "import hicache.api.app as a, hicache.kernels.page_copy as k\n"
        "import api.app, kernels.page_copy\n"
        "assert sys.modules['api.app'] is a and sys.modules['kernels.page_copy'] is k\n"
        "bad = []\n"
        "for name in ('bench', 'tests', 'scripts', 'docker'):\n"
        "    try:\n"
        "        importlib.import_module('hicache.' + name)\n"
        "        bad.append(name)\n"
        "    except ImportError:\n"
        "        pass\n"
        "print(','.join(bad) or 'none')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT / "docs")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "none"
