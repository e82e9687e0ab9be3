"""L2 = the node's ``hicache serve`` segment (``storage.url = hicache+unix://``), shared by
two engine processes: one computes and commits a prompt's pages, the other (a vLLM
scheduler of its own) loads them from the segment, byte for byte as its own stand-in
model would have computed them; a dead service is a miss, never an error."""
from __future__ import annotations

import os
import pathlib
import subprocess
import sys

from hicache.core.layout import KVLayout
from tests.integrations.service_proc import start_serve, stop_serve
from tests.integrations.vllm_connector.harness import BLOCK, Engine, tokens
from tests.integrations.vllm_connector.test_scheduler_path import finish_idle

# What HiCacheConnector derives from the harness's toy KV cache config (the service checks it);
# both sides name the model (model.model_id), as docs/vllm-connector.md tells a node's operator.
LAYOUT = KVLayout("facebook/opt-125m", 2, num_kv_heads=2, head_dim=8, dtype="float16", page_size=BLOCK)


def test_two_engine_processes_share_one_copy_per_page():
    serve = start_serve(LAYOUT, host_pages=32)
    try:
        proc = subprocess.run([sys.executable, str(pathlib.Path(__file__).with_name("engine_proc.py")), serve.url,
                               "70", "4"], capture_output=True, text=True, timeout=300, env=os.environ)
        assert proc.returncode == 0 and "saved 4" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-4000:]
        eng = Engine({"load": "layerwise", "storage": {"url": serve.url}, "model": {"model_id": LAYOUT.model_id}})
        p = tokens(70, 4 * BLOCK + 1)
        eng.add("b1", p)
        eng.run()
        assert eng.lookups[-1] == ("b1", 0, 4 * BLOCK, False)
        s = eng.core.stats()
        assert (s.loaded_pages, s.load_error_pages, s.saved_pages) == (4, 0, 0)  # nothing new to commit
        assert eng.core.host_pages == 32  # the service's segment, not a pool of this engine's
        stop_serve(serve)  # the node's service goes away: lookups miss, saves are dropped, vLLM serves
        eng.add("b2", tokens(71, 4 * BLOCK + 1))
        eng.run()
        assert eng.lookups[-1] == ("b2", 0, 0, False) and eng.core.stats().save_dropped_pages == 4
        finish_idle(eng)
    finally:
        if serve.proc.poll() is None:
            stop_serve(serve)
