"""``HiCacheTier``: a vLLM secondary offload tier that keeps chunks in any hicache L3.

vLLM (pinned 0.33.0) loads it from configuration, as any out-of-tree tier::

    kv_connector="OffloadingConnector"
    kv_connector_extra_config={"spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": N,
        "secondary_tiers": [{"type": "HiCacheTier", "module_path": "hicache.integrations.vllm",
                             "url": "redis://127.0.0.1:6379/0"}]}

vLLM's CPU tier is the primary; this tier stores ``primary_kv_view[chunk_id]``
rows (cascade) and loads them back into primary slots (promotion) through
``hicache.storage``: ``file://``, ``memory://``, ``redis://``,
``redis+cluster://`` or ``hicache+unix://`` (the node-local service). Every
object carries hicache's header: the fingerprint of the layout vLLM describes
to the tier (``vllm_layout``) and an xxh3 checksum, both verified on every
read; a corrupt or foreign object is a miss, never bytes in vLLM's cache.

Threads: vLLM calls every method under its manager lock on the scheduler
thread (or its tier-poll thread); nothing here waits on L3 there. Transfers
run on a small pool; existence probes for chunks this process has not seen
run on vLLM's own ``AsyncLookupManager`` thread. The pool threads touch only
the primary rows of their job (pinned by vLLM for the job's lifetime), the
storage backend (thread-safe) and the finished-job list (behind ``_lock``).

Failure model: the storage backend turns an L3 outage into misses and dropped
writes; a job whose pages did not all move reports ``success=False`` (a
promotion names the keys that did arrive). No exception reaches vLLM from a
transfer.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import threading
import time
from collections.abc import Collection, Iterable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any, ClassVar

from vllm.v1.kv_offload.base import (
    Locality,
    LookupResult,
    Medium,
    OffloadKey,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
)
from vllm.v1.kv_offload.config import OffloadingConfig
from vllm.v1.kv_offload.tiering.async_lookup import AsyncLookupManager
from vllm.v1.kv_offload.tiering.base import JobId, JobResult, SecondaryTierManager, TransferJob

from hicache.errors import ConfigError, IntegrityError
from hicache.layout import KVLayout
from hicache.storage import StorageBackend, open_storage
from hicache.storage.base import redact_url
from hicache.types import PageHash

log = logging.getLogger(__name__)

__all__ = ["HiCacheTier", "TierStats", "page_hash", "vllm_layout"]


def vllm_layout(config: OffloadingConfig, row_bytes: int) -> KVLayout:
    """The ``KVLayout`` of one primary-tier row, from what vLLM tells a tier.

    A row is opaque bytes to hicache, so the layout is one ``uint8`` plane of
    ``row_bytes`` per "page" (one chunk); everything vLLM says about the bytes
    (model, KV dtype, groups and layers, block and chunk sizes, parallelism,
    host layout) goes into ``model_id`` through a digest, hence into the
    fingerprint. Two deployments that differ in any of these never read each
    other's objects. The service (``hicache+unix://``) must be started with
    this layout (``HiCacheTier.layout`` / the tier's log line show it).
    """
    if not isinstance(config, OffloadingConfig):
        raise ConfigError(f"HiCacheTier needs vLLM's OffloadingConfig (offloading_spec.config), "
                          f"got {type(config).__name__}")
    if not isinstance(row_bytes, int) or row_bytes < 1:
        raise ConfigError(f"HiCacheTier: primary row of {row_bytes!r} bytes; expected >= 1")
    p = config.parallel
    facts = {
        "engine": "vllm",
        "model": config.model.name,
        "kv_dtype": str(config.model.dtype),
        "groups": [[g.tokens_per_block, list(g.layer_names), g.group_id, g.sliding_window_size_in_chunks]
                   for g in config.groups],
        "worker_kv_bytes_per_block": config.worker_kv_bytes_per_block,
        "tokens_per_hash": config.cache.tokens_per_hash,
        "blocks_per_chunk": config.cache.blocks_per_chunk,
        "parallel": [p.world_size, p.tp_size, p.pp_size, p.pcp_size, p.dcp_size],
        "replicated_layout": config.replicated_layout,
        "canonical_layout": config.canonical_layout,
        "kv_cache_layout": config.kv_cache_layout,
        "row_bytes": row_bytes,
    }
    digest = hashlib.blake2b(json.dumps(facts, sort_keys=True).encode(), digest_size=8).hexdigest()
    return KVLayout(model_id=f"vllm:{config.model.name}:{digest}", num_layers=1, kind="mla",
                    kv_lora_rank=row_bytes, dtype="uint8", page_size=1, host_layout="page_first")


def page_hash(key: OffloadKey) -> PageHash:
    """hicache's 16-byte L3 key for vLLM's ``OffloadKey`` (block hash + group index)."""
    return PageHash(hashlib.blake2b(key, digest_size=16).digest())


@dataclasses.dataclass(slots=True)
class TierStats:
    """Counters since the tier was built (chunks, not jobs, unless named ``jobs``)."""

    store_jobs: int = 0  # submit_store calls
    load_jobs: int = 0  # submit_load calls
    jobs_reported: int = 0  # JobResults handed to vLLM
    stored: int = 0  # chunks written to L3
    store_skipped: int = 0  # chunks already in L3 (known), not rewritten
    store_failed: int = 0  # chunks L3 did not take (outage, per-item error)
    loaded: int = 0  # chunks read, verified and copied into primary rows
    load_missed: int = 0  # chunks absent, corrupt, foreign, or L3 down
    bytes_written: int = 0
    bytes_read: int = 0

    def check(self, in_flight: int, unreported: int) -> None:
        bad = [f.name for f in dataclasses.fields(self) if getattr(self, f.name) < 0]
        if bad:
            raise IntegrityError(f"HiCacheTier: negative counters {bad}: {self}")
        if self.store_jobs + self.load_jobs != self.jobs_reported + in_flight + unreported:
            raise IntegrityError(f"HiCacheTier: {self.store_jobs} store + {self.load_jobs} load jobs != "
                                 f"{self.jobs_reported} reported + {in_flight} in flight + {unreported} "
                                 "finished unreported")


class _L3Lookup(AsyncLookupManager):
    """vLLM's per-tier async lookup, asking L3 which chunks it holds (not verified: loads verify)."""

    def __init__(self, tier: "HiCacheTier"):
        self._tier = tier
        super().__init__(tier_type=tier.tier_type)

    def batch_lookup(self, keys: list[OffloadKey], req_context: ReqContext) -> Iterable[bool]:
        return self._tier.storage.exists([page_hash(k) for k in keys])


class HiCacheTier(SecondaryTierManager):
    """vLLM ``SecondaryTierManager`` over a hicache L3 URL. See the module docstring.

    Extra config (``secondary_tiers`` entry keys, passed by vLLM's factory):
    ``url`` (required), ``key_prefix`` (default: hicache's per-fingerprint
    prefix), ``timeout_ms`` / ``max_retries`` (one L3 call), ``io_threads``
    (transfer pool), ``probe_l3`` (default True: chunks this process has not
    stored are looked up in L3 asynchronously, answering ``RETRY`` until the
    probe returns, so pages written by other instances or before a restart
    are found; False: answer only from this process's own stores, never
    ``RETRY``), ``locality`` (``"LOCAL"`` / ``"REMOTE"``, vLLM's tier filter).
    """

    medium: ClassVar[Medium] = Medium.STORAGE

    def __init__(self, offloading_spec: Any, primary_kv_view: memoryview, tier_type: str, url: str,
                 key_prefix: str = "", timeout_ms: int = 50, max_retries: int = 2, io_threads: int = 2,
                 probe_l3: bool = True, locality: str | None = None, backpressure_detector: Any = None):
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        self.locality = Locality(locality) if locality is not None else None
        if primary_kv_view.ndim != 2:
            raise ConfigError(f"HiCacheTier: primary_kv_view has shape {primary_kv_view.shape}; "
                              "expected (num_chunks, row_bytes)")
        if not isinstance(io_threads, int) or io_threads < 1:
            raise ConfigError(f"HiCacheTier io_threads={io_threads!r}: must be an integer >= 1")
        if not primary_kv_view.c_contiguous:
            raise ConfigError("HiCacheTier: primary_kv_view must be C-contiguous (vLLM's CPU tier is)")
        self._row_bytes = primary_kv_view.shape[1] * primary_kv_view.itemsize
        self._flat = primary_kv_view.cast("B")  # row c = _flat[c * stride : c * stride + _row_bytes]
        self.layout = vllm_layout(offloading_spec.config, self._row_bytes)
        self.fingerprint = self.layout.fingerprint()
        self.url = url
        self.storage: StorageBackend = open_storage(url, fingerprint=self.fingerprint, timeout_ms=timeout_ms,
                                                    max_retries=max_retries, key_prefix=key_prefix,
                                                    layout=self.layout)
        self._sizes = [self._row_bytes]
        self._lock = threading.Lock()  # guards _finished, _stats and _in_flight (pool threads write them)
        self._finished: list[JobResult] = []
        self._in_flight: dict[JobId, Future] = {}
        self._stats = TierStats()
        # Chunks this tier knows L3 holds (stored or loaded by it); pool threads update it.
        self._present: set[OffloadKey] = set()
        self._misses_to_mark: list[OffloadKey] = []  # failed loads, for the scheduler-side probe state
        self._pool = ThreadPoolExecutor(io_threads, thread_name_prefix="hicache-vllm")
        self._lookup = _L3Lookup(self) if probe_l3 else None
        log.info("HiCacheTier %s: L3 %s, layout %s (fingerprint %s, %d-byte rows)", tier_type,
                 redact_url(url), self.layout.model_id, self.fingerprint, self._row_bytes)

    # ------------------------------------------------------------ scheduler side
    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        """HIT when the tier knows L3 holds ``key``; else the async probe's answer,
        ``RETRY`` while it runs (``MISS`` at once when ``probe_l3`` is off). Non-blocking."""
        with self._lock:
            if key in self._present:
                return LookupResult.HIT
        if self._lookup is None:
            return LookupResult.MISS
        found = self._lookup.lookup(key, req_context)
        if found is None:
            return LookupResult.RETRY
        return LookupResult.HIT if found else LookupResult.MISS

    def submit_store(self, job_metadata: TransferJob) -> None:
        """Queue a cascade of primary rows to L3; returns at once."""
        self._submit(job_metadata, self._run_store)

    def submit_load(self, job_metadata: TransferJob) -> None:
        """Queue a promotion from L3 into primary rows; returns at once."""
        self._submit(job_metadata, self._run_load)

    def get_finished_jobs(self) -> Iterable[JobResult]:
        """Jobs finished since the last call; a failed promotion names the keys that arrived."""
        with self._lock:
            done, self._finished = self._finished, []
            misses, self._misses_to_mark = self._misses_to_mark, []
            self._stats.jobs_reported += len(done)
        if misses and self._lookup is not None:
            self._lookup.mark_miss(misses)
        return done

    def drain_jobs(self) -> None:
        """Block until every submitted job has finished (results stay queued for get_finished_jobs)."""
        with self._lock:
            futures = list(self._in_flight.values())
        wait(futures)

    def has_pending_work(self) -> bool:
        with self._lock:
            return bool(self._in_flight or self._finished)

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def on_request_finished(self, req_context: ReqContext) -> None:
        if self._lookup is not None:
            self._lookup.cleanup(req_context.req_id)

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        if self._lookup is not None:
            self._lookup.flush()

    def shutdown(self) -> None:
        """Finish queued transfers, stop the threads, close L3. Idempotent."""
        self._pool.shutdown(wait=True)
        self._flat.release()  # our view of vLLM's region: vLLM unmaps it at its own shutdown
        if self._lookup is not None:
            self._lookup.shutdown()
            self._lookup = None
        self.storage.close()

    @classmethod
    def config_info_keys(cls, tier_config: dict[str, Any]) -> tuple[str, ...]:
        return ("hicache_url", "hicache_fingerprint")

    def config_info(self) -> dict[str, str]:
        return {"hicache_url": redact_url(self.url), "hicache_fingerprint": self.fingerprint}

    def stats(self) -> TierStats:
        """A snapshot copy of the counters."""
        with self._lock:
            return dataclasses.replace(self._stats)

    def check_integrity(self) -> None:
        """Job accounting balances, counters are sane, and the storage backend's own
        check passes (where it can list its objects, every one verifies). Raises ``IntegrityError``."""
        with self._lock:
            in_flight = sum(not f.done() for f in self._in_flight.values())
            done_unlisted = [j for j, f in self._in_flight.items() if f.done()]
            stats, unreported = dataclasses.replace(self._stats), len(self._finished)
        if done_unlisted:
            raise IntegrityError(f"HiCacheTier: jobs {done_unlisted[:5]} finished but still listed in flight")
        stats.check(in_flight, unreported)
        self.storage.check_integrity()

    # ------------------------------------------------------------ pool side
    def _submit(self, job: TransferJob, run) -> None:
        keys = list(job.keys)
        if len(keys) != len(job.chunk_ids):
            raise ValueError(f"HiCacheTier job {job.job_id}: {len(keys)} keys but {len(job.chunk_ids)} chunk ids")
        chunk_ids = [int(c) for c in job.chunk_ids]
        with self._lock:
            if job.is_promotion:
                self._stats.load_jobs += 1
            else:
                self._stats.store_jobs += 1
            self._in_flight[job.job_id] = self._pool.submit(self._guarded, run, job.job_id, keys, chunk_ids)

    def _row(self, chunk_id: int) -> memoryview:
        start = chunk_id * self.block_size_bytes
        return self._flat[start:start + self._row_bytes]

    def _guarded(self, run, job_id: JobId, keys: list[OffloadKey], chunk_ids: list[int]) -> None:
        """Run one job; whatever happens, exactly one JobResult is queued for it."""
        t0 = time.monotonic()
        try:
            result = run(job_id, keys, chunk_ids)
        except Exception:  # noqa: BLE001 - a transfer must never raise into vLLM; the job fails
            log.exception("HiCacheTier: job %d (%d chunks) failed", job_id, len(keys))
            result = JobResult(job_id=job_id, success=False)
        result.transfer_time = time.monotonic() - t0
        with self._lock:
            self._finished.append(result)
            del self._in_flight[job_id]

    def _run_store(self, job_id: JobId, keys: list[OffloadKey], chunk_ids: list[int]) -> JobResult:
        with self._lock:
            todo = [(k, c) for k, c in zip(keys, chunk_ids) if k not in self._present]
        hashes = [page_hash(k) for k, _ in todo]
        stored = self.storage.put([(h, self._row(c), self._sizes) for h, (_, c) in zip(hashes, todo)])
        if stored == len(todo):
            landed = [k for k, _ in todo]
        else:  # partial: ask which ones L3 took (all False while it is down)
            landed = [k for (k, _), ok in zip(todo, self.storage.exists(hashes)) if ok]
        with self._lock:
            self._present.update(landed)
            s = self._stats
            s.stored += len(landed)
            s.store_failed += len(todo) - len(landed)
            s.store_skipped += len(keys) - len(todo)
            s.bytes_written += len(landed) * self._row_bytes
        nbytes = len(landed) * self._row_bytes
        return JobResult(job_id=job_id, success=len(landed) == len(todo), transfer_bytes=nbytes)

    def _run_load(self, job_id: JobId, keys: list[OffloadKey], chunk_ids: list[int]) -> JobResult:
        payloads = self.storage.get([page_hash(k) for k in keys], self._sizes)
        ok: list[OffloadKey] = []
        missed: list[OffloadKey] = []
        for key, cid, payload in zip(keys, chunk_ids, payloads):
            if payload is None:
                missed.append(key)
                continue
            self._row(cid)[:] = payload
            ok.append(key)
        with self._lock:
            self._present.update(ok)
            self._present.difference_update(missed)
            s = self._stats
            s.loaded += len(ok)
            s.load_missed += len(missed)
            s.bytes_read += len(ok) * self._row_bytes
        if missed and self._lookup is not None:
            # vLLM's hook for a failed load: the cached probe verdict turns into a
            # miss so the scheduler stops re-issuing a doomed promotion. It runs on
            # the scheduler's lookup state, so defer it to the scheduler thread.
            self._pending_miss(missed)
        if not missed:
            return JobResult(job_id=job_id, success=True, transfer_bytes=len(ok) * self._row_bytes)
        return JobResult(job_id=job_id, success=False, successful_keys=tuple(ok) or None,
                         transfer_bytes=len(ok) * self._row_bytes)

    def _pending_miss(self, keys: Collection[OffloadKey]) -> None:
        with self._lock:
            self._misses_to_mark.extend(keys)
