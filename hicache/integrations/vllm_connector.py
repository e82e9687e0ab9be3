"""``HiCacheConnector``: hicache's L2/L3 hierarchy as a vLLM 0.33 ``KVConnectorBase_V1``.

Loaded by vLLM from ``--kv-transfer-config '{"kv_connector":"HiCacheConnector",
"kv_connector_module_path":"hicache.integrations.vllm_connector","kv_role":"kv_both",
"kv_connector_extra_config":{...}}'`` (keys: ``hicache.cache.connector_plan``).
This module only translates vLLM objects to and from the vLLM-free core:
``hicache.cache.connector`` (scheduler half: the index, floors, the cost model)
and ``hicache.cache.connector_worker`` (worker half: page copies, L3 I/O);
what crosses between them is ``hicache.cache.connector_plan`` plain data.
vLLM's KV tensors are adopted as L1 with page id == block id
(``hicache.memory.paged_kv``, every layout vLLM 0.33 allocates); a hicache page
is one vLLM block.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

import torch

from vllm.distributed.kv_events import MEDIUM_CPU, MEDIUM_STORAGE, BlockRemoved, BlockStored, KVCacheEvent
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash
from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec
from vllm.logger import init_logger
from vllm.v1.metrics.cache_hit_source import CacheHitSource
from vllm.v1.request import RequestStatus

from hicache.cache.connector import ConnectorScheduler
from hicache.cache.connector_plan import ConnectorSettings
from hicache.cache.connector_plan import L2
from hicache.cache.connector_plan import JobReport, StepPlan
from hicache.cache.connector_pd import ROLES as PD_ROLES, PDCounters, open_handoffs
from hicache.cache.connector_shared import SharedConnectorScheduler
from hicache.cache.connector_worker import ConnectorWorker
from hicache.core.errors import ConfigError, ContractMismatch
from hicache.core.redact import redact_url
from hicache.core.hashing import tokens_to_bytes
from hicache.core.layout import KVLayout
from hicache.integrations.vllm_keys import ENGINE_CELLS_OF, attention_backend, index_key, model_identity, namespace
from hicache.memory.paged_kv import adopt_paged_kv

# Under vLLM's own logger tree, so the start line shows in vLLM's log at its default level.
log = init_logger("vllm.hicache_connector")

__all__ = ["HiCacheConnector", "HiCacheConnectorMetadata", "HiCacheWorkerMetadata", "HiCacheConnectorStats",
           "layout_of"]


@dataclasses.dataclass
class HiCacheConnectorMetadata(KVConnectorMetadata):
    plan: StepPlan


@dataclasses.dataclass
class HiCacheWorkerMetadata(KVConnectorWorkerMetadata):
    reports: list[JobReport]

    def aggregate(self, other: KVConnectorWorkerMetadata) -> "HiCacheWorkerMetadata":
        if not isinstance(other, HiCacheWorkerMetadata):
            raise ContractMismatch(f"cannot aggregate HiCacheWorkerMetadata with {type(other).__name__}: "
                                   "every rank must run HiCacheConnector")
        return HiCacheWorkerMetadata(self.reports + other.reports)


@dataclasses.dataclass
class HiCacheConnectorStats(KVConnectorStats):
    """Counter deltas since the last report (keys of ``ConnectorStats``, flattened)."""

    def reset(self):
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> "HiCacheConnectorStats":
        for k, v in other.data.items():
            self.data[k] = self.data.get(k, 0) + v
        return self

    def reduce(self) -> dict[str, int | float]:
        return dict(self.data)

    def is_empty(self) -> bool:
        return not any(self.data.values())


# Prometheus families (one declaration each) and the stats keys that feed them.
_FAMILIES = {
    "hicache:connector_pages": ("event", "Pages the connector moved or could not, by event: loaded into vLLM's "
                                "blocks, load_error (reported to vLLM, which recomputes them), saved to L2, "
                                "save_dropped, stored to L3.",
                                {"loaded_pages": "loaded", "load_error_pages": "load_error", "saved_pages": "saved",
                                 "save_dropped_pages": "save_dropped", "stored_pages": "stored"}),
    "hicache:connector_hit_tokens": ("source", "Tokens admitted for loading beyond vLLM's own prefix hit, by tier.",
                                     {"hit_tokens_L2": "L2", "hit_tokens_L3": "L3"}),
    "hicache:connector_admission": ("choice", "The cost model's load-or-recompute choices on hits.",
                                    {f"decision_{c}": c for c in ("load", "load_l2", "recompute", "unmeasured")}),
    "hicache:connector_handoffs": ("event", "Prefill/decode handoffs by event (kv_producer: published, released, "
                                   "expired, publish_failed, ...; kv_consumer: loaded, load_failed, ...).",
                                   {f"handoff_{k}": k for k in PDCounters.__slots__}),
}


class HiCachePromMetrics(KVConnectorPromMetrics):
    """hicache's connector counters on vLLM's ``/metrics`` (from ``HiCacheConnectorStats``)."""

    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters = {}
        for name, (label, doc, keys) in _FAMILIES.items():
            fam = self._counter_cls(name=name, documentation=doc, labelnames=[*labelnames, label])
            for stat_key, value in keys.items():
                self._counters[stat_key] = {e: fam.labels(*lv, value) for e, lv in per_engine_labelvalues.items()}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0):
        for k, v in transfer_stats_data.items():
            if v and k in self._counters:
                self._counters[k][engine_idx].inc(v)


def _tp_rank(role: KVConnectorRole, vllm_config) -> int:
    """This worker's TP rank (the scheduler describes rank 0): vLLM's TP group once it is up,
    else the worker's rank in vLLM's parallel config (pipeline parallelism is 1)."""
    if role != KVConnectorRole.WORKER:
        return 0
    from vllm.distributed import parallel_state
    if parallel_state.model_parallel_is_initialized():
        return parallel_state.get_tensor_model_parallel_rank()
    pc = vllm_config.parallel_config
    return pc.rank % pc.tensor_parallel_size


def layout_of(vllm_config, kv_cache_config, tp_rank: int = 0, draft_layers: int = 0) -> KVLayout:
    """The ``KVLayout`` of vLLM's one KV cache group on this TP rank (``ConfigError`` otherwise);
    its last ``draft_layers`` layers are the drafter's (EAGLE / NextN draft planes)."""
    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        raise ConfigError(f"HiCacheConnector: {len(groups)} KV cache groups; it supports one (start vLLM with "
                          "--disable-hybrid-kv-cache-manager for a hybrid model)")
    spec, layers = groups[0].kv_cache_spec, groups[0].layer_names
    pc = vllm_config.parallel_config
    if pc.pipeline_parallel_size != 1:
        raise ConfigError(f"HiCacheConnector: pipeline_parallel_size={pc.pipeline_parallel_size}; it supports 1")
    dtype = str(spec.dtype).removeprefix("torch.")
    if draft_layers >= len(layers):
        raise ConfigError(f"HiCacheConnector: draft_layers={draft_layers} of a KV cache group of {len(layers)} "
                          "layers; the drafter's layers are the last ones, after at least one target layer")
    backend = attention_backend(vllm_config, spec)
    common = dict(model_id=model_identity(vllm_config.model_config, backend), num_layers=len(layers) - draft_layers,
                  draft_layers=draft_layers, dtype=dtype,
                  page_size=spec.block_size, tp_rank=tp_rank,
                  tp_size=pc.tensor_parallel_size)
    if isinstance(spec, MLAAttentionSpec):
        return KVLayout(kind="mla", kv_lora_rank=spec.head_size, **common)
    if isinstance(spec, FullAttentionSpec):
        return KVLayout(kind="mha", num_kv_heads=spec.num_kv_heads, head_dim=spec.head_size,
                        engine_cells=ENGINE_CELLS_OF.get(backend, ""), **common)
    raise ConfigError(f"HiCacheConnector: KV cache spec {type(spec).__name__} is not supported; "
                      "it supports full attention and MLA")


class HiCacheConnector(KVConnectorBase_V1):
    """See the module docstring; the two halves are ``ConnectorScheduler`` / ``ConnectorWorker``."""

    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None):
        super().__init__(vllm_config, role, kv_cache_config)
        if kv_cache_config is None:
            raise ConfigError("HiCacheConnector needs vLLM's KVCacheConfig (vLLM >= 0.33 passes it)")
        self.settings = s = ConnectorSettings.from_extra(self._kv_transfer_config.kv_connector_extra_config)
        if vllm_config.cache_config.block_size != kv_cache_config.kv_cache_groups[0].kv_cache_spec.block_size:
            raise ConfigError("HiCacheConnector: vLLM's hash block size differs from its KV block size")
        self.layout = layout = layout_of(vllm_config, kv_cache_config, _tp_rank(role, vllm_config), s.draft_layers)
        self._layer_names = list(kv_cache_config.kv_cache_groups[0].layer_names)
        self._layer_index = {n: i for i, n in enumerate(self._layer_names)}
        url = s.config.storage.url
        self._l3_source = CacheHitSource.DISK if url.startswith("file:") else CacheHitSource.EXTERNAL_UNSPECIFIED
        self.scheduler: ConnectorScheduler | SharedConnectorScheduler | None = None
        self.worker: ConnectorWorker | None = None
        ranks = vllm_config.parallel_config.tensor_parallel_size
        device = "cuda" if torch.cuda.is_available() else "cpu"
        if role == KVConnectorRole.SCHEDULER:
            if s.shared:
                self.scheduler = SharedConnectorScheduler(
                    layout, s.open_link(layout, "cpu"), cost=s.cost_model(layout), ranks=ranks,
                    layerwise=s.layerwise, fetch_wait_ms=int(s.probe_budget_s() * 1e3))
            else:
                self.scheduler = ConnectorScheduler(
                    layout, s.host_pages(layout), storage=s.open_l3(layout), cost=s.cost_model(layout),
                    ranks=ranks, layerwise=s.layerwise, probe_budget_s=s.probe_budget_s(),
                    host_eviction=s.config.policy.host_eviction)
            self._reported: dict[str, int] = {}
        else:
            link = s.open_link(layout, device) if s.shared else None
            self.worker = ConnectorWorker(layout, 0 if s.shared else s.host_pages(layout), rank=layout.tp_rank,
                                          storage=s.open_l3(layout), link=link)
        kv_role = self._kv_transfer_config.kv_role
        self.pd = (open_handoffs(kv_role, layout, self.scheduler, s, ranks, self._kv_transfer_config.engine_id)
                   if self.scheduler is not None and kv_role in PD_ROLES else None)  # prefill/decode handoffs
        self._load_errors: set[int] = set()
        self._reports: list[JobReport] = []
        l2 = (f"the node segment at {url}" if s.shared else f"{s.host_pages(layout)} pages of {layout.page_bytes} B")
        log.info("HiCacheConnector started (%s, rank %d): L2 %s, L3 %s, load %s, %d layers x %d-token pages",
                 role.name.lower(), layout.tp_rank, l2, redact_url(url) if url and not s.shared else "none",
                 "layerwise" if s.layerwise else "async", layout.num_layers, layout.page_size)

    @property
    def requires_kv_delivery(self) -> bool:
        """A producer hands prefills off; as ``kv_both`` (a cache) a dropped save is a later miss."""
        return self._kv_transfer_config.kv_role == "kv_producer"

    # ------------------------------------------------------------- worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]):
        self.worker.register(adopt_paged_kv(self.layout, [kv_caches[n] for n in self._layer_names]))

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if not isinstance(meta, HiCacheConnectorMetadata):
            raise ContractMismatch(f"the scheduler sent {type(meta).__name__}, not HiCacheConnectorMetadata: "
                                   "scheduler and workers must run the same connector")
        self.worker.start(meta.plan)

    def wait_for_layer_load(self, layer_name: str) -> None:
        self.worker.wait_layer(self._layer_index[layer_name])

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata, **kwargs: Any) -> None:
        return  # saves copy whole blocks once a request ends (request_finished), not per layer

    def wait_for_save(self):
        return  # saved blocks stay held by vLLM until get_finished reports them (delay_free)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        step = self.worker.finish_step(finished_req_ids)
        self._load_errors |= step.load_errors
        self._reports += step.reports
        return step.finished_saves or None, step.finished_loads or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        out, self._load_errors = self._load_errors, set()
        return out

    def build_connector_worker_meta(self) -> HiCacheWorkerMetadata | None:
        if not self._reports:
            return None
        out, self._reports = self._reports, []
        return HiCacheWorkerMetadata(out)

    def shutdown(self):
        if self.pd is not None:
            self.pd.close()
        if self.worker is not None:
            self.worker.close()
        elif isinstance(self.scheduler, SharedConnectorScheduler):
            self.scheduler.close()
        elif self.scheduler.storage is not None:
            self.scheduler.storage.close()

    # ------------------------------------------------------------- scheduler side
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        params = request.kv_transfer_params or {}
        if self.pd is not None and params.get("do_remote_decode" if self.pd.producer else "do_remote_prefill"):
            if not self.pd.producer:
                return self.pd.lookup(request.request_id, params, *self._prompt_key(request), num_computed_tokens)
            if not self.pd.admit(request.request_id):
                return None, False
        hit = self.scheduler.lookup(request.request_id, request.all_token_ids, num_computed_tokens,
                                    namespace(request), key=index_key(request, self.layout.page_size))
        return hit.tokens, hit.is_async

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int):
        if self.pd is not None and self.pd.allocated(request.request_id, request.kv_transfer_params or {},
                                                     blocks.get_block_ids()[0], num_external_tokens):
            return
        if num_external_tokens:
            self.scheduler.allocated(request.request_id, request.all_token_ids, blocks.get_block_ids()[0],
                                     num_external_tokens, namespace(request), keys=request.block_hashes,
                                     key=index_key(request, self.layout.page_size))

    def get_external_cache_hit_sources(self, request, num_external_tokens: int) -> dict[CacheHitSource, int]:
        if not num_external_tokens:
            return {}
        src = self.scheduler.hit_sources(request.request_id)
        out = {CacheHitSource.HOST: src.get("L2", 0), self._l3_source: src.get("L3", 0)}
        missing = num_external_tokens - sum(out.values())  # pages no tier could serve any more
        if missing > 0:
            out[CacheHitSource.EXTERNAL_UNSPECIFIED] = out.get(CacheHitSource.EXTERNAL_UNSPECIFIED, 0) + missing
        return {k: v for k, v in out.items() if v}

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        plan = self.scheduler.take_plan()
        return HiCacheConnectorMetadata(plan if self.pd is None else self.pd.take_plan(plan))

    def update_connector_output(self, connector_output):
        meta = connector_output.kv_connector_worker_meta
        if meta is not None:
            if not isinstance(meta, HiCacheWorkerMetadata):
                raise ContractMismatch(f"a worker sent {type(meta).__name__}, not HiCacheWorkerMetadata: "
                                       "scheduler and workers must run the same connector")
            self.scheduler.completed(meta.reports if self.pd is None else self.pd.completed(meta.reports))

    def request_finished(self, request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        if self.pd is not None:
            params = request.kv_transfer_params or {}
            if self.pd.producer and params.get("do_remote_decode"):
                done = request.status in (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED)
                first = request.output_token_ids[0] if request.output_token_ids else -1
                return self.pd.publish(request.request_id, *self._prompt_key(request), request.num_computed_tokens,
                                       done, first, block_ids)
            if self.pd.ended(request.request_id):
                return False, None  # its handoff's load still writes the blocks (vLLM waits for it)
        delay = self.scheduler.finished(request.request_id, request.all_token_ids, request.num_computed_tokens,
                                        block_ids, namespace(request), keys=request.block_hashes,
                                        key=index_key(request, self.layout.page_size))
        return delay, None

    def _prompt_key(self, request) -> tuple[bytes, str]:
        """What a handoff is of: the prompt's index key and namespace (P/D only)."""
        ids = list(request.prompt_token_ids or ())
        return index_key(request, self.layout.page_size, ids) or tokens_to_bytes(ids), namespace(request)

    def has_pending_push_work(self) -> bool:
        """A producer's publishes in flight keep vLLM stepping until their records are written."""
        return self.pd is not None and self.pd.publishing

    def take_events(self) -> Iterable[KVCacheEvent]:
        """hicache's L2 (medium CPU) and L3 (medium STORAGE) pages, under vLLM's own block hashes."""
        for e in self.scheduler.take_events():
            hashes = [maybe_convert_block_hash(k) for k in e.keys]
            medium = MEDIUM_CPU if e.medium == L2 else MEDIUM_STORAGE
            if e.stored:
                parent = None if e.parent is None else maybe_convert_block_hash(e.parent)
                yield BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=list(e.tokens),
                                  block_size=self.layout.page_size, lora_id=None, medium=medium, lora_name=None)
            else:
                yield BlockRemoved(block_hashes=hashes, medium=medium)

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        if self.scheduler is None:
            return None
        now = _flat(self.scheduler.stats()) | (self.pd.stats() if self.pd is not None else {})
        delta = {k: v - self._reported.get(k, 0) for k, v in now.items()}
        self._reported = now
        return HiCacheConnectorStats(data=delta) if any(delta.values()) else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return HiCacheConnectorStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        return HiCachePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)



def _flat(stats) -> dict[str, int]:
    out = {"lookups": stats.lookups, "loaded_pages": stats.loaded_pages, "load_error_pages": stats.load_error_pages,
           "saved_pages": stats.saved_pages, "save_dropped_pages": stats.save_dropped_pages,
           "stored_pages": stats.stored_pages}
    out.update({f"hit_tokens_{k}": v for k, v in stats.hit_tokens.items()})
    out.update({f"decision_{k}": v for k, v in stats.decisions.items()})
    return out

