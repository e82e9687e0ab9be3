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

from vllm.v1.kv_offload.base import OffloadingManager, PrepareStoreOutput
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

from tests.v1.kv_connector.unit.offloading_connector.utils import (
    MockLoadStoreSpec,
    MockOffloadingSpec,
    MockOffloadingWorker,
)


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
