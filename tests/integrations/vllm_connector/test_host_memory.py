"""A ``host_bytes`` beyond this machine's memory, in ``kv_connector_extra_config``: each half
of HiCacheConnector (scheduler and worker, one KV cache group or a hybrid model's several)
refuses it with one sentence that names the value and the machine's memory, before it
allocates anything (it was a bare ``MemoryError`` from the scheduler half's page list, and
torch's allocator error from the worker's pool)."""
from __future__ import annotations

import pytest

from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

from tests.integrations.vllm_connector.harness import TOY, connector_config, kv_cache_config
from tests.integrations.vllm_connector.test_hybrid_groups import gpt_oss_config

from hicache.core.config import host_memory
from hicache.core.errors import ConfigError

HUGE = 10**15  # 1 PB


@pytest.mark.parametrize("hybrid", [False, True], ids=["one_group", "hybrid"])
@pytest.mark.parametrize("role", [KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER], ids=lambda r: r.name.lower())
def test_a_host_bytes_beyond_the_ram_is_one_sentence(role, hybrid):
    cfg = connector_config({"host_bytes": HUGE, "storage": {"url": ""}})
    kv = gpt_oss_config() if hybrid else kv_cache_config(TOY, 64)
    with pytest.raises(ConfigError) as e:
        KVConnectorFactory.create_connector(cfg, role, kv)
    msg, (ram, _) = str(e.value), host_memory()
    assert msg.startswith("host_bytes=1,000,000,000,000,000 asks for "), msg
    assert f"of {ram:,} bytes" in msg and "lower host_bytes well below " in msg and "\n" not in msg, msg
