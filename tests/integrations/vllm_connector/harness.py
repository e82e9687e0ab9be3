"""vLLM 0.33's real scheduler with HiCacheConnector on both sides, and a stand-in model.

The scheduler is vLLM's (``create_scheduler``), and it builds the scheduler-side
connector itself from the ``--kv-transfer-config`` fields (``create_vllm_config``);
the worker-side connector comes from vLLM's ``KVConnectorFactory`` with the same
config and is driven by vLLM's own ``KVConnectorModelRunnerMixin`` (what its GPU
model runner wraps each forward in), with ``wait_for_layer_load`` per layer as
attention calls it; vLLM's KV tensors are allocated as vLLM 0.33 does.

The model is a stand-in: computing a token writes, into every layer's K and V
(or MLA latent) row of its slot, bytes that are a function of the token prefix
and the layer (``rows``). Before writing, every forward checks that every token
the scheduler counts as computed holds exactly those bytes, whatever put them
there (vLLM's own prefix cache, a connector load, an earlier chunk), except
blocks reported failed in this same step (vLLM rolls those back).
"""
from __future__ import annotations

import dataclasses
import functools
import time
from unittest.mock import patch

import torch

from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.sampling_params import SamplingParams
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, MLAAttentionSpec
from vllm.forward_context import set_forward_context
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.worker import kv_connector_model_runner_mixin as _mixin
from vllm.v1.worker.kv_connector_model_runner_mixin import KVConnectorModelRunnerMixin
from vllm.v1.request import Request
from vllm.utils.hashing import sha256

from tests.v1.kv_connector.unit.utils import EOS_TOKEN_ID, create_scheduler, create_vllm_config

from hicache.core.shapes import model_shape

BLOCK = 16
MODULE = "hicache.integrations.vllm_connector"


@dataclasses.dataclass(frozen=True)
class Shape:
    name: str
    layers: int
    heads: int  # MHA: KV heads per rank; MLA: 0
    dim: int  # MHA: head dim; MLA: latent + rope
    dtype: torch.dtype
    mla: bool = False


TOY = Shape("toy", 2, 2, 8, torch.float16)
TOY_MLA = Shape("toy-mla", 2, 0, 24, torch.bfloat16, mla=True)


def real_shape(name: str, dtype: torch.dtype | None = None) -> Shape:
    """A row of shared/shapes/real_models.json (every layer, heads per TP rank)."""
    m = model_shape(name)
    dt = dtype or getattr(torch, m.dtype)
    if m.is_mla:
        return Shape(name, m.layers, 0, m.kv_lora_rank + m.qk_rope_head_dim, dt, mla=True)
    return Shape(name, m.layers, m.kv_heads_per_rank, m.head_dim, dt)


def kv_cache_config(shape: Shape, num_blocks: int) -> KVCacheConfig:
    names = [f"model.layers.{i}.self_attn" for i in range(shape.layers)]
    if shape.mla:
        spec = MLAAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=shape.dim, dtype=shape.dtype)
    else:
        spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=shape.heads, head_size=shape.dim, dtype=shape.dtype)
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(names, spec)])


def vllm_tensors(shape: Shape, num_blocks: int, names: list[str], kv_layout: str) -> dict[str, torch.Tensor]:
    """Per-layer KV tensors as vLLM 0.33 allocates them: [B, H, N, C] views of one int8 buffer,
    strided by ``kv_layout`` (``hicache.memory.paged_kv.vllm_kv_caches``, checked against vLLM's
    own ``create_kv_cache_views`` by tests/integrations/vllm/test_paged_kv_vllm.py)."""
    from hicache.core.layout import KVLayout
    from hicache.memory.paged_kv import vllm_kv_caches
    dt = str(shape.dtype).removeprefix("torch.")
    lay = (KVLayout("harness", shape.layers, kind="mla", kv_lora_rank=shape.dim, dtype=dt, page_size=BLOCK)
           if shape.mla else
           KVLayout("harness", shape.layers, num_kv_heads=shape.heads, head_dim=shape.dim, dtype=dt, page_size=BLOCK))
    made = vllm_kv_caches(lay, num_blocks, kv_layout, dtype=torch.uint8 if shape.dtype.itemsize == 1 else shape.dtype)
    return dict(zip(names, made.values()))


def connector_config(extra: dict, *, policy: str = "recompute", tokens_per_step: int = 64, kv_role: str = "kv_both",
                     **kw):
    """The VllmConfig of the docs' ``vllm serve`` line (same connector fields), as on a GPU
    server: FlashAttention (this CPU box would otherwise select CPU_ATTN's block interior)."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
    cfg = create_vllm_config(kv_connector="HiCacheConnector", kv_connector_module_path=MODULE, kv_role=kv_role,
                             kv_connector_extra_config=extra, kv_load_failure_policy=policy,
                             max_num_batched_tokens=tokens_per_step, block_size=BLOCK, **kw)
    cfg.attention_config.backend = AttentionBackendEnum.FLASH_ATTN
    return cfg


_seeded = False


def make_request(rid: str, tokens: list[int], max_tokens: int = 2, kv_transfer_params: dict | None = None) -> Request:
    """``kv_transfer_params``: what vLLM's OpenAI server puts in ``extra_args`` from a request body."""
    global _seeded
    if not _seeded:
        init_none_hash(sha256)
        _seeded = True
    extra = None if kv_transfer_params is None else {"kv_transfer_params": kv_transfer_params}
    sp = SamplingParams(max_tokens=max_tokens, extra_args=extra)
    sp.update_from_generation_config({}, EOS_TOKEN_ID)
    return Request(request_id=rid, prompt_token_ids=list(tokens), sampling_params=sp, pooling_params=None,
                   mm_features=None, block_hasher=get_request_block_hasher(BLOCK, sha256))


def seeds(tokens: list[int]) -> torch.Tensor:
    """One int16 per position, a function of the whole prefix up to it."""
    out, h = [], 17
    for t in tokens:
        h = (h * 1000003 + t + 1) % 2147483629
        out.append((h % 65521) - 32768)
    return torch.tensor(out, dtype=torch.int16)


@functools.lru_cache(maxsize=4096)
def _pattern(layer: int, plane: int, row_bytes: int) -> torch.Tensor:
    a = torch.arange(row_bytes // 2, dtype=torch.int32)
    return ((a * 131 + layer * 1009 + plane * 17) % 65521 - 32768).to(torch.int16)


def rows(prefix_seeds: torch.Tensor, layer: int, plane: int, row_bytes: int) -> torch.Tensor:
    """The bytes the stand-in model writes for these positions of one (layer, plane): a
    per-(layer, plane) pattern plus a per-position seed, as int16 (wrapping), viewed as bytes."""
    return (_pattern(layer, plane, row_bytes)[None, :] + prefix_seeds[:, None]).view(torch.uint8)


@dataclasses.dataclass
class StepLog:
    scheduled: dict[str, int]
    finished_sending: set[str]
    finished_recving: set[str]
    invalid: set[int]
    checked_tokens: int  # computed tokens whose bytes were compared this step


class Engine:
    """vLLM's scheduler + HiCacheConnector (scheduler and worker roles) + the stand-in model."""

    def __init__(self, extra: dict | None, shape: Shape = TOY, *, num_blocks: int = 64, tokens_per_step: int = 64,
                 policy: str = "recompute", vllm_config=None, kv_layout: str = "LBNHC", tp: int = 1,
                 kv_role: str = "kv_both"):
        """``vllm_config``: a config built elsewhere (vLLM's CLI parser) instead of ``connector_config(extra)``;
        ``tp``: tensor-parallel ranks, each a worker connector with ``shape``'s heads (per rank)."""
        self.shape = shape
        self.vllm_config = vllm_config or connector_config(extra, policy=policy, tokens_per_step=tokens_per_step,
                                                           kv_role=kv_role)
        self.vllm_config.parallel_config.tensor_parallel_size = tp
        self.kv_config = kv_cache_config(shape, num_blocks)
        self.scheduler = create_scheduler(self.vllm_config, num_blocks=num_blocks, kv_cache_config=self.kv_config)
        self.connector = self.scheduler.connector  # built by vLLM's scheduler from the config
        self.layer_names = list(self.kv_config.kv_cache_groups[0].layer_names)
        self.workers, self.kvs = [], []  # one worker connector and its KV tensors per TP rank
        pc = self.vllm_config.parallel_config
        for rank in range(pc.tensor_parallel_size):
            pc.rank = rank  # what vLLM sets in each worker process
            w = KVConnectorFactory.create_connector(self.vllm_config, KVConnectorRole.WORKER, self.kv_config)
            kv = vllm_tensors(shape, num_blocks, self.layer_names, kv_layout)
            w.register_kv_caches(kv)
            self.workers.append(w)
            self.kvs.append(kv)
        pc.rank = 0
        self._observe()

    def _observe(self) -> None:
        """What every engine here keeps once its scheduler and workers are up (``self.shape``
        and ``self.workers`` set): the ranks' aggregator, the model's row bytes, the seeds, and
        what vLLM asked of and reported about the connector."""
        shape = self.shape
        self._aggregator = KVOutputAggregator(len(self.workers))  # what vLLM's executor merges ranks with
        self.row_bytes = shape.dim * shape.dtype.itemsize * (1 if shape.mla else shape.heads)
        self._seeds: dict[str, torch.Tensor] = {}
        self.lookups: list[tuple[str, int, int, bool]] = []  # (rid, vLLM's own hit, connector hit, async)
        self._spy_lookups()
        self.checked_tokens = 0
        self.hits_by_source: dict[str, int] = {}  # vLLM's own per-tier hit counts (its /metrics source label)
        self.connector_stats: list[dict] = []  # the kv_connector_stats vLLM's scheduler reports
        self.events: list = []  # the KV events vLLM's scheduler took from the connector
        self.transfer_params: dict[str, dict | None] = {}  # finished rid -> the kv_transfer_params vLLM returned

    def _spy_lookups(self) -> None:
        real = self.connector.get_num_new_matched_tokens

        def spy(request, num_computed_tokens):
            n, is_async = real(request, num_computed_tokens)
            self.lookups.append((request.request_id, num_computed_tokens, n, is_async))
            return n, is_async
        self.connector.get_num_new_matched_tokens = spy
        take = self.connector.take_events

        def take_spy():
            out = list(take())
            self.events.extend(out)
            return out
        self.connector.take_events = take_spy

    # ------------------------------------------------------------- requests
    def add(self, rid: str, tokens: list[int], max_tokens: int = 2, kv_transfer_params: dict | None = None) -> Request:
        req = make_request(rid, tokens, max_tokens, kv_transfer_params)
        self.scheduler.add_request(req)
        return req

    @property
    def worker(self):
        """Rank 0's worker connector."""
        return self.workers[0]

    def planes(self, layer: int, rank: int = 0) -> list[torch.Tensor]:
        """uint8 views [blocks, BLOCK, heads, bytes] of one layer's planes (K and V, or the MLA
        latent), read from vLLM's logical [B, H, N, C] cell order (C: K then V), whatever the strides."""
        u = self.kvs[rank][self.layer_names[layer]].view(torch.uint8).permute(0, 2, 1, 3)  # [B, N, H, C]
        if self.shape.mla:
            return [u]
        half = u.shape[-1] // 2
        return [u[..., :half], u[..., half:]]

    def _blocks(self, rid: str):
        """What ``_compute`` and ``check`` address the request's KV by: its blocks (one group)."""
        return self.scheduler.kv_cache_manager.get_block_ids(rid)[0]

    def _prefix_seeds(self, req: Request) -> torch.Tensor:
        s = self._seeds.get(req.request_id)
        if s is None or len(s) < req.num_tokens:
            s = self._seeds[req.request_id] = seeds(list(req.all_token_ids))
        return s

    def _positions(self, blocks: list[int], start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        pos = torch.arange(start, end)
        return torch.as_tensor(blocks, dtype=torch.int64)[pos // BLOCK], pos % BLOCK

    def check(self, req: Request, blocks: list[int], end: int, skip: set[int] = frozenset(), rank: int = 0) -> int:
        """Assert positions [0, end) hold the stand-in model's bytes (blocks in ``skip`` aside)."""
        if end <= 0:
            return 0
        b, off = self._positions(blocks, 0, end)
        keep = torch.tensor([int(x) not in skip for x in b], dtype=torch.bool)
        s = self._prefix_seeds(req)[:end][keep]
        b, off = b[keep], off[keep]
        for layer in range(self.shape.layers):
            for p, plane in enumerate(self.planes(layer, rank)):
                got = plane[b, off].reshape(len(b), -1)
                want = rows(s, layer, p + 2 * rank, self.row_bytes)
                if not torch.equal(got, want):
                    bad = (got != want).any(dim=1).nonzero().flatten()
                    raise AssertionError(f"{req.request_id}: rank {rank} layer {layer} plane {p}: {len(bad)} of {len(s)} "
                                         f"computed tokens hold wrong KV (first at kept position {int(bad[0])}, "
                                         f"block {int(b[bad[0]])})")
        return int(keep.sum())

    def _compute(self, req: Request, blocks: list[int], start: int, end: int, rank: int) -> None:
        """Each rank's heads get their own bytes (a rank loading another's pages shows)."""
        b, off = self._positions(blocks, start, end)
        s = self._prefix_seeds(req)[start:end]
        for layer in range(self.shape.layers):
            for p, plane in enumerate(self.planes(layer, rank)):
                plane[b, off] = rows(s, layer, p + 2 * rank, self.row_bytes).view(len(b), *plane.shape[2:])

    # ------------------------------------------------------------- steps
    def step(self, between=None) -> StepLog:
        """One engine step. ``between(scheduler_output)``: runs after scheduling, before the worker."""
        so = self.scheduler.schedule()
        if between is not None:
            between(so)
        computed = []  # (request, blocks, first computed position this step, end)
        outs = []
        for rank, w in enumerate(self.workers):
            # vLLM's own model-runner lifecycle (bind, start_load_kv before the forward for
            # sync loads and after it otherwise, wait_for_save, get_transfer_results, load
            # errors, stats, events, worker metadata, clear), with this rank's worker.
            with set_forward_context(None, self.vllm_config), \
                    patch.object(_mixin, "get_kv_transfer_group", return_value=w), \
                    KVConnectorModelRunnerMixin._get_kv_connector_output(so) as kv_out:
                for name in self.layer_names:  # attention's maybe_transfer_kv_layer, layer by layer
                    w.wait_for_layer_load(name)
                for rid, n in so.num_scheduled_tokens.items():
                    req = self.scheduler.requests[rid]
                    end = req.num_computed_tokens
                    blocks = self._blocks(rid)
                    self._compute(req, blocks, end - n, end, rank)
                    if rank == 0:
                        computed.append((req, blocks, end - n, end))
            outs.append(kv_out)
        ids = [req.request_id for req, *_ in computed]
        sampled = [[1000 + req.num_tokens] if end >= req.num_tokens else [] for req, _, _, end in computed]
        per_rank = [ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                                      sampled_token_ids=sampled, logprobs=None, prompt_logprobs_dict={},
                                      pooler_output=None, kv_connector_output=kv) for kv in outs]
        out = self._aggregator.aggregate(per_rank)
        kv_out = out.kv_connector_output
        invalid = set(kv_out.invalid_block_ids) if kv_out is not None else set()
        checked = 0
        for req, blocks, start, end in computed:
            for rank in range(len(self.workers)):
                checked += self.check(req, blocks, start, invalid, rank)
        sending = kv_out.finished_sending if kv_out is not None else None
        recving = kv_out.finished_recving if kv_out is not None else None
        for eco in self.scheduler.update_from_output(so, out).values():
            for o in eco.outputs:
                if o.finish_reason is not None:
                    self.transfer_params[o.request_id] = o.kv_transfer_params
            st = eco.scheduler_stats
            if st is None:
                continue
            if st.connector_prefix_cache_stats is not None:
                for src, n in st.connector_prefix_cache_stats.hits_by_source.items():
                    self.hits_by_source[src.value] = self.hits_by_source.get(src.value, 0) + n
            if st.kv_connector_stats:
                self.connector_stats.append(st.kv_connector_stats)
        self.checked_tokens += checked
        return StepLog(dict(so.num_scheduled_tokens), set(sending or ()), set(recving or ()), invalid, checked)

    def run(self, max_steps: int = 200, between=None, integrity: bool = False) -> list[StepLog]:
        """Step until vLLM has nothing left and the connector no job in flight
        (``integrity``: check both halves' invariants after every step)."""
        logs = []
        for _ in range(max_steps):
            idle = not self.scheduler.has_requests()  # what vLLM's engine loop asks (connector push work too)
            if idle and self.core.in_flight == 0 and not any(w.worker.in_flight for w in self.workers):
                return logs
            logs.append(self.step(between))
            if integrity:
                self.check_integrity()
            if not logs[-1].scheduled:
                time.sleep(0.002)  # copies run on the transfer thread
        left = {r: (q.status.name, q.num_computed_tokens, q.num_tokens) for r, q in self.scheduler.requests.items()}
        raise AssertionError(f"not idle after {max_steps} steps: requests {left}, {self.core.in_flight} connector "
                             f"jobs, loading {sorted(self.core._loading)}, last step {logs[-1]}")

    @property
    def core(self):
        """The vLLM-free scheduler half under the shim."""
        return self.connector.scheduler

    def check_integrity(self) -> None:
        self.core.check_integrity()
        if self.connector.pd is not None:
            self.connector.pd.check_integrity()
        for w in self.workers:
            w.worker.check_integrity()

    def reset_vllm_prefix_cache(self) -> None:
        """Drop vLLM's own prefix cache (as a restart or eviction would), keeping the connector's."""
        assert self.scheduler.kv_cache_manager.block_pool.reset_prefix_cache()

    def close(self) -> None:
        for w in self.workers:
            w.shutdown()
        self.connector.shutdown()


def tokens(seed: int, n: int) -> list[int]:
    return [(seed * 7919 + i * 31) % 30000 + 1 for i in range(n)]


def l3_object(root, prompt: list[int], page: int):
    """The file:// L3 object under ``root`` (a worker's ``storage.dir`` for one TP rank's)
    holding page ``page`` of ``prompt`` (its name is the page hash)."""
    import pathlib
    from hicache.core.hashing import page_hashes
    h = page_hashes(prompt[:(page + 1) * BLOCK], BLOCK)[page].hex()
    found = list(pathlib.Path(root).rglob(h))
    assert len(found) == 1, f"page {page}: {len(found)} L3 objects named {h} under {root}"
    return found[0]


def host_pins(eng: Engine) -> int:
    """L2 pins the connector holds (0 once idle): its index's, or the service pages its jobs hold."""
    from hicache.connector.shared import SharedConnectorScheduler
    if isinstance(eng.core, SharedConnectorScheduler):
        return len(eng.core._held)
    return sum(n.host_lock_ref for n in eng.core.cache.nodes())
