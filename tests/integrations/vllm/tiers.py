"""Building blocks shared by the vLLM integration tests: a primary view, a config
as vLLM's factory would pass it, and a tier built over a URL."""
from __future__ import annotations

import time
import types

import numpy as np
from vllm.v1.kv_offload.base import LookupResult, OffloadKey, ScheduleEndContext, make_offload_key
from vllm.v1.kv_offload.tiering.base import TransferJob

from hicache.integrations.vllm import HiCacheTier
from tests.v1.kv_offload.conftest import make_offloading_config  # vLLM's helper

ROW = 64  # bytes per primary row (one chunk)


def primary(num_chunks: int = 8) -> tuple[np.ndarray, memoryview]:
    """A (num_chunks, ROW) int8 primary buffer and the memoryview vLLM hands a tier."""
    arr = np.zeros((num_chunks, ROW), dtype=np.int8)
    return arr, memoryview(arr)


def spec(model: str = "test-model", **kw):
    """What a tier reads from vLLM's OffloadingSpec: its normalised config."""
    cfg = make_offloading_config(spec_name="TieringOffloadingSpec", **kw)
    cfg = type(cfg)(**{**cfg.__dict__, "model": type(cfg.model)(name=model, dtype="float16")})
    return types.SimpleNamespace(config=cfg)


def tier(url: str, view: memoryview, *, model: str = "test-model", **opts) -> HiCacheTier:
    return HiCacheTier(offloading_spec=spec(model), primary_kv_view=view, tier_type="HiCacheTier",
                       url=url, **opts)


def keys(*ids: int) -> list[OffloadKey]:
    return [make_offload_key(f"block-{i}".encode(), 0) for i in ids]


def job(job_id: int, ks: list[OffloadKey], chunk_ids: list[int], promotion: bool, req: str = "r") -> TransferJob:
    from vllm.v1.kv_offload.base import ReqContext
    return TransferJob(job_id=job_id, keys=ks, chunk_ids=np.array(chunk_ids, dtype=np.int64),
                       is_promotion=promotion, req_context=ReqContext(req_id=req))


def finish(t: HiCacheTier) -> dict[int, object]:
    """Wait for every job and return the JobResults by job id."""
    t.drain_jobs()
    return {r.job_id: r for r in t.get_finished_jobs()}


def resolve(t: HiCacheTier, key, ctx) -> LookupResult:
    """Drive vLLM's lookup protocol (lookup, end of step) until it stops answering RETRY."""
    for _ in range(500):
        r = t.lookup(key, ctx)
        if r is not LookupResult.RETRY:
            return r
        t.on_schedule_end(ScheduleEndContext(new_req_ids=(), preempted_req_ids=()))
        time.sleep(0.01)
    raise AssertionError(f"lookup of {key!r} still RETRY after 500 steps")
