"""Two real vLLM engines sharing one node's ``hicache serve`` (``storage.url =
hicache+unix://``): the first (a separate process, ``first_engine.py``) serves a prompt
and commits its pages to the service's segment, then exits; this process's engine finds
them there and loads them. Its output equals, bit for bit, vLLM's own prefix hit of the
same length; it saves nothing (the pages are the node's already). The service then goes
away: the engine serves on, from its own computation.
"""
from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

from hicache.core.layout import KVLayout
from tests.integrations.service_proc import start_serve, stop_serve
from tests.integrations.vllm_engine.checkpoint import write_checkpoint
from tests.integrations.vllm_engine.engine import BLOCK, Engine, prompt

HERE = pathlib.Path(__file__).resolve().parent
# What the connector derives from the Llama-shaped checkpoint on vLLM's CPU backend; both
# engines name the model (model.model_id), as docs/vllm-connector.md tells a node's operator.
LAYOUT = KVLayout("llama-gqa-node", 4, num_kv_heads=2, head_dim=64, dtype="float32", page_size=BLOCK,
                  engine_cells="cpu_attn")


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    model = str(write_checkpoint(tmp_path_factory.mktemp("llama"), "llama-gqa", seed=0))
    serve = start_serve(LAYOUT, host_pages=64)
    try:
        extra = {"storage": {"url": serve.url}, "model": {"model_id": LAYOUT.model_id},
                 "admission": {"policy": "always_load"}}
        out = subprocess.run([sys.executable, str(HERE / "first_engine.py"), model, json.dumps(extra), "41:300"],
                             capture_output=True, text=True, timeout=600, env=os.environ)
        line = [ln for ln in out.stdout.splitlines() if ln.startswith("FIRST-ENGINE ")]
        assert out.returncode == 0 and line, out.stdout[-3000:] + out.stderr[-3000:]
        eng = Engine(model, extra)
        yield eng, serve
        eng.check_integrity()
    finally:
        if serve.proc.poll() is None:
            stop_serve(serve)


def test_a_second_engine_loads_the_first_engines_pages(shared):
    eng, serve = shared
    p = prompt(41, 300)
    got = eng.generate([p])[0]  # this engine's own prefix cache is empty: the hit is the node's
    s = eng.scheduler.stats()
    assert got.cached == 9 * BLOCK
    assert (s.loaded_pages, s.load_error_pages, s.saved_pages) == (9, 0, 0)
    assert got == eng.reference([p])[0]
    eng.check_integrity()


def test_the_service_going_away_is_a_miss(shared):
    eng, serve = shared
    stop_serve(serve)
    p = prompt(42, 300)
    dropped = eng.scheduler.stats().save_dropped_pages
    got = eng.generate([p])[0]
    assert got.cached == 0  # a miss, served from the engine's own computation
    assert eng.generate([p])[0].tokens == got.tokens  # and again from vLLM's own prefix cache
    assert eng.scheduler.stats().save_dropped_pages - dropped >= 9  # nowhere to commit them
