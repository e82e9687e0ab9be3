"""No issue numbers, editor's notes ("lead:") or round names anywhere in docs/, README.md
or the source of hicache/ and api/, comments and docstrings included: a reader of the code
gets today's reason, not a pointer into a tracker they cannot see."""
from __future__ import annotations

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[2]
NOTE = re.compile(r"\b[Ii]ssues? #?\d|\blead:|\b[Rr]ound[ -]\d")
FILES = sorted([ROOT / "README.md", *(ROOT / "docs").rglob("*.md"),
                *(p for d in ("hicache", "api") for p in (ROOT / d).rglob("*.py"))])


def test_no_history_notes_in_docs_or_source():
    hits = [f"{p.relative_to(ROOT)}:{i}: {line.strip()[:100]}"
            for p in FILES for i, line in enumerate(p.read_text().splitlines(), 1) if NOTE.search(line)]
    assert hits == []


def test_the_pattern_finds_what_the_review_greps_for():
    found = [s for s in ("(bench/RESULTS.md, issue 35)", "# lead: check", "since round 5", "an issue with it")
             if NOTE.search(s)]
    assert found == ["(bench/RESULTS.md, issue 35)", "# lead: check", "since round 5"]
