"""``HiCacheConnector``: hicache's L2/L3 hierarchy as a vLLM 0.33 ``KVConnectorBase_V1``.

Loaded by vLLM from ``--kv-transfer-config '{"kv_connector":"HiCacheConnector",
"kv_connector_module_path":"hicache.integrations.vllm_connector","kv_role":"kv_both",
"kv_connector_extra_config":{...}}'`` (keys: ``hicache.connector.plan``).
This module only translates vLLM objects to and from the vLLM-free core:
``hicache.connector.scheduler`` (scheduler half: the index, floors, the cost model)
and ``hicache.connector.worker`` (worker half: page copies, L3 I/O);
what crosses between them is ``hicache.connector.plan`` plain data.
vLLM's KV tensors are adopted as L1 with page id == block id
(``hicache.memory.paged_kv``, every layout vLLM 0.33 allocates); a hicache page
is one vLLM block.
"""
from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterable
from typing import Any

import torch

from vllm.distributed.kv_events import MEDIUM_CPU, MEDIUM_STORAGE, BlockRemoved, BlockStored, KVCacheEvent
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash
from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec, MLAAttentionSpec, SlidingWindowSpec
from vllm.logger import init_logger
from vllm.v1.metrics.cache_hit_source import CacheHitSource
from vllm.v1.request import RequestStatus

from hicache.connector.hybrid import HybridConnectorScheduler
from hicache.connector.scheduler import ConnectorScheduler
from hicache.connector.plan import ConnectorSettings
from hicache.connector.plan import L2
from hicache.connector.plan import JobReport, StepPlan
from hicache.connector.pd import ROLES as PD_ROLES, open_handoffs
from hicache.connector.shared import SharedConnectorScheduler
from hicache.connector.worker import ConnectorWorker, GroupWorkers
from hicache.core.config import HostNeed, check_host_memory
from hicache.core.errors import ConfigError, ContractMismatch
from hicache.core.redact import redact_url
from hicache.core.hashing import tokens_to_bytes
from hicache.core.layout import LIMITS, KVLayout
from hicache.core.stats import ConnectorStats
from hicache.integrations.metrics import families, flat_series, series, series_key
from hicache.integrations.vllm_groups import engine_groups
from hicache.integrations.vllm_keys import ENGINE_CELLS_OF, attention_backend, index_key, model_identity, namespace
from hicache.memory.paged_kv import adopt_paged_kv, vllm_state_cells

# Forwards of fewer tokens (decode steps) are not prefill rates: weights, not tokens, set their time.
_PREFILL_STEP_TOKENS = 256
# A running request's new full pages are saved once this many have accumulated (its
# prompt's at once); a preempted or aborted request loses at most the pages since.
_STEP_SAVE_PAGES = 4
_U64 = (1 << 64) - 1  # vLLM's int block hashes: the low 64 bits of the hash (maybe_convert_block_hash)
# Under vLLM's own logger tree, so the start line shows in vLLM's log at its default level.
log = init_logger("vllm.hicache_connector")

__all__ = ["HiCacheConnector", "HiCacheConnectorMetadata", "HiCacheWorkerMetadata", "HiCacheConnectorStats",
           "layout_of"]


@dataclasses.dataclass
class HiCacheConnectorMetadata(KVConnectorMetadata):
    plan: StepPlan
    tokens: int = 0  # tokens the step's forward computes (the workers time it for the cost model)


@dataclasses.dataclass
class HiCacheWorkerMetadata(KVConnectorWorkerMetadata):
    reports: list[JobReport]
    forward: tuple[int, float] = (0, 0.0)  # (tokens, seconds) of the step's forward on this rank

    def aggregate(self, other: KVConnectorWorkerMetadata) -> "HiCacheWorkerMetadata":
        if not isinstance(other, HiCacheWorkerMetadata):
            raise ContractMismatch(f"cannot aggregate HiCacheWorkerMetadata with {type(other).__name__}: "
                                   "every rank must run HiCacheConnector")
        return HiCacheWorkerMetadata(self.reports + other.reports, max(self.forward, other.forward,
                                                                        key=lambda f: f[1]))


@dataclasses.dataclass
class HiCacheConnectorStats(KVConnectorStats):
    """Counter deltas since the last report (``flat_series`` of ``ConnectorStats``)."""

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


class HiCachePromMetrics(KVConnectorPromMetrics):
    """hicache's connector counters on vLLM's ``/metrics``: the families ``ConnectorStats``
    declares, as ``hicache:<family>``, fed by ``HiCacheConnectorStats`` (``flat_series`` deltas)."""

    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        declared = families(ConnectorStats)
        counters = {name: self._counter_cls(name=f"hicache:{name}", documentation=f.help,
                                            labelnames=[*labelnames, *f.labels]) for name, f in declared.items()}
        self._counters = {}  # series key -> engine index -> its child counter
        for name, labels, _ in series(ConnectorStats()):
            values = [labels[k] for k in declared[name].labels]
            self._counters[series_key(name, labels)] = {e: counters[name].labels(*lv, *values)
                                                         for e, lv in per_engine_labelvalues.items()}

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


def layout_of(vllm_config, kv_cache_config, tp_rank: int = 0, model_id: str = "", draft_layers: int = 0) -> KVLayout:
    """The ``KVLayout`` of vLLM's one KV cache group on this TP rank (``ConfigError`` otherwise).
    ``model_id``: the operator's name for the model; by default ``model_identity``'s. Its last
    ``draft_layers`` layers are the drafter's (EAGLE / NextN draft planes)."""
    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        kinds = ", ".join(f"{g.index}: {g.kind}" for g in engine_groups(kv_cache_config))
        raise ConfigError(f"HiCacheConnector: {len(groups)} KV cache groups ({kinds}); it moves one group's "
                          "pages (start vLLM with --disable-hybrid-kv-cache-manager for a hybrid model)")
    spec, layers = groups[0].kv_cache_spec, groups[0].layer_names
    pc = vllm_config.parallel_config
    if pc.pipeline_parallel_size != 1:
        raise ConfigError(f"HiCacheConnector: pipeline_parallel_size={pc.pipeline_parallel_size}; it supports 1")
    dtype = str(getattr(spec, "dtype", "uint8")).removeprefix("torch.")  # a MambaSpec: bytes
    if draft_layers >= len(layers):
        raise ConfigError(f"HiCacheConnector: draft_layers={draft_layers} of a KV cache group of {len(layers)} "
                          "layers; the drafter's layers are the last ones, after at least one target layer")
    backend = spec.mamba_type.name.lower() if isinstance(spec, MambaSpec) else attention_backend(vllm_config, spec)
    common = dict(model_id=model_id or model_identity(vllm_config.model_config, backend),
                  num_layers=len(layers) - draft_layers, draft_layers=draft_layers, dtype=dtype,
                  page_size=spec.block_size, tp_rank=tp_rank,
                  tp_size=pc.tensor_parallel_size)
    if isinstance(spec, MLAAttentionSpec):
        return KVLayout(kind="mla", kv_lora_rank=spec.head_size, **common)
    if isinstance(spec, (FullAttentionSpec, SlidingWindowSpec)):
        return KVLayout(kind="mha", num_kv_heads=spec.num_kv_heads, head_dim=spec.head_size,
                        engine_cells=ENGINE_CELLS_OF.get(backend, ""), **common)
    if isinstance(spec, MambaSpec):
        return state_layout(spec, common)
    raise ConfigError(f"HiCacheConnector: KV cache spec {type(spec).__name__} is not supported; "
                      "it supports full attention and MLA")


def state_layout(spec, common: dict) -> KVLayout:
    """A Mamba / linear-attention group's layout: one page is one block of every layer, each
    layer's block the raw bytes vLLM keeps its states in (``MambaBase.bind_kv_cache`` slices
    conv and SSM states out of them), as an MLA-shaped byte plane. Its rows only address
    bytes (a state has no tokens): the fewest rows that split the block within a row's limit."""
    nbytes = spec.real_page_size_bytes  # the states; vLLM pads the block's stride to the group's page, not the view
    rows = next((n for n in range(1, LIMITS["page_size"] + 1)
                 if nbytes % n == 0 and nbytes // n <= LIMITS["kv_lora_rank"]), None)
    if rows is None:
        raise ConfigError(f"HiCacheConnector: a state group's block of {nbytes} bytes splits into no rows of at "
                          f"most {LIMITS['kv_lora_rank']} bytes; it moves blocks of up to "
                          f"{LIMITS['page_size'] * LIMITS['kv_lora_rank']} bytes that divide into such rows")
    return KVLayout(**{**common, "dtype": "uint8", "page_size": rows}, kind="mla", kv_lora_rank=nbytes // rows)


@dataclasses.dataclass(slots=True)
class _Running:
    """A running request whose new full pages are saved as they are computed."""

    request: Any
    blocks: list[int] | None = None  # its block ids (None: not known since a preemption)
    offered: int = 0  # full pages already offered to a save


class HiCacheConnector(KVConnectorBase_V1, SupportsHMA):
    """See the module docstring; the two halves are ``ConnectorScheduler`` / ``ConnectorWorker``
    (a hybrid model, several KV cache groups: ``HybridConnectorScheduler`` / ``GroupWorkers``)."""

    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None):
        super().__init__(vllm_config, role, kv_cache_config)
        if kv_cache_config is None:
            raise ConfigError("HiCacheConnector needs vLLM's KVCacheConfig (vLLM >= 0.33 passes it)")
        self.settings = s = ConnectorSettings.from_extra(self._kv_transfer_config.kv_connector_extra_config)
        if vllm_config.cache_config.block_size != kv_cache_config.kv_cache_groups[0].kv_cache_spec.block_size:
            raise ConfigError("HiCacheConnector: vLLM's hash block size differs from its KV block size")
        url = s.config.storage.url
        self._l3_source = CacheHitSource.DISK if url.startswith("file:") else CacheHitSource.EXTERNAL_UNSPECIFIED
        self.scheduler: ConnectorScheduler | SharedConnectorScheduler | HybridConnectorScheduler | None = None
        self.worker: ConnectorWorker | GroupWorkers | None = None
        self._reported: dict[str, int] = {}
        ranks = vllm_config.parallel_config.tensor_parallel_size
        self._layouts: dict[int, KVLayout] = {}  # a hybrid model's: group index -> its layout
        self._states: set[int] = set()  # a hybrid model's state (Mamba) groups
        self._stated: dict[str, Any] = {}  # scheduler: requests whose state blocks the engine may offer
        if len(kv_cache_config.kv_cache_groups) > 1:
            self._start_hybrid(vllm_config, role, kv_cache_config, ranks)
        else:
            self._start_one(vllm_config, role, kv_cache_config, ranks)
        layout = self.layout
        kv_role = self._kv_transfer_config.kv_role
        self.pd = (open_handoffs(kv_role, layout, self.scheduler, s, ranks, self._kv_transfer_config.engine_id)
                   if self.scheduler is not None and kv_role in PD_ROLES else None)  # prefill/decode handoffs
        self._load_errors: set[int] = set()
        self._forward_start: tuple[int, float] = (0, 0.0)  # worker: (tokens, start) of the step's forward
        self._forward: tuple[int, float] = (0, 0.0)  # worker: the last forward's (tokens, seconds), not yet sent
        self._reports: list[JobReport] = []
        # scheduler: running requests whose new full pages are saved as they are computed
        self._running: dict[str, _Running] = {}
        self._step_saves = isinstance(self.scheduler, ConnectorScheduler)
        l2 = (f"the node segment at {url}" if s.shared else f"{s.host_pages(layout)} pages of {layout.page_bytes} B"
              if not self._layouts else f"{self._group_pages} pages per KV cache group ({len(self._layouts)} groups)")
        log.info("HiCacheConnector started (%s, rank %d): L2 %s, L3 %s, load %s, %d layers x %d-token pages, "
                 "model %s (fingerprint %s)", role.name.lower(), layout.tp_rank, l2,
                 redact_url(url) if url and not s.shared else "none", "layerwise" if s.layerwise and not self._layouts else "async",
                 layout.num_layers, layout.page_size, layout.model_id, layout.fingerprint()[:12])

    def _start_one(self, vllm_config, role: KVConnectorRole, kv_cache_config, ranks: int) -> None:
        """One KV cache group: this role's half over its layout."""
        s = self.settings
        self.layout = layout = layout_of(vllm_config, kv_cache_config, _tp_rank(role, vllm_config), s.model_id,
                                         s.draft_layers)
        self._layer_names = list(kv_cache_config.kv_cache_groups[0].layer_names)
        self._layer_index = {n: i for i, n in enumerate(self._layer_names)}
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
        else:
            device = "cuda" if torch.cuda.is_available() else "cpu"
            link = s.open_link(layout, device) if s.shared else None
            self.worker = ConnectorWorker(layout, 0 if s.shared else s.host_pages(layout), rank=layout.tp_rank,
                                          storage=s.open_l3(layout), link=link)

    def _start_hybrid(self, vllm_config, role: KVConnectorRole, kv_cache_config, ranks: int) -> None:
        """A hybrid model: a layout, an L2 and a worker per KV cache group (``hicache.connector.hybrid``);
        ``host_bytes`` is shared out as the same number of pages per group."""
        s = self.settings
        if s.shared:
            raise ConfigError("HiCacheConnector: a hybrid model's KV cache groups keep L2s of their own; the node "
                              "service's segment serves one layout (use a file:// or redis:// storage URL, or "
                              "start vLLM with --disable-hybrid-kv-cache-manager)")
        groups = engine_groups(kv_cache_config)
        tp = _tp_rank(role, vllm_config)
        main = next(i for i, g in enumerate(groups) if g.kind == "full")
        layouts = [layout_of(vllm_config, dataclasses.replace(kv_cache_config, kv_cache_groups=[g]), tp, s.model_id)
                   for g in kv_cache_config.kv_cache_groups]
        # Every other group's items are keyed by the same page hashes as the index group's pages,
        # and groups of one kind often have equal shapes (gpt-oss's sliding and full layers, Qwen3-Next's
        # three state groups): the group in the model id gives each its own fingerprint, so its own L3
        # objects (and a wrong group's object is refused by its header, never loaded).
        layouts = [x if i == main else dataclasses.replace(x, model_id=f"{x.model_id} [group {g.index} {g.kind}]")
                   for i, (g, x) in enumerate(zip(groups, layouts))]
        pages = s.host_bytes // sum(x.page_bytes for x in layouts) if s.host_bytes else s.config.pool.host_pages
        if pages < 1:
            raise ConfigError(f"HiCacheConnector: host_bytes={s.host_bytes} holds no page of each KV cache group "
                              f"({sum(x.page_bytes for x in layouts)} bytes together); give at least that")
        check_host_memory(HostNeed("host_bytes" if s.host_bytes else "pool.host_pages", s.host_bytes or pages,
                                   pages * sum(x.page_bytes for x in layouts)))
        self.layout = layouts[main]
        self._group_pages = pages
        self._layouts = {g.index: x for g, x in zip(groups, layouts)}
        self._group_layers = {g.index: list(g.layers) for g in groups}
        self._states = {g.index for g in groups if g.kind == "state"}
        self._layer_index = {n: (g.index, i) for g in groups for i, n in enumerate(g.layers)}
        if role == KVConnectorRole.SCHEDULER:
            self.scheduler = HybridConnectorScheduler(
                groups, layouts, [pages] * len(groups), ranks=ranks, storage=s.open_l3(self.layout),
                lane_storage={i: s.open_l3(x) for i, x in enumerate(layouts) if i != main},
                # always between steps: a load error of a hybrid model is told per request, which only
                # a request waiting for its load can be (vLLM refuses block-level errors with several
                # groups); and vLLM's Mamba layers never call wait_for_layer_load, so a layer-wise
                # state load would race the forward
                cost=s.cost_model(self.layout), layerwise=False, probe_budget_s=s.probe_budget_s(),
                host_eviction=s.config.policy.host_eviction)
        else:
            self.worker = GroupWorkers({g.index: ConnectorWorker(x, pages, rank=x.tp_rank, storage=s.open_l3(x))
                                        for g, x in zip(groups, layouts)})

    @property
    def requires_kv_delivery(self) -> bool:
        """A producer hands prefills off; as ``kv_both`` (a cache) a dropped save is a later miss."""
        return self._kv_transfer_config.kv_role == "kv_producer"

    # ------------------------------------------------------------- worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]):
        if isinstance(self.worker, GroupWorkers):
            for g, w in self.worker.workers.items():
                x = self._layouts[g]
                tensors = [kv_caches[n] for n in self._group_layers[g]]
                w.register(adopt_paged_kv(x, [vllm_state_cells(t, x) for t in tensors] if g in self._states else tensors))
            return
        self.worker.register(adopt_paged_kv(self.layout, [kv_caches[n] for n in self._layer_names]))

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if not isinstance(meta, HiCacheConnectorMetadata):
            raise ContractMismatch(f"the scheduler sent {type(meta).__name__}, not HiCacheConnectorMetadata: "
                                   "scheduler and workers must run the same connector")
        self._forward_start = (meta.tokens, time.perf_counter())
        self.worker.start(meta.plan)

    def wait_for_layer_load(self, layer_name: str) -> None:
        at = self._layer_index[layer_name]
        self.worker.wait_layer(*at) if isinstance(at, tuple) else self.worker.wait_layer(at)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata, **kwargs: Any) -> None:
        return  # saves copy whole pages (build_connector_meta, request_finished), not per layer

    def wait_for_save(self):
        return  # saved blocks stay held by vLLM until get_finished reports them (delay_free)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        r = self.get_transfer_results(finished_req_ids)
        return r.finished_sending or None, r.finished_recving or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """This step's finished saves and loads. One KV cache group: a failed load's blocks go to
        ``get_block_ids_with_load_errors``. Several (block ids are unique only within a group,
        and vLLM refuses block-level errors then): the request goes to ``failed_recving``
        (vLLM recomputes it, or fails it under ``kv_load_failure_policy=fail``)."""
        step = self.worker.finish_step(finished_req_ids)
        tokens, t0 = self._forward_start
        if tokens:
            self._forward = (tokens, time.perf_counter() - t0)
        self._forward_start = (0, 0.0)
        if not self._layouts:
            self._load_errors |= step.load_errors
        self._reports += step.reports
        return KVConnectorTransferResults(finished_sending=step.finished_saves, finished_recving=step.finished_loads,
                                          failed_recving=step.failed_loads if self._layouts else set())

    def get_block_ids_with_load_errors(self) -> set[int]:
        out, self._load_errors = self._load_errors, set()
        return out

    def build_connector_worker_meta(self) -> HiCacheWorkerMetadata | None:
        if not self._reports and not self._forward[0]:
            return None
        out, self._reports, forward, self._forward = self._reports, [], self._forward, (0, 0.0)
        return HiCacheWorkerMetadata(out, forward)

    def shutdown(self):
        if self.pd is not None:
            self.pd.close()
        if self.worker is not None:
            self.worker.close()
        elif isinstance(self.scheduler, (SharedConnectorScheduler, HybridConnectorScheduler)):
            self.scheduler.close()
        if isinstance(self.scheduler, (ConnectorScheduler, HybridConnectorScheduler)) and \
                self.scheduler.storage is not None:
            self.scheduler.storage.close()  # (a hybrid model's: its index group's L3)

    # ------------------------------------------------------------- scheduler side
    @property
    def _index_half(self) -> ConnectorScheduler | SharedConnectorScheduler:
        """The scheduler half that keys the index, holds the cost model and the waiting
        requests: the scheduler itself, or a hybrid model's index group's."""
        return self.scheduler.core if self._layouts else self.scheduler

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        params = request.kv_transfer_params or {}
        if self.pd is not None and params.get("do_remote_decode" if self.pd.producer else "do_remote_prefill"):
            if not self.pd.producer:
                return self.pd.lookup(request.request_id, params, *self._prompt_key(request), num_computed_tokens)
            if not self.pd.admit(request.request_id):
                return None, False
        hit = self.scheduler.lookup(request.request_id, request.all_token_ids, num_computed_tokens,
                                    namespace(request), key=index_key(request, self.layout.page_size))
        if hit.waits:  # another request's load brings these pages: vLLM asks again next step
            return None, False
        return hit.tokens, hit.is_async

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int):
        self._index_half.admitted(request.request_id)
        if self._states:
            self._stated[request.request_id] = request
        params = request.kv_transfer_params or {}
        if self._step_saves and not (params.get("do_remote_decode") or params.get("do_remote_prefill")):
            self._running[request.request_id] = _Running(request)
        if self.pd is not None and self.pd.allocated(request.request_id, request.kv_transfer_params or {},
                                                     blocks.get_block_ids()[0], num_external_tokens):
            return
        if num_external_tokens:
            ids = blocks.get_block_ids()
            self.scheduler.allocated(request.request_id, request.all_token_ids, ids if self._layouts else ids[0],
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

    def _save_running(self, out) -> None:
        """Queue a save of every scheduled request's full pages computed since its last one
        (vLLM advances ``num_computed_tokens`` after this call: these are the pages earlier
        steps computed). Block ids follow the scheduler output: the whole list for a new or
        resumed request, the new ones appended otherwise."""
        running, ps = self._running, self.layout.page_size
        for rid in out.preempted_req_ids or ():
            if rid in running:
                running[rid].blocks = None  # its blocks are gone; a resume lists them anew
        for nr in out.scheduled_new_reqs:
            if nr.req_id in running:
                running[nr.req_id].blocks = list(nr.block_ids[0])
        cached = out.scheduled_cached_reqs
        for rid, new in zip(cached.req_ids, cached.new_block_ids):
            r = running.get(rid)
            if r is None:
                continue
            if rid in cached.resumed_req_ids:
                r.blocks = list(new[0]) if new else []
            elif new and r.blocks is not None:
                r.blocks.extend(new[0])
        for rid in out.num_scheduled_tokens:
            r = running.get(rid)
            if r is None or r.blocks is None:
                continue
            req = r.request
            pages = min(req.num_computed_tokens, len(r.blocks) * ps) // ps
            # the prompt's pages at once; a decoding request's every _STEP_SAVE_PAGES pages (each
            # save walks the request's key: per page, that was most of a step's host time)
            if pages - r.offered >= (_STEP_SAVE_PAGES if r.offered else 1) and self.scheduler.step_save(
                    rid, req.all_token_ids, req.num_computed_tokens, r.blocks, namespace(req),
                    keys=req.block_hashes, key=index_key(req, ps)) is not None:
                r.offered = pages

    def _save_states(self, out) -> None:
        """vLLM's Mamba ``align`` hand-offs of this pass: each the exact block of a state at a
        block boundary, written by this step's forward (saved after it)."""
        block_state = getattr(out, "kv_connector_block_state", None)
        for rid, offers in (block_state.boundary_state_offloads if block_state is not None else {}).items():
            req = self._stated.get(rid)
            if req is not None:
                self.scheduler.boundary_states(rid, req.all_token_ids, offers, namespace(req),
                                               key=index_key(req, self.layout.page_size))

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        if self._running:
            self._save_running(scheduler_output)
        if self._stated:
            self._save_states(scheduler_output)
        plan = self.scheduler.take_plan()
        return HiCacheConnectorMetadata(plan if self.pd is None else self.pd.take_plan(plan),
                                        scheduler_output.total_num_scheduled_tokens)

    def update_connector_output(self, connector_output):
        meta = connector_output.kv_connector_worker_meta
        if meta is not None:
            if not isinstance(meta, HiCacheWorkerMetadata):
                raise ContractMismatch(f"a worker sent {type(meta).__name__}, not HiCacheWorkerMetadata: "
                                       "scheduler and workers must run the same connector")
            self.scheduler.completed(meta.reports if self.pd is None else self.pd.completed(meta.reports))
            tokens, seconds = meta.forward
            if tokens >= _PREFILL_STEP_TOKENS:  # a prefill-sized forward: the rate recomputing a hit would run at
                self._index_half.cost.observe_prefill(tokens, seconds)

    def request_finished(self, request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._running.pop(request.request_id, None)
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

    def request_finished_all_groups(self, request, block_ids: tuple[list[int], ...]) -> tuple[bool, dict | None]:
        """vLLM's hybrid manager ends a request: every group's blocks (one group: ``request_finished``)."""
        if not self._layouts:
            return self.request_finished(request, block_ids[0])
        self._stated.pop(request.request_id, None)
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
        events = self.scheduler.take_events()
        if not events:
            return
        # vLLM's maybe_convert_block_hash reads an environment variable per call: per page, that
        # was most of a step's host time in the steps that evicted thousands of L2 pages. Asked
        # once here; its conversion (the hash's low 64 bits as an int) is then done inline.
        convert = maybe_convert_block_hash(b"\x01") != b"\x01"
        for e in events:
            hashes = [int.from_bytes(k, "big") & _U64 for k in e.keys] if convert else list(e.keys)
            medium = MEDIUM_CPU if e.medium == L2 else MEDIUM_STORAGE
            if e.stored:
                parent = e.parent if e.parent is None or not convert else maybe_convert_block_hash(e.parent)
                yield BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=list(e.tokens),
                                  block_size=self.layout.page_size, lora_id=None, medium=medium, lora_name=None)
            else:
                yield BlockRemoved(block_hashes=hashes, medium=medium)

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        if self.scheduler is None:
            return None
        st = self.scheduler.stats()
        now = flat_series(st if self.pd is None else dataclasses.replace(st, handoffs=self.pd.stats()))
        delta = {k: v - self._reported.get(k, 0) for k, v in now.items()}
        self._reported = now
        return HiCacheConnectorStats(data=delta) if any(delta.values()) else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return HiCacheConnectorStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        return HiCachePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)
