"""A hybrid model's L3 hit in a restarted real vLLM engine (vLLM's CPU build): Qwen3-Next's
full-attention pages and its Gated DeltaNet states, each group's items under its own layout
on one ``file://`` L3. A first engine (a separate process, ``first_engine.py``) serves the
prompt and exits; this process starts a second one on the same L3 (empty L2, empty vLLM
cache). Its hit must equal, token ids and top-5 logprobs bit for bit, vLLM's own prefix hit
of the same length; a damaged state object is refused and the request recomputed."""
from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

from hicache.core.hashing import page_hashes
from tests.integrations.vllm_engine.checkpoint import write_checkpoint
from tests.integrations.vllm_engine.engine import Engine, prompt

HERE = pathlib.Path(__file__).resolve().parent
BLOCK = 96  # vLLM's attention block for this model on CPU (a page holds a state)
LLM = {"dtype": "bfloat16", "mamba_cache_mode": "align"}
HIT, DAMAGED = (21, 7 * BLOCK + 20), (22, 5 * BLOCK + 7)


@pytest.fixture(scope="module")
def restarted(tmp_path_factory):
    model = str(write_checkpoint(tmp_path_factory.mktemp("qwen3next"), "qwen3-next", seed=0))
    l3 = tmp_path_factory.mktemp("l3")
    extra = {"storage": {"url": f"file://{l3}"}, "host_bytes": 64 << 20, "admission": {"policy": "always_load"}}
    out = subprocess.run([sys.executable, str(HERE / "first_engine.py"), model, json.dumps(extra),
                          *(f"{s}:{n}" for s, n in (HIT, DAMAGED))], capture_output=True, text=True, timeout=600,
                         env={**os.environ, "FIRST_ENGINE_LLM": json.dumps(LLM)})
    line = [ln for ln in out.stdout.splitlines() if ln.startswith("FIRST-ENGINE ")]
    assert out.returncode == 0 and line, out.stdout[-3000:] + out.stderr[-3000:]
    first = json.loads(line[0].split(" ", 1)[1])
    assert first["stored"] == 7 + 5, first  # the full group's pages (the states are a group's items)
    p = prompt(*DAMAGED)  # its one state, after 5 blocks, keyed by page 4's hash: the larger object
    name = page_hashes(p[:5 * BLOCK], BLOCK)[4].hex()
    objs = sorted(l3.rglob(name), key=lambda f: f.stat().st_size)
    assert len(objs) == 4, objs  # the page, and the state of each of the 3 state groups (own folders)
    raw = bytearray(objs[-1].read_bytes())
    raw[len(raw) // 2] ^= 0x10
    objs[-1].write_bytes(bytes(raw))
    eng = Engine(model, extra, max_batched=512, **LLM)
    yield eng, first
    eng.check_integrity()


def test_l3_hit_after_restart_equals_vllm_own_hit(restarted):
    eng, first = restarted
    p = prompt(*HIT)
    got = eng.generate([p])[0]
    s = eng.scheduler.stats()
    assert got.cached == 7 * BLOCK and s.hit_tokens["L3"] == 7 * BLOCK and s.load_error_pages == 0
    assert [len(lane.items) for lane in eng.scheduler.lanes.values()] == [1, 1, 1]  # the states landed on L2
    assert list(got.tokens) == first["outs"][0][0]
    assert got == eng.reference([p])[0]


def test_a_damaged_state_in_l3_is_recomputed(restarted):
    eng, first = restarted
    p = prompt(*DAMAGED)
    eng.forget_own()
    got = eng.generate([p])[0]
    cold_tokens, cold_logprobs = first["outs"][1]
    assert got.cached == 0  # the whole request recomputed (a hybrid load error is told per request)
    assert list(got.tokens) == cold_tokens and [list(map(list, x)) for x in got.logprobs] == cold_logprobs
    eng.check_integrity()
