"""User-facing text states today's facts: no issue numbers, editor's notes ("lead:")
or round names in docs/, README.md, the CLI's help and output, or the strings the
library prints (its error and log messages). Comments and docstrings of the source
are for its readers and are left to tests/core/test_tooling.py."""
from __future__ import annotations

import ast
import pathlib
import re

import pytest

from hicache.cli import main

ROOT = pathlib.Path(__file__).resolve().parents[2]
NOTE = re.compile(r"\b[Ii]ssues? #?\d|\blead:|\b[Rr]ound[ -]\d")
DOCS = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md")])
SOURCES = sorted(p for d in ("hicache", "api") for p in (ROOT / d).rglob("*.py"))


def _hits(text: str) -> list[str]:
    return [line.strip()[:120] for line in text.splitlines() if NOTE.search(line)]


@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_docs_carry_no_issue_numbers_or_editors_notes(path):
    assert _hits(path.read_text()) == []


def _printed_strings(path: pathlib.Path) -> list[str]:
    """String constants of a module that are no docstring (what it prints, raises or logs)."""
    tree = ast.parse(path.read_text())
    docs = {id(n.body[0].value) for n in ast.walk(tree)
            if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
            and n.body and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
    return [n.value for n in ast.walk(tree)
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docs]


@pytest.mark.parametrize("path", SOURCES,
    ids=lambda p: p.relative_to(ROOT).as_posix())
def test_the_library_prints_no_issue_numbers(path):
    assert [s[:120] for s in _printed_strings(path) if NOTE.search(s)] == []


@pytest.mark.parametrize("argv", [["--help"], ["replay", "--help"], ["serve", "--help"], ["storage", "--help"],
                                  ["storage", "fsck", "--help"], ["info", "--help"]])
def test_the_cli_help_carries_no_issue_numbers(argv, capsys):
    with pytest.raises(SystemExit):
        main(argv)
    assert _hits(capsys.readouterr().out) == []


def test_the_note_pattern_finds_what_it_must():
    assert _hits("see issue 35\n*lead: confirm*\nmain at the end of round 5\nan issue with it\nissues remain") == [
        "see issue 35", "*lead: confirm*", "main at the end of round 5"]
