"""L3 hits in a restarted engine, and every kind of damaged L3 object recomputed.

A first engine (a separate process, ``first_engine.py``) serves the prompts and
exits with its pages in a ``file://`` L3; this process starts a second engine
on the same L3, whose L2 is empty. Its L3 hits must equal, bit for bit, vLLM's
own prefix hit of the same length. A damaged object (a flipped byte, a
truncated file, a garbled header, a deleted file) is never loaded: vLLM
recomputes from it. Damaged at the first page, the recomputation is the first
engine's own cold pass, so the outputs must equal it bit for bit; damaged at a
middle page, the pages before it load and the tail is recomputed in another
split than the cold pass (vLLM's CPU kernels round differently across splits),
so the tokens must equal and the logprobs agree to 1e-3.
"""
from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

from hicache.core.hashing import page_hashes
from tests.integrations.vllm_engine.checkpoint import write_checkpoint
from tests.integrations.vllm_engine.engine import BLOCK, Engine, prompt

HERE = pathlib.Path(__file__).resolve().parent
PROMPTS = {"hit": (11, 300), "flip": (12, 300), "truncate": (13, 300), "header": (14, 300), "delete": (15, 300),
           "flip-middle": (16, 300)}
DAMAGED_PAGE = {"flip-middle": 5}  # of 9 full pages; the others at page 0


def _damage(obj: pathlib.Path, kind: str) -> None:
    raw = bytearray(obj.read_bytes())
    if kind.startswith("flip"):
        raw[len(raw) // 2] ^= 0x10
        obj.write_bytes(bytes(raw))
    elif kind == "truncate":
        obj.write_bytes(bytes(raw[: len(raw) - 4096]))
    elif kind == "header":
        raw[:16] = b"\xff" * 16
        obj.write_bytes(bytes(raw))
    else:
        obj.unlink()


def _object(l3: pathlib.Path, p: list[int], page: int) -> pathlib.Path:
    h = page_hashes(p[:(page + 1) * BLOCK], BLOCK)[page].hex()
    found = list(l3.rglob(h))
    assert len(found) == 1, f"page {page}: {len(found)} L3 objects named {h} under {l3}"
    return found[0]


@pytest.fixture(scope="module")
def restarted(tmp_path_factory):
    model = str(write_checkpoint(tmp_path_factory.mktemp("llama"), "llama-gqa", seed=0))
    l3 = tmp_path_factory.mktemp("l3")
    extra = {"storage": {"url": f"file://{l3}"}, "host_bytes": 64 << 20, "admission": {"policy": "always_load"}}
    specs = [f"{s}:{n}" for s, n in PROMPTS.values()]
    out = subprocess.run([sys.executable, str(HERE / "first_engine.py"), model, json.dumps(extra), *specs],
                         capture_output=True, text=True, timeout=600, env=os.environ)
    line = [ln for ln in out.stdout.splitlines() if ln.startswith("FIRST-ENGINE ")]
    assert out.returncode == 0 and line, out.stdout[-3000:] + out.stderr[-3000:]
    first = json.loads(line[0].split(" ", 1)[1])
    assert first["stored"] == 9 * len(PROMPTS), first
    for kind, (seed, n) in PROMPTS.items():
        if kind != "hit":
            _damage(_object(l3, prompt(seed, n), DAMAGED_PAGE.get(kind, 0)), kind)
    eng = Engine(model, extra)
    yield eng, first
    eng.check_integrity()


def test_l3_hit_after_restart_equals_vllm_own_hit(restarted):
    eng, first = restarted
    p = prompt(*PROMPTS["hit"])
    got = eng.generate([p])[0]
    s = eng.scheduler.stats()
    assert got.cached == 9 * BLOCK and s.hit_tokens["L3"] == 9 * BLOCK and s.load_error_pages == 0
    assert list(got.tokens) == first["outs"][0][0]
    assert got == eng.reference([p])[0]


@pytest.mark.parametrize("kind", ["flip", "truncate", "header", "delete", "flip-middle"])
def test_damaged_l3_object_is_recomputed(restarted, kind):
    eng, first = restarted
    p = prompt(*PROMPTS[kind])
    cold_tokens, cold_logprobs = first["outs"][list(PROMPTS).index(kind)]
    page = DAMAGED_PAGE.get(kind, 0)
    before = eng.scheduler.stats()
    eng.forget_own()
    got = eng.generate([p])[0]
    after = eng.scheduler.stats()
    if kind != "delete":  # the probe saw the object; the worker's check refused it
        assert after.load_error_pages - before.load_error_pages == 9 - page
    assert after.loaded_pages - before.loaded_pages == page
    assert list(got.tokens) == cold_tokens
    if page == 0:
        assert got.cached == 0
        assert [[list(x) for x in t] for t in got.logprobs] == cold_logprobs
    else:
        for ours, theirs in zip(got.logprobs, cold_logprobs):
            assert [k for k, _ in ours] == [k for k, _ in theirs]
            assert max(abs(a - b) for (_, a), (_, b) in zip(ours, theirs)) < 1e-3
