"""Trace lines are bounded before anything is allocated, and odd inputs are named errors
(issue 36, rows 5 and 7).

Before the fix one hash-block line with 3M hash ids built more than 12 GB of
tokens before any check (a valid 300k-id line took 2.1 GB before the "needs
300000 pages" error); deep JSON nesting on a later line, ``Infinity`` or
``NaN`` values, ``--limit -1`` and ``--block-tokens 0`` gave tracebacks or
were taken silently. Each is now a ``TraceError`` (or a usage error) naming
the line and the limit.
"""
from __future__ import annotations

import json
import tracemalloc

import pytest

from hicache.cli import main
from hicache.core.config import SimulateConfig
from hicache.core.errors import TraceError
from hicache.reference import hash_trace, trace_format
from hicache.reference.hash_trace import iter_hash_trace
from hicache.reference.simulate import trace_requests

LINE = {"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [1, 2]}


def _write(tmp_path, lines: list[str], name: str = "t.jsonl") -> str:
    p = tmp_path / name
    p.write_text("".join(ln + "\n" for ln in lines))
    return str(p)


def test_a_line_over_the_byte_limit_is_refused_before_it_is_read_whole(tmp_path, monkeypatch):
    monkeypatch.setattr(trace_format, "MAX_LINE_BYTES", 4096)
    big = json.dumps({**LINE, "hash_ids": list(range(5000)), "input_length": 5000 * 512})
    path = _write(tmp_path, [json.dumps(LINE), big])
    with pytest.raises(TraceError, match=r"t.jsonl:2: the line is longer than 4,096 bytes, the limit"):
        list(iter_hash_trace(path))
    hdr = json.dumps({"hicache_trace": 1, "name": "x", "vocab": 10})
    with pytest.raises(TraceError, match=r"u.jsonl:2: the line is longer than 4,096 bytes"):
        trace_format.read_trace(_write(tmp_path, [hdr, json.dumps({"rid": "a", "arrival": 0, "max_new_tokens": 1,
                                                                    "prompt": [1] * 3000})], "u.jsonl"))


def test_a_request_longer_than_l1_is_refused_before_its_tokens_are_built(tmp_path):
    s = SimulateConfig()  # llama-3.1-8b on one H200: 1,600 pages of 512 tokens
    ids = list(range(2000))
    path = _write(tmp_path, [json.dumps({**LINE, "hash_ids": ids, "input_length": 2000 * 512})])
    factory = trace_requests(path, s)
    tracemalloc.start()
    try:
        with pytest.raises(TraceError) as e:
            next(iter(factory()))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert "t.jsonl:1: input_length 1,024,000 tokens (2,000 pages of 512) is over the limit of 1,600 pages " \
           "(the L1 of simulate.l1_bytes=107,374,182,400 for llama-3.1-8b)" in str(e.value)
    assert peak < 2 << 20, peak  # the line and its ids; its 1M tokens (12 MB to build) never were


def test_the_hard_token_bound_holds_without_a_pool(tmp_path):
    n = hash_trace.MAX_REQUEST_TOKENS // 512 + 1
    path = _write(tmp_path, [json.dumps({**LINE, "hash_ids": list(range(n)), "input_length": n * 512})])
    with pytest.raises(TraceError, match=r"over the limit of 16,777,216 pages \(hash_trace.MAX_REQUEST_TOKENS\)"):
        next(iter_hash_trace(path))


@pytest.mark.parametrize("line,why", [
    ("[" * 100_000 + "]" * 100_000, "t.jsonl:2: JSON nested too deeply"),
    ('{"timestamp": 1, "input_length": 600, "output_length": Infinity, "hash_ids": [1, 2]}',
     "t.jsonl:2: Infinity is not a number a trace may hold"),
    ('{"timestamp": NaN, "input_length": 600, "output_length": 1, "hash_ids": [1, 2]}',
     "t.jsonl:2: NaN is not a number a trace may hold"),
    ('{"timestamp": 1e400, "input_length": 600, "output_length": 1, "hash_ids": [1, 2]}',
     "t.jsonl:2, field 'timestamp': expected a finite number >= 0, got inf"),
    ('{"timestamp": 1, "input_length": 600, "output_length": -1e400, "hash_ids": [1, 2]}',
     "t.jsonl:2, field 'output_length': expected a finite number >= 0, got -inf"),
])
def test_hash_trace_escapes_are_named_errors(tmp_path, line, why):
    path = _write(tmp_path, [json.dumps(LINE), line])
    with pytest.raises(TraceError) as e:
        list(iter_hash_trace(path))
    assert why in str(e.value)


@pytest.mark.parametrize("value", ["NaN", "Infinity", "-Infinity"])
def test_hicache_trace_refuses_non_finite_numbers_by_line(tmp_path, value):
    hdr = json.dumps({"hicache_trace": 1, "name": "x", "vocab": 10})
    path = _write(tmp_path, [hdr, f'{{"rid": "a", "arrival": {value}, "max_new_tokens": 1, "prompt": [1]}}'])
    with pytest.raises(TraceError, match=f"t.jsonl:2: {value} is not a number"):
        trace_format.read_trace(path)


def test_replay_simulate_reports_a_deep_line_without_a_traceback(tmp_path, capsys):
    path = _write(tmp_path, [json.dumps(LINE), "[" * 100_000 + "]" * 100_000])
    assert main(["replay", "--simulate", path, "--no-baselines"]) == 2
    err = capsys.readouterr().err
    assert "t.jsonl:2: JSON nested too deeply" in err and "Traceback" not in err


@pytest.mark.parametrize("flag,value", [("--limit", "-1"), ("--limit", "0"), ("--block-tokens", "0"),
                                        ("--block-tokens", "x")])
def test_simulate_counts_are_checked_by_the_parser(flag, value, capsys):
    with pytest.raises(SystemExit) as e:
        main(["replay", "--simulate", flag, value])
    err = capsys.readouterr().err
    assert e.value.code == 2 and f"argument {flag}:" in err and "Traceback" not in err
    assert ("must be at least 1" in err) if value != "x" else ("expected an integer, got 'x'" in err)


@pytest.mark.parametrize("header", [False, True])
def test_a_five_thousand_digit_integer_is_a_trace_error(tmp_path, header, capsys):
    """Python refuses to convert more than 4,300 digits (a ValueError traceback before)."""
    big = "9" * 5000
    if header:
        lines = ['{"hicache_trace": 1, "name": "t", "vocab": 64}',
                 f'{{"rid": "a", "arrival": 0, "prompt": [1, {big}], "max_new_tokens": 1}}']
    else:
        lines = [json.dumps(LINE), f'{{"timestamp": 0, "input_length": {big}, "output_length": 5, "hash_ids": [1]}}']
    path = _write(tmp_path, lines)
    with pytest.raises(TraceError, match=r":2: a number of 5,000 digits"):
        if header:
            trace_format.read_trace(path)
        else:
            list(iter_hash_trace(path))
