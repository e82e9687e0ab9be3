"""The README's SGLang launch line through SGLang's own parser down to HiCacheBackend,
and what a server shows of it: the start line in SGLang's log, the metrics on
SGLang's /metrics (a child process, as SGLang's scheduler is)."""
from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import sys

import torch
from sglang.srt.managers.cache_controller import PrefetchOperation
from prometheus_client.parser import text_string_to_metric_families
from sglang.srt.mem_cache.utils import get_storage_hash_str

from hicache.integrations.metrics import SGLANG_PREFIX, SglangStats, families
from hicache.integrations.sglang import HiCacheBackend

from .launch import build, page_bytes, readme_argv, server_args

CHILD = pathlib.Path(__file__).with_name("launch_child.py")


def test_readme_launch_line_builds_the_backend_through_sglang(redis_url, controllers):
    args = server_args(readme_argv())
    c = build(args, redis_url)
    controllers.append(c)
    assert args.model_path == "meta-llama/Llama-3.1-8B-Instruct"
    assert args.enable_hierarchical_cache and args.hicache_storage_backend == "dynamic"
    assert args.enable_metrics and args.hicache_mem_layout == "page_first"
    b = c.storage_backend
    assert type(b) is HiCacheBackend and c.page_get_func == c._page_get_zero_copy
    assert b.layout.model_id == "meta-llama/Llama-3.1-8B-Instruct#sglang:page_first"
    assert b.layout.page_bytes == 32 * 2 * 8 * 128 * 2  # Llama-3.1-8B, one token, all 32 layers
    host, page = c.mem_pool_host, c.page_size
    keys = get_storage_hash_str(list(range(4 * page)), None, page_size=page)
    src, dst = host.alloc(4 * page), host.alloc(4 * page)
    want = page_bytes(host, src)
    assert c._page_set_zero_copy(keys, src) is True
    assert c._page_get_zero_copy(PrefetchOperation("r", []), keys, dst) == 4
    assert all(torch.equal(g, w) for g, w in zip(page_bytes(host, dst), want))
    b.check_integrity()
    b.clear()


def scrape_sglang_metrics(multiproc_dir: str, monkeypatch) -> str:
    """``/metrics`` as SGLang's HTTP server serves it (``add_prometheus_middleware``
    over the multiprocess directory its scheduler processes write)."""
    from fastapi import FastAPI
    from fastapi.testclient import TestClient
    from sglang.srt.utils.common import add_prometheus_middleware
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", multiproc_dir)
    app = FastAPI()
    add_prometheus_middleware(app)
    r = TestClient(app).get("/metrics")
    assert r.status_code == 200
    return r.text


def series(text: str) -> dict[str, float]:
    """``name{labels}`` -> value of every hicache_ sample."""
    out = {}
    for line in text.splitlines():
        if line.startswith("hicache_"):
            key, value = line.rsplit(" ", 1)
            out[key] = float(value)
    return out


def test_sglang_process_logs_the_start_line_and_serves_the_metrics(redis_url, tmp_path, monkeypatch):
    mp = tmp_path / "prometheus"
    mp.mkdir()
    user_url = redis_url.replace("redis://", "redis://default:s3cret-pass@")  # a password to redact
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(mp), "PYTHONPATH": str(CHILD.parents[3])}
    out = subprocess.run([sys.executable, str(CHILD), user_url], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-4000:]
    want = json.loads(out.stdout.strip().splitlines()[-1])
    # SGLang's log format ("[time TP0] message"), the URL redacted, once.
    starts = [ln for ln in out.stderr.splitlines() if "hicache sglang adapter started" in ln]
    assert len(starts) == 1, out.stderr[-4000:]
    assert re.match(r"^\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d TP0\] hicache sglang adapter started: L3 "
                    r"redis://default:\*\*\*@127\.0\.0\.1:\d+/\d+, layout fingerprint [0-9a-f]{32}, host pool \d+ pages "
                    r"of 1 tokens x 131072 bytes \(meta-llama/Llama-3\.1-8B-Instruct#sglang:page_first", starts[0]), starts[0]
    assert "s3cret-pass" not in out.stderr
    # The dropped-write warning (child's last step) is rate-limited: 5 lines of 40 failures.
    assert sum("took 0 of" in ln for ln in out.stderr.splitlines()) == 5
    text = scrape_sglang_metrics(str(mp), monkeypatch)
    got = series(text)
    # Exactly the declared families reach SGLang's /metrics (each has a series by now), as declared
    # counters (the multiprocess collector replaces help texts: test_adapter_metrics checks those).
    declared = families(SglangStats)
    served = {f.name: f.type for f in text_string_to_metric_families(text) if f.name.startswith("hicache_")}
    assert served == {SGLANG_PREFIX + n: f.kind for n, f in declared.items()}
    lab = 'engine="sglang"'
    assert got[f'hicache_adapter_load_pages_total{{{lab},result="hit"}}'] == want["hits"] == 4
    assert got[f'hicache_adapter_load_pages_total{{{lab},result="miss"}}'] == want["misses"] == 2
    assert got[f'hicache_adapter_store_pages_total{{{lab},result="stored"}}'] == want["stored"] == 6
    assert got[f'hicache_adapter_store_pages_total{{{lab},result="dropped"}}'] == want["dropped"] == 40
    assert got[f'hicache_adapter_lookup_pages_total{{{lab},result="asked"}}'] == want["lookups"]
    assert got[f'hicache_adapter_lookup_pages_total{{{lab},result="found"}}'] == want["lookup_hits"]
    assert got[f'hicache_adapter_bytes_total{{{lab},op="write"}}'] == want["bytes_written"] == 6 * 131072
    assert got[f'hicache_adapter_bytes_total{{{lab},op="read"}}'] == want["bytes_read"] == 4 * 131072
    assert got[f'hicache_adapter_rejected_objects_total{{{lab},reason="corrupt"}}'] == want["corrupt"] == 1
    assert got[f'hicache_adapter_rejected_objects_total{{{lab},reason="foreign"}}'] == want["foreign"] == 1
    # One pool (no v2 side pools): its own figures are the totals.
    assert got[f'hicache_adapter_pool_pages_total{{{lab},pool="kv",result="hit"}}'] == want["pools"]["kv"]["hits"] == 4
    assert got[f'hicache_adapter_pool_pages_total{{{lab},pool="kv",result="stored"}}'] == want["pools"]["kv"]["stored"]
    # The first call to the dead L3 (a put: SET NX, one round trip) fails and opens the
    # circuit; later calls are answered at once, without L3, and are not errors (the
    # background pinger's failures count as op="ping", as many as its backoff allowed).
    assert want["errors"]["put"] == 1 and set(want["errors"]) <= {"put", "ping"}, want["errors"]
    assert got[f'hicache_adapter_errors_total{{{lab},op="put"}}'] == 1
