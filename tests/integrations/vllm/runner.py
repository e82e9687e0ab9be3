"""vLLM's RequestRunner (tests/v1/kv_connector/unit/offloading_connector/utils.py)
driving the real scheduler, OffloadingConnector and TieringOffloadingManager
(CPU primary + HiCacheTier), with a worker that moves bytes.

RequestRunner insists on its MockOffloadingSpec (a MagicMock manager, a mock
worker that completes transfers on request). ``HiCacheRunnerSpec`` keeps that
shape and puts the real tiering manager behind the MagicMock (``wraps``); the
only mock left is the GPU: the worker writes each stored chunk's content (a
digest of its key, standing in for the KV a GPU would copy) into the primary
row vLLM chose, and records what each load finds in the primary row it reads.
"""
from __future__ import annotations

import hashlib
from unittest.mock import MagicMock

from vllm.v1.kv_cache_interface import KVCacheGroupSpec
from vllm.v1.kv_offload.base import OffloadingManager, PrepareStoreOutput, ScheduleEndContext
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

from tests.v1.kv_connector.unit.offloading_connector.utils import (
    MockLoadStoreSpec,
    MockOffloadingSpec,
    MockOffloadingWorker,
    RequestRunner,
)
from tests.v1.kv_connector.unit.utils import EOS_TOKEN_ID


def content(key: bytes, nbytes: int) -> bytes:
    """The bytes a chunk with this key holds (deterministic, distinct per key)."""
    out = b""
    i = 0
    while len(out) < nbytes:
        out += hashlib.blake2b(key + i.to_bytes(4, "little"), digest_size=64).digest()
        i += 1
    return out[:nbytes]


class RowsSpec(MockLoadStoreSpec):
    """The keys (for RequestRunner) plus the primary rows vLLM's CPU tier assigned."""

    def __init__(self, keys, chunk_ids, view: memoryview):
        super().__init__(keys)
        self.chunk_ids = [int(c) for c in chunk_ids]
        self.view = view

    def row(self, i: int) -> memoryview:
        stride, width = self.view.strides[0], self.view.shape[1] * self.view.itemsize
        flat = self.view.cast("B")
        return flat[self.chunk_ids[i] * stride:self.chunk_ids[i] * stride + width]


class BytesWorker(MockOffloadingWorker):
    """Stores write ``content(key)`` into the primary row; loads record the row's bytes."""

    def __init__(self):
        super().__init__()
        self.loaded: dict[bytes, bytes] = {}
        self.stored: set[bytes] = set()

    def submit_store(self, job_id, src_spec, dst_spec) -> bool:
        for i, key in enumerate(dst_spec.offload_keys):
            row = dst_spec.row(i)
            row[:] = content(key, row.nbytes)
            self.stored.add(key)
        return super().submit_store(job_id, src_spec, dst_spec)

    def submit_load(self, job_id, src_spec, dst_spec, expedited: bool = False) -> bool:
        for i, key in enumerate(src_spec.offload_keys):
            self.loaded[key] = bytes(src_spec.row(i))
        return super().submit_load(job_id, src_spec, dst_spec, expedited)


class HiCacheRunnerSpec(MockOffloadingSpec):
    """Loaded by vLLM from ``spec_module_path``; the extra config is TieringOffloadingSpec's."""

    def __init__(self, config):
        super().__init__(config)
        self.handler = BytesWorker()
        self._config = config
        self.tiering: TieringOffloadingSpec | None = None

    def get_manager(self) -> OffloadingManager:
        if self.tiering is None:  # scheduler side only (the worker side never asks)
            self.tiering = TieringOffloadingSpec(self._config)
            real = self.tiering.get_manager()
            view = real.primary_tier.get_kv_memoryview()

            def prepare_load(keys, ctx):
                keys = list(keys)
                return RowsSpec(keys, real.prepare_load(keys, ctx).block_ids, view)

            def prepare_store(keys, ctx):
                out = real.prepare_store(keys, ctx)
                if out is None:
                    return None
                return PrepareStoreOutput(keys_to_store=out.keys_to_store, evicted_keys=out.evicted_keys,
                                          store_spec=RowsSpec(out.keys_to_store, out.store_spec.block_ids, view))

            m = MagicMock(spec=OffloadingManager, wraps=real)
            m.prepare_load, m.prepare_store = prepare_load, prepare_store
            self.manager, self.real_manager = m, real
        return self.manager


BLOCK = 16


def make_runner(url: str | None, prefix: str = "", cpu_chunks: int = 4, gpu_blocks: int = 8,
                kv_cache_groups: list[KVCacheGroupSpec] | None = None) -> RequestRunner:
    """RequestRunner over TieringOffloadingSpec with ``cpu_chunks`` primary slots (+ HiCacheTier at ``url``);
    ``kv_cache_groups`` (vLLM's, at block 16) replaces RequestRunner's one-layer group."""
    tiers = [] if url is None else [{"type": "HiCacheTier", "module_path": "hicache.integrations.vllm",
                                     "url": url, "key_prefix": prefix, "probe_l3": False}]
    # A primary row is the largest group's bytes per block (RequestRunner's one
    # 128-byte layer by default), padded to the region's alignment.
    row = max((len(g.layer_names) * g.kv_cache_spec.page_size_bytes for g in kv_cache_groups or ()), default=1)
    align = TieringOffloadingSpec.BLOCK_SIZE_ALIGNMENT
    cpu_bytes = cpu_chunks * -(-row // align) * align
    extra = {"spec_name": "HiCacheRunnerSpec", "spec_module_path": "tests.integrations.vllm.runner",
             "cpu_bytes_to_use": cpu_bytes, "secondary_tiers": tiers}
    runner = RequestRunner(block_size=BLOCK, num_gpu_blocks=gpu_blocks, async_scheduling=False,
                           kv_cache_groups=kv_cache_groups, extra_config_overrides=extra)
    assert isinstance(runner.offloading_spec, HiCacheRunnerSpec)
    assert tiering(runner).primary_tier.get_kv_memoryview().shape[0] == cpu_chunks
    return runner


def tiering(runner: RequestRunner):
    """vLLM's TieringOffloadingManager behind RequestRunner's MagicMock."""
    return runner.manager._mock_wraps


def settle(runner: RequestRunner) -> None:
    """The idle engine steps vLLM takes while ``has_pending_work()`` (RequestRunner
    stops at its own GPU<->CPU jobs): cascades finish and unpin their CPU slots."""
    manager = tiering(runner)
    for tier in manager.secondary_tiers:
        tier.drain_jobs()
    with manager.lock:
        for _ in range(2):  # a step polls the tiers at most once
            manager.on_schedule_end(ScheduleEndContext(new_req_ids=(), preempted_req_ids=()))
    assert not manager.has_pending_work()


def prompt(seed: int, blocks: int) -> list[int]:
    return [1000 * seed + i for i in range(blocks * BLOCK)]


def cycle(runner: RequestRunner, seeds: list[int], blocks: int = 4) -> None:
    for seed in seeds:
        runner.new_request(prompt(seed, blocks))
        runner.run(decoded_tokens=[EOS_TOKEN_ID], expected_stored=tuple(range(blocks)))
        settle(runner)
