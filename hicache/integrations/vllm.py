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

Hybrid models (vLLM's hybrid KV cache manager: gpt-oss's sliding-window and
full-attention groups, Qwen3-Next's Gated DeltaNet and full-attention groups):
vLLM keys a chunk by block hash and group, so one row holds one group's chunk
and is one L3 object, written and verified whole. The hybrid allocator gives
every group the same bytes per block, so every group's row is the primary row;
which chunks of a windowed or recurrent group are stored, and which a hit
loads, vLLM's scheduler decides, one ``lookup`` per (block, group) key: a
prefix hit counts only where every group it needs answers ``HIT``. The
groups are in the fingerprint (``vllm_layout``); the tier refuses a job whose
keys name a group vLLM did not declare, and counts chunks per group
(``group_stats``). See ``hicache/integrations/vllm_groups.py``.

Metrics: ``VllmTierStats`` (``hicache.integrations.metrics``, with the SGLang
backend's counters) declares every figure; vLLM serves them on its
``/metrics`` as ``hicache_vllm_<family>`` through its tier-metric path.

Failure model: the storage backend turns an L3 outage into misses and dropped
writes; a job whose pages did not all move reports ``success=False`` (a
promotion names the keys that did arrive). No exception reaches vLLM from a
transfer.
"""
from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import threading
import time
from collections.abc import Collection, Iterable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any, ClassVar

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import OffloadingConnectorStats
from vllm.logger import init_logger

from vllm.v1.kv_offload.base import (
    Locality,
    LookupResult,
    Medium,
    OffloadingCounterMetadata,
    OffloadingGaugeMetadata,
    OffloadingMetricMetadata,
    OffloadKey,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
)
from vllm.v1.kv_offload.config import OffloadingConfig
from vllm.v1.kv_offload.tiering.async_lookup import AsyncLookupManager
from vllm.v1.kv_offload.tiering.base import JobId, JobResult, SecondaryTierManager, TransferJob

from hicache.core.config import StorageConfig
from hicache.core.errors import ConfigError, IntegrityError
from hicache.integrations.known import KnownSet
from hicache.integrations.metrics import VLLM_PREFIX, GroupCounts, Increases, VllmTierStats, families
from hicache.integrations.vllm_groups import GroupLedger, KVGroup, kv_groups
from hicache.core.layout import MAX_MODEL_ID_CHARS, KVLayout
from hicache.core.redact import LogLimiter
from hicache.storage import StorageBackend, open_storage
from hicache.storage.into import wipe_unloaded
from hicache.core.redact import redact_url
from hicache.core.types import PageHash

# Under vLLM's "vllm" logger: its handler and level (VLLM_LOGGING_LEVEL, INFO by
# default) apply, so the start line appears in a vLLM process without any setup.
log = init_logger("vllm.hicache")

__all__ = ["HiCacheTier", "page_hash", "vllm_layout", "DEFAULT_MAX_KNOWN_CHUNKS"]

# Chunks the tier remembers as stored in L3 (an LRU). An entry costs ~200 bytes
# (key, ordered-dict node), so the default bounds it near 20 MB; at a 2 MiB row
# (Llama-3.1-8B, block 16) it covers 200 GiB of L3. Beyond it, lookups of
# forgotten chunks go to L3 (probe_l3) or miss.
DEFAULT_MAX_KNOWN_CHUNKS = 100_000


def vllm_layout(config: OffloadingConfig, row_bytes: int) -> KVLayout:
    """The ``KVLayout`` of one primary-tier row, from what vLLM tells a tier.

    A row is opaque bytes to hicache: a ``kind="rows"`` layout, one page per
    chunk of ``row_bytes``. Everything vLLM says about the bytes (model, KV
    dtype, groups and layers, block and chunk sizes, parallelism, host layout)
    is the layout's ``engine_layout``, hence in the fingerprint: two
    deployments that differ in any of these never read each other's objects.
    The service (``hicache+unix://``) must be started with this layout
    (``HiCacheTier.layout``; the tier's start line shows its fingerprint).
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
    }
    model_id = f"vllm:{config.model.name}"[:MAX_MODEL_ID_CHARS]  # the full name is in engine_layout
    return KVLayout.rows(model_id, row_bytes, facts, host_layout="page_first")


def _log_through_vllm() -> None:
    """Send hicache's own loggers (storage outages, corrupt objects) to vLLM's handler
    and level too, unless the user configured the ``hicache`` logger: in a vLLM
    process nothing else would show them in vLLM's format, or at all below WARNING."""
    ours, theirs = logging.getLogger("hicache"), logging.getLogger("vllm")
    if ours.handlers or not theirs.handlers:
        return
    for h in theirs.handlers:
        ours.addHandler(h)
    ours.setLevel(theirs.level)
    ours.propagate = False


def _auth_key(auth_key: str, auth_key_file: str) -> bytes:
    """The tier's MAC secret: its extra config's ``auth_key`` / ``auth_key_file``, else the
    environment's ``HICACHE_STORAGE__AUTH_KEY`` / ``..._FILE`` (as the core's ``storage.auth_key``)."""
    if not (auth_key or auth_key_file):
        auth_key = os.environ.get("HICACHE_STORAGE__AUTH_KEY", "")
        auth_key_file = os.environ.get("HICACHE_STORAGE__AUTH_KEY_FILE", "")
    for name, v in (("auth_key", auth_key), ("auth_key_file", auth_key_file)):
        if not isinstance(v, str):
            raise ConfigError(f"HiCacheTier {name}: must be a string, got {type(v).__name__}")
    return StorageConfig(auth_key=auth_key, auth_key_file=auth_key_file).resolved_auth_key()


def page_hash(key: OffloadKey) -> PageHash:
    """hicache's 16-byte L3 key for vLLM's ``OffloadKey`` (block hash + group index)."""
    return PageHash(hashlib.blake2b(key, digest_size=16).digest())


TIER_METRIC_LABEL = "hicache_tier"  # the tier_type of the series (several HiCacheTiers may be configured)


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
    ``RETRY``), ``max_known_chunks`` (the LRU of chunks this tier believes L3
    holds; default ``DEFAULT_MAX_KNOWN_CHUNKS``), ``auth_key`` /
    ``auth_key_file`` (as ``storage.auth_key``: objects carry a MAC and
    objects without a valid one are misses; default: the environment's
    ``HICACHE_STORAGE__AUTH_KEY`` / ``HICACHE_STORAGE__AUTH_KEY_FILE``),
    ``locality`` (``"LOCAL"`` / ``"REMOTE"``, vLLM's tier filter).
    """

    medium: ClassVar[Medium] = Medium.STORAGE

    def __init__(self, offloading_spec: Any, primary_kv_view: memoryview, tier_type: str, url: str,
                 key_prefix: str = "", timeout_ms: int = 50, max_retries: int = 2, io_threads: int = 2,
                 probe_l3: bool = True, max_known_chunks: int = DEFAULT_MAX_KNOWN_CHUNKS,
                 auth_key: str = "", auth_key_file: str = "", locality: str | None = None,
                 backpressure_detector: Any = None):
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        _log_through_vllm()
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
        self.groups: tuple[KVGroup, ...] = kv_groups(offloading_spec.config)
        self._groups = GroupLedger(self.groups)  # per-group chunk counts
        self.url = url
        key = _auth_key(auth_key, auth_key_file)
        self.storage: StorageBackend = open_storage(url, fingerprint=self.fingerprint, timeout_ms=timeout_ms,
                                                    max_retries=max_retries, key_prefix=key_prefix,
                                                    layout=self.layout, auth_key=key)
        self._sizes = [self._row_bytes]
        self._lock = threading.Lock()  # guards _finished, _stats, _reported, _groups, _known and _in_flight (pool threads write)
        self._finished: list[JobResult] = []
        self._in_flight: dict[JobId, Future] = {}
        self._stats = VllmTierStats()  # what the tier counts itself (stats() adds the backend's and the gauges)
        self._reported = Increases(VllmTierStats)  # what get_stats() has handed to vLLM's metrics so far
        # Chunks this tier believes L3 holds (stored or loaded by it), an LRU: a
        # load that misses removes the chunk, and Redis may evict any of them.
        self._known = KnownSet(max_known_chunks)
        self._misses_to_mark: list[OffloadKey] = []  # failed loads, for the scheduler-side probe state
        self._pool = ThreadPoolExecutor(io_threads, thread_name_prefix="hicache-vllm")
        self._lookup = _L3Lookup(self) if probe_l3 else None
        self._warn = LogLimiter(log)  # per-job warnings: a few lines per kind and minute
        view = primary_kv_view
        log.info("HiCacheTier %s started: L3 %s, fingerprint %s (%s), %d-byte rows, vLLM CPU tier %d rows "
                 "= %.2f GiB, KV cache groups [%s], known-chunk cap %d, probe_l3 %s, MAC %s", tier_type,
                 redact_url(url), self.fingerprint, self.layout.model_id, self._row_bytes, view.shape[0],
                 view.shape[0] * self.block_size_bytes / 2**30, "; ".join(g.describe() for g in self.groups),
                 max_known_chunks, probe_l3, "on" if key else "off")

    # ------------------------------------------------------------ scheduler side
    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        """HIT when the tier knows L3 holds ``key``; else the async probe's answer,
        ``RETRY`` while it runs (``MISS`` at once when ``probe_l3`` is off). Non-blocking."""
        with self._lock:
            known = self._known.touch(key)
        if known:
            result = LookupResult.HIT
        elif self._lookup is None:
            result = LookupResult.MISS
        else:
            found = self._lookup.lookup(key, req_context)
            result = LookupResult.RETRY if found is None else LookupResult.HIT if found else LookupResult.MISS
        with self._lock:
            s = self._stats
            s.lookups += 1
            if result is LookupResult.HIT:
                s.lookup_hits += 1
            elif result is LookupResult.MISS:
                s.lookup_misses += 1
            else:
                s.lookup_retries += 1
        return result

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

    @classmethod
    def build_metric_definitions(cls, extra_config: dict[str, Any]) -> dict[str, OffloadingMetricMetadata]:
        """vLLM registers these on its own Prometheus registry (the one its ``/metrics``
        serves): ``hicache_vllm_<family>`` for each family ``VllmTierStats`` declares,
        with its help and labels, plus the tier's type (``hicache_tier``)."""
        meta = {"counter": OffloadingCounterMetadata, "gauge": OffloadingGaugeMetadata}
        return {VLLM_PREFIX + fam.name: meta[fam.kind](documentation=fam.help,
                                                       labelnames=(TIER_METRIC_LABEL, *fam.labels))
                for fam in families(VllmTierStats).values()}

    def get_stats(self) -> OffloadingConnectorStats | None:
        """The counters' increase since the previous call and the gauges' values, in
        vLLM's metric payload (vLLM's manager calls this once per scheduler step and
        ships it to /metrics)."""
        now = self.stats()
        with self._lock:
            moved = self._reported.take(now)
        out = OffloadingConnectorStats()
        for fam, labels, value in moved:
            values = (self.tier_type, *(labels[n] for n in fam.labels))
            if fam.kind == "gauge":
                out.set_gauge(VLLM_PREFIX + fam.name, value, values)
            else:
                out.increase_counter(VLLM_PREFIX + fam.name, value, values)
        return out

    def stats(self) -> VllmTierStats:
        """A snapshot copy of the counters: the tier's own, the storage backend's
        rejections and per-operation errors, the known-chunk gauge and the per-group counts."""
        st, errors = self.storage.stats(), self.storage.errors_by_op()
        with self._lock:
            out = dataclasses.replace(self._stats)
            out.known_chunks = len(self._known)
            out.groups = {str(g): c for g, c in self._groups.snapshot().items()}
        out.corrupt, out.foreign, out.errors = st.corrupt, st.fingerprint_mismatch, errors
        return out

    def group_stats(self) -> dict[int, GroupCounts]:
        """A snapshot of the chunks stored, loaded and missed per KV cache group (by group id)."""
        with self._lock:
            return self._groups.snapshot()

    def known_chunks(self) -> int:
        with self._lock:
            return len(self._known)

    def check_integrity(self) -> None:
        """Job and lookup accounting balance, counters are sane, the per-group counts add
        up to them, the known-chunk set is within its cap, every series reported to vLLM
        is a declared family, and the storage backend's own check passes (where it can
        list its objects, every one verifies). Raises ``IntegrityError``."""
        with self._lock:
            in_flight = sum(not f.done() for f in self._in_flight.values())
            done_unlisted = [j for j, f in self._in_flight.items() if f.done()]
            stats, unreported = dataclasses.replace(self._stats), len(self._finished)
            self._known.check_integrity()
            self._reported.check_integrity()  # every series handed to vLLM is a declared family
            self._groups.check(stats.stored, stats.hits, stats.misses)
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
            self._groups.check_keys(job.job_id, keys)
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
        load = run == self._run_load
        with self._lock:
            if not result.success:
                if load:
                    self._stats.load_failed_jobs += 1
                else:
                    self._stats.store_failed_jobs += 1
            self._finished.append(result)
            del self._in_flight[job_id]
        if not result.success:
            op = "load" if load else "store"
            self._warn.log(logging.WARNING, op, "HiCacheTier %s: a %s job of %d chunks did not fully succeed "
                           "(L3 %s; hicache_vllm_* metrics count every chunk; further lines rate-limited)",
                           self.tier_type, op, len(keys), redact_url(self.url))

    def _run_store(self, job_id: JobId, keys: list[OffloadKey], chunk_ids: list[int]) -> JobResult:
        with self._lock:
            todo = [(k, c) for k, c in zip(keys, chunk_ids) if not self._known.touch(k)]
        hashes = [page_hash(k) for k, _ in todo]
        stored = self.storage.put([(h, self._row(c), self._sizes) for h, (_, c) in zip(hashes, todo)])
        if stored == len(todo):
            landed = [k for k, _ in todo]
        else:  # partial: ask which ones L3 took (all False while it is down)
            landed = [k for (k, _), ok in zip(todo, self.storage.exists(hashes)) if ok]
        with self._lock:
            self._known.add(landed)
            self._groups.stored(landed)
            s = self._stats
            s.stored += len(landed)
            s.dropped += len(todo) - len(landed)
            s.skipped += len(keys) - len(todo)
            s.bytes_written += len(landed) * self._row_bytes
        nbytes = len(landed) * self._row_bytes
        return JobResult(job_id=job_id, success=len(landed) == len(todo), transfer_bytes=nbytes)

    def _run_load(self, job_id: JobId, keys: list[OffloadKey], chunk_ids: list[int]) -> JobResult:
        # Straight into the rows, verified there. A missed chunk's row is zeroed (a
        # refused object's bytes never stay) and reported unsuccessful.
        rows = [self._row(c) for c in chunk_ids]
        loaded = self.storage.get_into([page_hash(k) for k in keys], self._sizes, rows)
        wipe_unloaded(self.storage.DIRECT_IO, rows, loaded)
        ok = [k for k, hit in zip(keys, loaded) if hit]
        missed = [k for k, hit in zip(keys, loaded) if not hit]
        with self._lock:
            self._known.add(ok)
            self._known.discard(missed)
            self._groups.loaded(ok, missed)
            s = self._stats
            s.hits += len(ok)
            s.misses += len(missed)
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
