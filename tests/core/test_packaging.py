"""The hand-kept package list in pyproject.toml names every subpackage (a wheel
built from it would otherwise silently lack one)."""
from __future__ import annotations

import pathlib
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
