"""vLLM's own generic connector tests, pointed at HiCacheConnector where they can be.

Pointed: ``test_kv_connector_lifecycle.py::test_kv_connector_mixin_clears_metadata``
(below: the same steps, vLLM's ``ensure_kv_transfer_initialized`` building
HiCacheConnector as the worker's global connector; its ``call_record`` assertions
belong to vLLM's recording wrapper around ExampleConnector, so the check here is
the metadata being cleared and the empty step reporting nothing). Every step of
``harness.Engine`` also runs vLLM's model-runner mixin around HiCacheConnector.

Not pointable: ``test_kv_load_failure_recovery.py``, ``test_invalid_blocks_correctness.py``,
``test_error_propagation.py`` and ``test_cache_pollution_prevention.py`` replace
``scheduler.connector`` with a ``Mock`` and script both its answers and the
worker's ``invalid_block_ids``: no connector code runs. Their scenarios run with
HiCacheConnector's real answers and real load failures in test_failures.py.
"""
from __future__ import annotations

from unittest.mock import MagicMock, patch

from vllm.distributed.kv_transfer.kv_transfer_state import (
    ensure_kv_transfer_initialized,
    ensure_kv_transfer_shutdown,
    get_kv_transfer_group,
)
from vllm.v1.core.sched.output import CachedRequestData, SchedulerOutput
from vllm.v1.worker.kv_connector_model_runner_mixin import KVConnectorModelRunnerMixin

from hicache.connector.plan import StepPlan
from hicache.integrations.vllm_connector import HiCacheConnector, HiCacheConnectorMetadata
from tests.integrations.vllm_connector.harness import TOY, connector_config, kv_cache_config, vllm_tensors


def test_kv_connector_mixin_clears_metadata_for_hicache_connector():
    vllm_config = connector_config({"pool": {"host_pages": 8}, "storage": {"url": ""}})
    kv_config = kv_cache_config(TOY, 8)
    tp_group = MagicMock()
    tp_group.broadcast_object.side_effect = lambda value, src=0: value
    with patch("vllm.distributed.parallel_state.get_tp_group", return_value=tp_group):
        ensure_kv_transfer_initialized(vllm_config, kv_config)
    try:
        connector = get_kv_transfer_group()
        assert isinstance(connector, HiCacheConnector) and connector.worker is not None
        names = kv_config.kv_cache_groups[0].layer_names
        connector.register_kv_caches(vllm_tensors(TOY, 8, names, "LBNHC"))
        so = SchedulerOutput(scheduled_new_reqs=[], scheduled_cached_reqs=CachedRequestData.make_empty(),
                             num_scheduled_tokens={}, total_num_scheduled_tokens=0, scheduled_spec_decode_tokens={},
                             scheduled_encoder_inputs={}, finished_req_ids=set(), free_encoder_mm_hashes=[],
                             kv_connector_metadata=HiCacheConnectorMetadata(StepPlan()))
        out = KVConnectorModelRunnerMixin.kv_connector_no_forward(so, vllm_config)
        assert connector._connector_metadata is None
        kv = out.kv_connector_output
        assert kv is None or (not kv.finished_sending and not kv.finished_recving and not kv.invalid_block_ids)
    finally:
        ensure_kv_transfer_shutdown()
