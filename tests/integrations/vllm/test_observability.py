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
from prometheus_client.parser import text_string_to_metric_families
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorProm
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

from hicache.integrations.metrics import VLLM_PREFIX, AdapterStats, VllmTierStats, families
from hicache.integrations.vllm import TIER_METRIC_LABEL, HiCacheTier, page_hash
from hicache.core.shapes import model_shape

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
    assert "WARNING" in outage and "[health.py:" in outage and f"redis://admin:***@127.0.0.1:{port}/0" in outage
    warned = [ln for ln in log.splitlines() if "a store job of 1 chunks did not fully succeed" in ln]
    assert 1 <= len(warned) <= 5 and all("WARNING" in ln for ln in warned), warned  # 20 failures, few lines


def _families_served() -> dict[str, tuple[str, str]]:
    """``hicache_vllm_*`` families on vLLM's registry: name -> (type, help)."""
    return {f.name: (f.type, f.documentation) for f in text_string_to_metric_families(generate_latest(REGISTRY).decode())
            if f.name.startswith(VLLM_PREFIX) and not f.name.endswith("_created")}  # a counter's timestamp


def _scrape(**common: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """``hicache_vllm_*`` samples of vLLM's registry (what ``curl :8000/metrics | grep hicache_`` shows),
    keyed by (sample name, labels other than ``common``); each sample carries ``common``."""
    out = {}
    for fam in text_string_to_metric_families(generate_latest(REGISTRY).decode()):
        for smp in fam.samples:
            if not smp.name.startswith(VLLM_PREFIX) or smp.name.endswith("_created"):
                continue
            assert common.items() <= smp.labels.items(), smp
            own = tuple(sorted((k, v) for k, v in smp.labels.items() if k not in common))
            out[(smp.name, own)] = smp.value
    return out


def _want(name: str, **labels: str) -> tuple[str, tuple[tuple[str, str], ...]]:
    return name, tuple(sorted(labels.items()))


def test_counters_reach_the_registry_vllm_serves(tmp_path):
    shape = model_shape("opt-125m")
    cfg = offloading_config(shape)
    (tier_cfg,) = cfg.extra_config["secondary_tiers"]
    extra = {**cfg.extra_config, "secondary_tiers": [{**tier_cfg, "url": f"file://{tmp_path}/l3", "probe_l3": False}]}
    cfg = dataclasses.replace(cfg, extra_config=extra)
    # What vLLM's API server builds from the same kv-transfer config (PrometheusStatLogger).
    prom = KVConnectorProm(vllm_config(), ["model_name", "engine"], {0: [shape.hf, "0"]})
    defined = TieringOffloadingSpec.build_metric_definitions(extra)
    declared = families(VllmTierStats)
    assert {n for n in defined if n.startswith(VLLM_PREFIX)} == {VLLM_PREFIX + n for n in declared}
    for name, fam in declared.items():
        assert defined[VLLM_PREFIX + name].labelnames == (TIER_METRIC_LABEL, *fam.labels)
        assert defined[VLLM_PREFIX + name].documentation == fam.help
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
        common = {"engine": "0", TIER_METRIC_LABEL: "HiCacheTier", "model_name": shape.hf}
        got = _scrape(**common)
        p = VLLM_PREFIX
        want = {_want(p + "store_pages_total", result="stored"): 3, _want(p + "store_pages_total", result="skipped"): 1,
                _want(p + "load_pages_total", result="hit"): 2, _want(p + "load_pages_total", result="miss"): 1,
                _want(p + "rejected_objects_total", reason="corrupt"): 1,
                _want(p + "bytes_total", op="write"): 3 * row, _want(p + "bytes_total", op="read"): 2 * row,
                _want(p + "lookup_pages_total", result="asked"): 2, _want(p + "lookup_pages_total", result="found"): 1,
                _want(p + "lookup_pages_total", result="miss"): 1,
                _want(p + "jobs_total", op="store", result="submitted"): 2,
                _want(p + "jobs_total", op="load", result="submitted"): 1,
                _want(p + "jobs_total", op="load", result="failed"): 1, _want(p + "jobs_reported_total"): 3,
                _want(p + "group_pages_total", group="0", result="stored"): 3,
                _want(p + "group_pages_total", group="0", result="hit"): 2,
                _want(p + "group_pages_total", group="0", result="miss"): 1,
                _want(p + "known_chunks"): 2}  # the corrupt one was forgotten
        # Counters that never rose have no series (vLLM sends increases only): every other is absent.
        assert got == want, sorted(set(got.items()) ^ set(want.items()))
        # Exactly the declared families are served, each with its declared help and type.
        served = _families_served()
        assert set(served) == {p + n for n in declared}
        assert all(served[p + n] == (f.kind, f.help) for n, f in declared.items())
        # The families both adapters count are AdapterStats's, declared once (same help, same labels).
        assert families(AdapterStats).items() <= declared.items()
        # A second scrape period adds only what happened since (vLLM sums the increments).
        t.lookup(ks[0], ReqContext("q"))
        with manager.lock:
            prom.observe(manager.get_stats().data)
        assert _scrape(**common)[_want(p + "lookup_pages_total", result="asked")] == 3
        t.check_integrity()
    finally:
        manager.shutdown()
