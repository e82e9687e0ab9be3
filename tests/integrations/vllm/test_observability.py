"""Seeing HiCacheTier work from inside vLLM: its start line and rate-limited
warnings in a vLLM process's own log output (no logging setup by anyone), and
its counters on the Prometheus registry vLLM's /metrics serves, through vLLM's
own tier-metric path (TieringOffloadingManager.get_stats -> KVConnectorProm)."""
from __future__ import annotations

import dataclasses
import os
import re
import socket
import subprocess
import sys

from prometheus_client import REGISTRY, generate_latest
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorProm
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

from hicache.integrations.vllm import METRIC_PREFIX, HiCacheTier, TierStats, page_hash
from hicache.shapes import model_shape

from .real import ROOT, offloading_config, vllm_config
from .tiers import finish, job, keys

SCRIPT = r"""
import sys, numpy as np
sys.path.insert(0, sys.argv[2])
# What `vllm serve` does first (configure_logging_from_args) and engine-core processes repeat.
from vllm.config.logging import LoggingConfig
from vllm.logger import configure_logging
configure_logging(LoggingConfig())
from tests.v1.kv_offload.conftest import make_offloading_config
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec
from vllm.v1.kv_offload.base import ReqContext
from vllm.v1.kv_offload.tiering.base import TransferJob
from vllm.v1.kv_offload.base import make_offload_key
tier = {"type": "HiCacheTier", "module_path": "hicache.integrations.vllm", "url": sys.argv[1],
        "timeout_ms": 20, "max_retries": 0, "probe_l3": False}
cfg = make_offloading_config(spec_name="TieringOffloadingSpec", cpu_bytes_to_use=1 << 20,
                             worker_kv_bytes_per_block=4096, extra_config={"secondary_tiers": [tier]})
m = TieringOffloadingSpec(cfg).get_manager()
(t,) = m.secondary_tiers
for j in range(20):
    k = make_offload_key(b"b%d" % j, 0)
    t.submit_store(TransferJob(job_id=j, keys=[k], chunk_ids=np.array([0]), is_promotion=False,
                               req_context=ReqContext(req_id="r")))
    t.drain_jobs()
    t.get_finished_jobs()
print("FAILED_JOBS", t.stats().store_failed_jobs, "FP", t.fingerprint, flush=True)
m.shutdown()
"""


def test_start_line_and_rate_limited_warnings_in_a_vllm_process(tmp_path):
    """A process configured as vLLM configures every process it starts: no hicache setup."""
    with socket.socket() as s:  # a loopback port nobody listens on: every store fails
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"redis://admin:hunter2@127.0.0.1:{port}/0"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HICACHE_", "VLLM_LOGGING"))}
    env.update(VLLM_TARGET_DEVICE="cpu", PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, "-c", SCRIPT, url, str(ROOT / ".engines" / "vllm-0.33.0")],
                         capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    fp = re.search(r"FAILED_JOBS 20 FP ([0-9a-f]{32})", out.stdout).group(1)
    log = out.stdout + out.stderr
    (start,) = [ln for ln in log.splitlines() if "HiCacheTier HiCacheTier started" in ln]
    assert "INFO" in start and "[vllm.py:" in start  # vLLM's own format: level, file:line
    assert f"L3 redis://admin:***@127.0.0.1:{port}/0" in start and f"fingerprint {fp}" in start
    assert "4096-byte rows" in start and "vLLM CPU tier 256 rows" in start and "known-chunk cap 100000" in start
    assert "hunter2" not in log
    # hicache's own storage warning (the outage), in vLLM's format too.
    (outage,) = [ln for ln in log.splitlines() if "unreachable (put failed" in ln]
    assert "WARNING" in outage and "[base.py:" in outage and f"redis://admin:***@127.0.0.1:{port}/0" in outage
    warned = [ln for ln in log.splitlines() if "a store job of 1 chunks did not fully succeed" in ln]
    assert 1 <= len(warned) <= 5 and all("WARNING" in ln for ln in warned), warned  # 20 failures, few lines


def _scrape() -> dict[str, float]:
    """``hicache_vllm_*`` samples of vLLM's registry (what ``curl :8000/metrics | grep hicache_`` shows)."""
    out = {}
    for line in generate_latest(REGISTRY).decode().splitlines():
        if line.startswith(METRIC_PREFIX):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def test_counters_reach_the_registry_vllm_serves(tmp_path):
    shape = model_shape("opt-125m")
    cfg = offloading_config(shape)
    (tier_cfg,) = cfg.extra_config["secondary_tiers"]
    extra = {**cfg.extra_config, "secondary_tiers": [{**tier_cfg, "url": f"file://{tmp_path}/l3", "probe_l3": False}]}
    cfg = dataclasses.replace(cfg, extra_config=extra)
    # What vLLM's API server builds from the same kv-transfer config (PrometheusStatLogger).
    prom = KVConnectorProm(vllm_config(), ["model_name", "engine"], {0: [shape.hf, "0"]})
    defined = set(TieringOffloadingSpec.build_metric_definitions(extra))
    assert {METRIC_PREFIX + f.name for f in dataclasses.fields(TierStats)} <= defined
    manager = TieringOffloadingSpec(cfg).get_manager()
    try:
        (t,) = manager.secondary_tiers
        assert isinstance(t, HiCacheTier)
        row = t._row_bytes
        ks = keys(1, 2, 3)
        t.submit_store(job(1, ks, [0, 1, 2], promotion=False))
        finish(t)
        t.submit_store(job(2, ks[:1], [0], promotion=False))  # known: skipped
        finish(t)
        path = t.storage.path_of(page_hash(ks[2]))
        blob = bytearray(path.read_bytes())
        blob[-1] ^= 1
        path.write_bytes(bytes(blob))
        t.submit_load(job(3, ks, [3, 1, 0], promotion=True))
        finish(t)
        from vllm.v1.kv_offload.base import ReqContext
        t.lookup(ks[0], ReqContext("q"))
        t.lookup(keys(9)[0], ReqContext("q"))
        with manager.lock:
            stats = manager.get_stats()  # vLLM's manager: primary tier + every secondary tier
        prom.observe(stats.data)
        got = _scrape()
        label = f'{{engine="0",hicache_tier="HiCacheTier",model_name="{shape.hf}"}}'
        want = {"stored": 3, "store_skipped": 1, "loaded": 2, "load_missed": 1, "corrupt": 1, "foreign": 0,
                "bytes_written": 3 * row, "bytes_read": 2 * row, "lookups": 2, "lookup_hits": 1,
                "lookup_misses": 1, "store_jobs": 2, "load_jobs": 1, "load_failed_jobs": 1, "store_failed": 0}
        for name, value in want.items():
            key = f"{METRIC_PREFIX}{name}_total{label}"
            assert got.get(key, 0.0) == value, (key, got.get(key), sorted(got)[:40])
        assert got[f"{METRIC_PREFIX}known_chunks{label}"] == 2  # the corrupt one was forgotten
        # A second scrape period adds only what happened since (vLLM sums the increments).
        t.lookup(ks[0], ReqContext("q"))
        with manager.lock:
            prom.observe(manager.get_stats().data)
        assert _scrape()[f"{METRIC_PREFIX}lookups_total{label}"] == 3
        t.check_integrity()
    finally:
        manager.shutdown()
