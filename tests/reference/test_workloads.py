"""Workload generators, the JSONL trace format and the infinite-cache oracle."""
from __future__ import annotations

import hashlib
import json

import pytest

from hicache.reference.workloads import (SCALES, ChatWorkload, DocumentQAWorkload, PromptResolver, SystemPromptWorkload,
                                      TraceRequest, builtin_trace, mix, oracle_reuse, read_trace, write_trace)
from hicache.core.errors import TraceError


@pytest.mark.parametrize("name", ["mixed", "chat", "system", "docs"])
@pytest.mark.parametrize("scale", ["tiny", "small"])
def test_builtin_traces_are_deterministic(name, scale):
    a, b = builtin_trace(name, scale), builtin_trace(name, scale)
    assert a == b
    assert a.name == f"{name}-{scale}" and a.vocab == 512
    assert builtin_trace(name, scale, seed=1).requests != a.requests
    arrivals = [r.arrival for r in a.requests]
    assert arrivals == sorted(arrivals)


def test_small_mixed_trace_pinned():
    """Pin the default trace: replays and benchmarks compare across commits."""
    tr = builtin_trace()
    assert len(tr.requests) == 136
    first = tr.requests[0]
    assert (first.rid, first.arrival, len(first.prompt), first.prompt[:4]) == \
        ("chat-000-t0", 0.244, 58, (375, 244, 206, 148))
    blob = json.dumps([r.to_json() for r in tr.requests]).encode()
    assert hashlib.blake2b(blob, digest_size=8).hexdigest() == "bfc18e794330db56"
    stats = oracle_reuse(tr.requests, 16)
    assert (stats.prompt_tokens, stats.hit_tokens, stats.generated_tokens) == (49655, 40752, 1568)
    assert {r.namespace for r in tr.requests if r.rid.startswith("doc")} == {"rag"}
    assert {r.namespace for r in tr.requests if not r.rid.startswith("doc")} == {""}


def test_chat_turns_chain_to_their_parent():
    reqs = ChatWorkload(conversations=3, turns=4, system_tokens=5).generate(seed=7, vocab=100)
    assert len(reqs) == 12
    index = {r.rid: i for i, r in enumerate(reqs)}
    roots = [r for r in reqs if not r.is_followup]
    assert len(roots) == 3 and len({r.prompt[:5] for r in roots}) == 1  # one shared system prompt
    for r in reqs:
        if r.is_followup:
            parent = reqs[index[r.parent]]
            assert index[r.parent] < index[r.rid] and parent.arrival < r.arrival
            assert parent.conversation == r.conversation and r.prompt == () and r.append
        assert all(1 <= t < 100 for t in r.prompt + r.append)


def test_system_prompt_and_document_sharing():
    sysw = SystemPromptWorkload(system_prompts=2, requests=20, system_tokens=30)
    reqs = sysw.generate(seed=3, vocab=64)
    heads = {r.prompt[:30] for r in reqs}
    assert len(heads) == 2 and all(len(r.prompt) >= 30 + 8 for r in reqs)
    docs = DocumentQAWorkload(documents=3, questions=4, document_tokens=50).generate(seed=3, vocab=64)
    by_doc = {}
    for r in docs:
        by_doc.setdefault(r.rid.split("-q")[0], set()).add(r.prompt[:50])
    assert len(by_doc) == 3 and all(len(v) == 1 for v in by_doc.values())
    assert sorted(r.rid for r in docs if r.rid.startswith("doc-0-")) == [f"doc-0-q{i}" for i in range(4)]


def test_mix_rejects_colliding_ids():
    a = SystemPromptWorkload(requests=3).generate(0, 64)
    with pytest.raises(ValueError, match="own prefix"):
        mix(a, a)


@pytest.mark.parametrize("scale", sorted(SCALES))
def test_round_trip(tmp_path, scale):
    tr = builtin_trace("mixed", scale) if scale != "medium" else builtin_trace("chat", "tiny")
    path = tmp_path / "t.jsonl"
    write_trace(path, tr.requests, name=tr.name, vocab=tr.vocab)
    lines = path.read_text().splitlines()
    assert json.loads(lines[0]) == {"hicache_trace": 1, "name": tr.name, "vocab": 512}
    assert len(lines) == len(tr.requests) + 1
    assert read_trace(path) == tr


def test_followup_line_format(tmp_path):
    reqs = [TraceRequest("a", 0.0, 2, prompt=(1, 2), namespace="ns"),
            TraceRequest("b", 1.5, 3, parent="a", append=(4,), namespace="ns", conversation="c")]
    write_trace(tmp_path / "t.jsonl", reqs, name="x", vocab=8)
    line = json.loads((tmp_path / "t.jsonl").read_text().splitlines()[2])
    assert line == {"rid": "b", "arrival": 1.5, "parent": "a", "append": [4], "max_new_tokens": 3,
                    "namespace": "ns", "conversation": "c"}


GOOD = '{"rid": "a", "arrival": 0, "prompt": [1, 2, 3], "max_new_tokens": 2}'
BAD_LINES = [
    ('{"rid": "b", "arrival": 1, "prompt": [1, 2', 3, "not valid JSON"),
    ('{"rid": "b", "arrival": 1, "prompt": [1]}', 3, "missing required field 'max_new_tokens'"),
    ('{"rid": "b", "arrival": 1, "prompt": [1], "max_new_tokens": 1, "promt": [2]}', 3, "unknown field(s) ['promt']"),
    ('{"rid": "b", "arrival": 1, "prompt": [1, 99], "max_new_tokens": 1}', 3, "field 'prompt': token ids must be"),
    ('{"rid": "b", "arrival": 1, "prompt": [], "max_new_tokens": 1}', 3, "field 'prompt': expected a non-empty"),
    ('{"rid": "b", "arrival": -1, "prompt": [1], "max_new_tokens": 1}', 3, "field 'arrival'"),
    ('{"rid": "b", "arrival": 1, "prompt": [1], "max_new_tokens": 0}', 3, "field 'max_new_tokens'"),
    ('{"rid": 5, "arrival": 1, "prompt": [1], "max_new_tokens": 1}', 3, "field 'rid'"),
    ('{"rid": "b", "arrival": 1, "prompt": [1], "parent": "a", "append": [2], "max_new_tokens": 1}', 3,
     "either 'prompt' or both"),
    ('{"rid": "b", "arrival": 1, "parent": "a", "max_new_tokens": 1}', 3, "missing 'append'"),
    ('{"rid": "b", "arrival": 1, "parent": "zz", "append": [2], "max_new_tokens": 1}', None,
     "parent 'zz' does not appear earlier"),
    ('{"rid": "a", "arrival": 1, "prompt": [1], "max_new_tokens": 1}', None, "duplicate rid"),
    ('[1, 2]', 3, "expected a JSON object"),
]


@pytest.mark.parametrize("line,lineno,msg", BAD_LINES)
def test_malformed_request_lines(tmp_path, line, lineno, msg):
    path = tmp_path / "trace.jsonl"
    path.write_text('{"hicache_trace": 1, "name": "t", "vocab": 10}\n' + GOOD + "\n" + line + "\n")
    with pytest.raises(TraceError) as e:
        read_trace(path)
    assert msg in str(e.value)
    if lineno is not None:
        assert f"trace.jsonl:{lineno}" in str(e.value)
    else:
        assert "request 1 (rid" in str(e.value)


@pytest.mark.parametrize("header,msg", [
    ("", "empty file"),
    (GOOD, "first line must be the header"),
    ('{"hicache_trace": 2, "name": "t", "vocab": 10}', "field 'hicache_trace': this reader understands version 1"),
    ('{"hicache_trace": 1, "name": "t"}', "field 'vocab'"),
    ('{"hicache_trace": 1, "name": "t", "vocab": 10, "extra": 1}', "unknown header field(s) ['extra']"),
])
def test_malformed_headers(tmp_path, header, msg):
    path = tmp_path / "trace.jsonl"
    path.write_text(header + "\n" if header else "")
    with pytest.raises(TraceError) as e:
        read_trace(path)
    assert msg in str(e.value)


def test_unsorted_arrivals_rejected(tmp_path):
    reqs = [TraceRequest("a", 2.0, 1, prompt=(1,)), TraceRequest("b", 1.0, 1, prompt=(1,))]
    with pytest.raises(TraceError, match="arrival 1.0 is before the previous request's 2.0"):
        write_trace(tmp_path / "t.jsonl", reqs, name="t", vocab=4)


def test_prompt_resolver_chains_answers():
    reqs = [TraceRequest("a", 0, 2, prompt=(1, 2)),
            TraceRequest("b", 1, 2, parent="a", append=(3,)),
            TraceRequest("c", 2, 2, parent="b", append=(4, 5)),
            TraceRequest("d", 2, 2, parent="b", append=(6,))]
    res = PromptResolver(reqs)
    assert res.prompt(reqs[0]) == [1, 2]
    assert not res.ready(reqs[1])
    with pytest.raises(TraceError, match="parent 'a' has not finished"):
        res.prompt(reqs[1])
    res.finish(reqs[0], [1, 2], [7, 8])
    assert res.ready(reqs[1]) and res.prompt(reqs[1]) == [1, 2, 7, 8, 3]
    res.check_integrity()
    res.finish(reqs[1], [1, 2, 7, 8, 3], [9, 9])
    assert res.prompt(reqs[2]) == [1, 2, 7, 8, 3, 9, 9, 4, 5]
    assert res.prompt(reqs[3]) == [1, 2, 7, 8, 3, 9, 9, 6]
    res.finish(reqs[3], [0], [0])  # no follow-up needs it: not kept
    res.check_integrity()
    assert not res._seq and not res._children


def test_oracle_exact_values():
    ps = 4
    reqs = [TraceRequest("a", 0, 3, prompt=tuple(range(1, 11))),  # 10 tokens: nothing cached
            TraceRequest("b", 1, 1, prompt=tuple(range(1, 9)) + (50,)),  # shares 2 pages of a
            TraceRequest("c", 2, 1, prompt=tuple(range(1, 9)), namespace="x"),  # other namespace: miss
            TraceRequest("d", 3, 2, parent="a", append=(60, 61))]  # a's 10 + 3 answer + 2 = 15
    st = oracle_reuse(reqs, ps)
    # d: a computed 10 + 2 answer tokens = 12 = 3 pages, all inside d's 15-token prompt
    assert st == (4, 10 + 9 + 8 + 15, 0 + 8 + 0 + 12, 3 + 1 + 1 + 2)
    assert st.hit_rate == pytest.approx(20 / 42)
    # a fully cached prompt still computes its last token
    again = oracle_reuse([TraceRequest("a", 0, 1, prompt=tuple(range(1, 10))),
                          TraceRequest("b", 1, 1, prompt=tuple(range(1, 9)))], ps)
    assert again.hit_tokens == 4
