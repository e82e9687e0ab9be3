"""docs/vllm-connector.md's ``vllm serve`` line, parsed by vLLM's own CLI parser into
vLLM's own config, then run through vLLM's scheduler; and what vLLM's ``/metrics``
shows for it. Run from tests/test_readme.py (``test_vllm_connector_serve_line``)."""
from __future__ import annotations

import json
import pathlib
import shlex

from vllm.engine.arg_utils import EngineArgs
from vllm.entrypoints.common.cli_args import make_arg_parser
from vllm.utils.argparse_utils import FlexibleArgumentParser

from tests.integrations.vllm_connector.harness import BLOCK, Engine, real_shape, tokens
from tests.integrations.vllm_connector.test_scheduler_path import finish_idle
from tests.test_readme import block

DOC = pathlib.Path(__file__).resolve().parents[3] / "docs" / "vllm-connector.md"


def serve_config(tmp_path):
    """The docs' line with three values replaced, and nothing else: the model (this box has
    opt-125m's config, no Llama weights), the L3 directory (this test's), and host_bytes
    (the docs' 32 GiB, here 64 opt-125m pages)."""
    argv = shlex.split(block(DOC, "test_vllm_connector_serve_line", "bash"))
    assert argv[:2] == ["vllm", "serve"]
    model, rest = argv[2], argv[3:]
    i = rest.index("--kv-transfer-config")
    kv = json.loads(rest[i + 1])
    assert kv["kv_connector"] == "HiCacheConnector" and kv["kv_role"] == "kv_both"
    extra = kv["kv_connector_extra_config"]
    assert extra["storage"]["url"] == "file:///var/lib/hicache/l3" and extra["host_bytes"] == 32 << 30
    extra["storage"]["url"] = f"file://{tmp_path}/l3"
    extra["host_bytes"] = 64 * real_shape("opt-125m").layers * 2 * 12 * 64 * 2 * BLOCK
    rest[i + 1] = json.dumps(kv)
    assert model == "meta-llama/Llama-3.1-8B-Instruct"
    # A GPU server selects FlashAttention's cells (the harness's tensors); this CPU box would pick CPU_ATTN.
    args = make_arg_parser(FlexibleArgumentParser()).parse_args([*rest, "--model", "facebook/opt-125m",
                                                                 "--attention-backend", "FLASH_ATTN"])
    cfg = EngineArgs.from_cli_args(args).create_engine_config()
    assert cfg.kv_transfer_config.kv_connector_module_path == "hicache.integrations.vllm_connector"
    assert cfg.kv_transfer_config.kv_load_failure_policy == "recompute"
    assert cfg.cache_config.block_size == BLOCK
    return cfg


def test_docs_serve_line_builds_the_connector_and_serves_hits(tmp_path):
    shape = real_shape("opt-125m")
    first = Engine(None, shape, num_blocks=16, vllm_config=serve_config(tmp_path))
    assert first.core.layerwise and first.core.cache.host_allocator.capacity == 64
    p = tokens(50, 4 * BLOCK + 2)
    first.add("r1", p)
    first.run()
    finish_idle(first)
    eng = Engine(None, shape, num_blocks=16, vllm_config=serve_config(tmp_path))
    eng.add("r2", p)  # a new engine: from L3
    eng.run()
    eng.reset_vllm_prefix_cache()
    eng.add("r3", p)  # from L2, layer-wise
    eng.run()
    assert eng.lookups == [("r2", 0, 4 * BLOCK, True), ("r3", 0, 4 * BLOCK, False)]
    # What vLLM exports as vllm:prompt_tokens_cached_by_source{source=...}:
    assert eng.hits_by_source == {"disk": 4 * BLOCK, "host": 4 * BLOCK}
    _check_prometheus(eng)
    finish_idle(eng)


def _check_prometheus(eng: Engine) -> None:
    """hicache's counters through vLLM's own KVConnectorProm (what its /metrics serves)."""
    import prometheus_client
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorProm
    prom = KVConnectorProm(eng.vllm_config, ["model_name", "engine"], {0: ["m", "0"]})
    for data in eng.connector_stats:
        prom.observe(data, 0)
    text = prometheus_client.generate_latest().decode()
    want = {'hicache:connector_pages_total{engine="0",event="loaded",model_name="m"} 8.0',
            'hicache:connector_pages_total{engine="0",event="load_error",model_name="m"} 0.0',
            'hicache:connector_hit_tokens_total{engine="0",model_name="m",source="L3"} 64.0',
            'hicache:connector_hit_tokens_total{engine="0",model_name="m",source="L2"} 64.0',
            'hicache:connector_admission_total{choice="unmeasured",engine="0",model_name="m"} 2.0'}
    assert want <= set(text.splitlines()), [x for x in text.splitlines() if x.startswith("hicache:")]
