"""What an engine adapter shows inside its engine: one declaration of the
adapters' counters, one start line, rate-limited warnings. Shared by the SGLang
backend and the vLLM tier.

API (all of it):

* ``AdapterStats``: the counters both adapters keep (lookups, loads, stores,
  bytes, per-operation errors, rejected objects), each a
  ``hicache.core.stats.stat`` field naming its family, help and labels.
* ``SglangStats(AdapterStats)`` and ``PoolCounts``: the SGLang backend's
  extras (pages per host pool: the KV pool and v2 side pools);
  ``VllmTierStats(AdapterStats)`` and ``GroupCounts``: the vLLM tier's
  (lookup answers, jobs, the known-chunk gauge, chunks per KV cache group).
  Declared here in the same style.
* ``Family`` and ``families(cls)``: the Prometheus families a stats class
  declares (name, help, kind, label names); ``series(stats)`` its samples,
  ``flat_series(stats)`` the same as plain data.
* ``Increases(cls)``: what each series gained since the previous call (the
  shape both export channels need: a counter is only ever increased).
* ``adapter_stats(store, **adapter_counts)``: an ``AdapterStats`` from an L3
  backend's counters plus the adapter's own (lookups, skipped stores);
  ``sglang_stats(by_pool)`` the ``SglangStats`` of one per host pool.
* ``AdapterMetrics(engine, registry=None)``: the ``SglangStats`` families as
  ``prometheus_client`` counters on ``registry`` (default: the process
  registry, where the engines' own metrics live); ``update(stats)`` takes an
  ``SglangStats`` or a plain ``AdapterStats``.
* ``start_line(log, engine, url, fingerprint, capacity)``: the INFO line at
  start (URL redacted).
* ``warnings_for(log)``: a ``hicache.core.redact.LogLimiter`` (a few lines per
  kind of warning and minute).

Export channels (each adapter keeps its engine's own; the names, help and
labels come from the declarations here):

* SGLang: ``hicache_adapter_<family>_total{engine="sglang", ...}``, through
  ``AdapterMetrics``. Why prometheus_client counters and not a custom
  collector: SGLang serves ``/metrics`` from its HTTP process through
  ``multiprocess.MultiProcessCollector`` over ``PROMETHEUS_MULTIPROC_DIR``
  (``sglang.srt.utils.common.add_prometheus_middleware``), and the storage
  backend lives in a scheduler process. Only values written by
  prometheus_client's own metric classes reach that directory; a collector
  registered in the scheduler would never be scraped. Without the
  multiprocess directory the same counters sit on the process registry.
* vLLM: ``hicache_vllm_<family>[_total]{hicache_tier=<tier type>, ...}``,
  through vLLM's tier-metric path (``HiCacheTier.build_metric_definitions``
  and ``get_stats``; vLLM adds its own ``engine`` and ``model_name``
  labels, so the SGLang ``engine`` label is not used there). vLLM counts
  chunks: a chunk is one L3 object, which is what "page" means below.
"""
from __future__ import annotations

import dataclasses
import logging
import threading
import typing
import weakref
from typing import Any, Iterator

from hicache.core.errors import IntegrityError
from hicache.core.redact import LogLimiter
from hicache.core.redact import redact_url
from hicache.core.stats import Kind, help_of, metric_of, stat

SGLANG_PREFIX = "hicache_adapter_"
VLLM_PREFIX = "hicache_vllm_"


@dataclasses.dataclass(slots=True)
class AdapterStats:
    """Counters of one adapter since it started (pages unless named otherwise)."""

    lookups: int = stat(default=0, help="pages the engine asked about (is it in L3?)", metric="lookup_pages",
                        labels={"result": "asked"}, family_help="existence lookups of pages (asked), and their "
                        "answers (not verified: loads verify)")
    lookup_hits: int = stat(default=0, help="pages lookups found in L3", metric="lookup_pages", labels={"result": "found"})
    hits: int = stat(default=0, help="pages read from L3 and verified", metric="load_pages", labels={"result": "hit"},
                     family_help="pages read from L3: verified hits, and misses (absent, rejected, L3 down)")
    misses: int = stat(default=0, help="pages not read: absent, rejected or L3 down", metric="load_pages",
                       labels={"result": "miss"})
    stored: int = stat(default=0, help="pages stored in L3", metric="store_pages", labels={"result": "stored"},
                       family_help="pages handed to L3: stored, dropped (L3 down or refused), or skipped "
                       "(already in L3, or another rank writes them)")
    dropped: int = stat(default=0, help="pages L3 did not take", metric="store_pages", labels={"result": "dropped"})
    skipped: int = stat(default=0, help="pages not written by this adapter: known to be in L3 (vLLM) or left to "
                        "the writer rank (SGLang)", metric="store_pages", labels={"result": "skipped"})
    bytes_read: int = stat(default=0, help="payload bytes read", metric="bytes", labels={"op": "read"},
                           family_help="payload bytes moved to and from L3")
    bytes_written: int = stat(default=0, help="payload bytes written", metric="bytes", labels={"op": "write"})
    corrupt: int = stat(default=0, help="objects rejected as corrupt: checksum, framing or MAC (forged or another key)",
                        metric="rejected_objects", labels={"reason": "corrupt"},
                        family_help="objects read but refused (each also a miss)")
    foreign: int = stat(default=0, help="objects of another layout (fingerprint mismatch)", metric="rejected_objects",
                        labels={"reason": "foreign"})
    errors: dict[str, int] = stat("failed L3 calls and items, per operation", metric="errors", key_label="op",
                                  default_factory=dict)


def _pool(help: str, result: str, family_help: str | None = None) -> Any:
    return stat(default=0, help=help, metric="pool_pages", labels={"result": result}, family_help=family_help)


@dataclasses.dataclass(slots=True)
class PoolCounts:
    """Pages of one SGLang host pool: the KV pool (``kv``) or a v2 side pool (``swa``,
    ``mamba``, ...), each its own L3 store."""

    hits: int = _pool("pages of the pool read from L3 and verified", "hit",
                      "pages per SGLang host pool: loaded (hit), not loaded (miss), stored, dropped")
    misses: int = _pool("pages of the pool not read: absent, rejected or L3 down", "miss")
    stored: int = _pool("pages of the pool stored in L3", "stored")
    dropped: int = _pool("pages of the pool L3 did not take", "dropped")


@dataclasses.dataclass(slots=True)
class SglangStats(AdapterStats):
    """``AdapterStats`` of SGLang's ``HiCacheBackend`` (every pool's store summed) plus
    the same figures per host pool."""

    pools: dict[str, PoolCounts] = stat("per SGLang host pool (by pool name)", metric=None, key_label="pool",
                                        default_factory=dict)


def _job(help: str, op: str, result: str) -> Any:
    return stat(default=0, help=help, metric="jobs", labels={"op": op, "result": result},
                family_help="transfer jobs vLLM submitted, and those reported failed")


@dataclasses.dataclass(slots=True)
class GroupCounts:
    """Chunks of one vLLM KV cache group, since the tier was built."""

    stored: int = stat(default=0, help="chunks of the group written to L3", metric="group_pages",
                       labels={"result": "stored"}, family_help="chunks per KV cache group: stored, loaded "
                       "(hit: read, verified, copied into a primary row), not loaded (miss: absent, corrupt, "
                       "foreign, L3 down)")
    loaded: int = stat(default=0, help="chunks of the group loaded", metric="group_pages", labels={"result": "hit"})
    load_missed: int = stat(default=0, help="chunks of the group a load did not find", metric="group_pages",
                            labels={"result": "miss"})


@dataclasses.dataclass(slots=True)
class VllmTierStats(AdapterStats):
    """``AdapterStats`` of vLLM's ``HiCacheTier`` plus its own figures (chunks unless
    named ``jobs``). ``corrupt``, ``foreign`` and ``errors`` are the storage backend's
    counts (the tier is its only user); the rest the tier counts itself."""

    lookup_misses: int = stat(default=0, help="lookups answered MISS", metric="lookup_pages", labels={"result": "miss"})
    lookup_retries: int = stat(default=0, help="lookups answered RETRY (the async L3 probe was still running)",
                               metric="lookup_pages", labels={"result": "retry"})
    store_jobs: int = _job("cascade (store) jobs submitted", "store", "submitted")
    load_jobs: int = _job("promotion (load) jobs submitted", "load", "submitted")
    store_failed_jobs: int = _job("store jobs reported failed: some chunk did not reach L3", "store", "failed")
    load_failed_jobs: int = _job("load jobs reported failed: some chunk was not loaded", "load", "failed")
    jobs_reported: int = stat(default=0, help="job results handed back to vLLM", metric="jobs_reported")
    known_chunks: int = stat(default=0, help="chunks the tier believes L3 holds (an LRU of max_known_chunks)",
                             kind="gauge")
    groups: dict[str, GroupCounts] = stat("per KV cache group (by vLLM group id)", metric=None, key_label="group",
                                          default_factory=dict)

    def check(self, in_flight: int, unreported: int) -> None:
        """The counters are sane and balance. Raises ``IntegrityError``."""
        bad = [f.name for f in dataclasses.fields(self) if isinstance(getattr(self, f.name), int)
               and getattr(self, f.name) < 0]
        if bad:
            raise IntegrityError(f"HiCacheTier: negative counters {bad}: {self}")
        if self.store_jobs + self.load_jobs != self.jobs_reported + in_flight + unreported:
            raise IntegrityError(f"HiCacheTier: {self.store_jobs} store + {self.load_jobs} load jobs != "
                                 f"{self.jobs_reported} reported + {in_flight} in flight + {unreported} "
                                 "finished unreported")
        if self.lookups != self.lookup_hits + self.lookup_misses + self.lookup_retries:
            raise IntegrityError(f"HiCacheTier: lookups={self.lookups} != hits {self.lookup_hits} + misses "
                                 f"{self.lookup_misses} + retries {self.lookup_retries}")


@dataclasses.dataclass(frozen=True, slots=True)
class Family:
    """One Prometheus family a stats class declares (name without the engine's prefix)."""

    name: str
    help: str
    kind: Kind
    labels: tuple[str, ...]  # label names of its series, in order (the engine's own come first)


def _nested(cls: type, f: "dataclasses.Field[Any]") -> type | None:
    """The dataclass a ``dict[str, <dataclass>]`` field holds, else None."""
    args = typing.get_args(typing.get_type_hints(cls)[f.name])
    inner = args[1] if len(args) == 2 else None
    return inner if isinstance(inner, type) and dataclasses.is_dataclass(inner) else None


def families(cls: type) -> dict[str, Family]:
    """Family name -> ``Family``, from ``cls``'s field declarations. Raises
    ``IntegrityError`` when fields sharing a family disagree on its labels or kind."""
    out: dict[str, Family] = {}
    for f in dataclasses.fields(cls):
        inner = _nested(cls, f)
        if inner is not None:
            for fam in families(inner).values():
                _add(out, dataclasses.replace(fam, labels=(f.metadata["key_label"], *fam.labels)))
            continue
        name = metric_of(f)
        if not name:
            raise IntegrityError(f"{cls.__name__}.{f.name} must name its metric family")
        key = (f.metadata["key_label"],) if f.metadata["key_label"] else ()
        doc = f.metadata.get("family_help") or help_of(f)
        _add(out, Family(name, doc, f.metadata["kind"], (*f.metadata["labels"], *key)))
    return out


def _add(out: dict[str, Family], fam: Family) -> None:
    known = out.setdefault(fam.name, fam)
    if (known.labels, known.kind) != (fam.labels, fam.kind):
        raise IntegrityError(f"metric family {fam.name}: fields disagree: {known} != {fam}")


def series(stats: Any) -> Iterator[tuple[str, dict[str, str], float]]:
    """Every sample of ``stats``: (family name, labels, value)."""
    for f in dataclasses.fields(stats):
        value, fixed = getattr(stats, f.name), f.metadata["labels"]
        if not isinstance(value, dict):
            yield metric_of(f) or f.name, dict(fixed), float(value)
            continue
        for key, v in value.items():
            outer = {f.metadata["key_label"]: str(key)}
            if dataclasses.is_dataclass(v):
                for name, labels, x in series(v):
                    yield name, {**outer, **labels}, x
            else:
                yield metric_of(f) or f.name, {**fixed, **outer}, float(v)


def flat_series(stats: Any) -> dict[str, float]:
    """``series(stats)`` as plain data, ``"family,label=value,..."`` -> value (labels
    sorted): what crosses a process boundary to the exporter."""
    return {series_key(name, labels): v for name, labels, v in series(stats)}


def series_key(name: str, labels: dict[str, str]) -> str:
    return ",".join([name, *(f"{k}={v}" for k, v in sorted(labels.items()))])


class Increases:
    """What each series of a stats class gained since the previous ``take``.

    A counter's increase is never negative: a decrease (a store reopened)
    rebases without subtracting. A gauge is reported at its current value.
    Not thread-safe: callers hold their own lock.
    """

    def __init__(self, cls: type):
        self.families = families(cls)
        self._last: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}

    def take(self, stats: Any) -> list[tuple[Family, dict[str, str], float]]:
        """(family, labels, increase or gauge value) of each series that changed. Mutates the baseline."""
        out = []
        for name, labels, value in series(stats):
            fam = self.families.get(name)
            if fam is None:
                raise IntegrityError(f"{type(stats).__name__}: series {name} outside the declared families "
                                     f"{sorted(self.families)}")
            if fam.kind == "gauge":
                out.append((fam, labels, value))
                continue
            key = (name, tuple(sorted(labels.items())))
            delta, self._last[key] = value - self._last.get(key, 0.0), value
            if delta > 0:
                out.append((fam, labels, delta))
        return out

    def check_integrity(self) -> None:
        """Every series seen is a declared family, with its declared labels. Raises ``IntegrityError``."""
        for name, labels in self._last:
            fam = self.families.get(name)
            if fam is None or sorted(fam.labels) != sorted(k for k, _ in labels):
                raise IntegrityError(f"adapter metrics: series {name}{dict(labels)} outside the declared "
                                     f"families: {sorted(self.families)}")


def adapter_stats(store: Any, *, lookups: int = 0, lookup_hits: int = 0, skipped: int = 0) -> AdapterStats:
    """``AdapterStats`` of an L3 ``StorageBackend`` plus the adapter's own counts."""
    s = store.stats()
    return AdapterStats(lookups=lookups, lookup_hits=lookup_hits, hits=s.hits, misses=s.misses,
                        stored=s.put_ok, dropped=s.put_dropped, skipped=skipped, bytes_read=s.bytes_read,
                        bytes_written=s.bytes_written, corrupt=s.corrupt, foreign=s.fingerprint_mismatch,
                        errors=store.errors_by_op())


def sglang_stats(by_pool: dict[str, AdapterStats]) -> SglangStats:
    """``SglangStats`` of a backend over several stores, one per host pool: their
    ``AdapterStats`` added field by field (per-operation errors per operation),
    and each pool's own figures."""
    def add(x: Any, y: Any) -> Any:
        return {k: x.get(k, 0) + y.get(k, 0) for k in {*x, *y}} if isinstance(x, dict) else x + y
    total = AdapterStats()
    for s in by_pool.values():
        total = AdapterStats(**{f.name: add(getattr(total, f.name), getattr(s, f.name))
                                for f in dataclasses.fields(AdapterStats)})
    pools = {name: PoolCounts(hits=s.hits, misses=s.misses, stored=s.stored, dropped=s.dropped)
             for name, s in by_pool.items()}
    return SglangStats(**{f.name: getattr(total, f.name) for f in dataclasses.fields(AdapterStats)}, pools=pools)


# One set of counters per registry: prometheus_client refuses a second family of the
# same name on a registry, and several adapters share one process (TP ranks in tests,
# a storage backend detached and attached again). Keyed weakly by the registry object.
_BY_REGISTRY: "weakref.WeakKeyDictionary[Any, dict[str, Any]]" = weakref.WeakKeyDictionary()
_BY_REGISTRY_LOCK = threading.Lock()


def _counters(registry: Any) -> dict[str, Any]:
    from prometheus_client import Counter
    with _BY_REGISTRY_LOCK:
        made = _BY_REGISTRY.get(registry)
        if made is None:
            made = _BY_REGISTRY[registry] = {
                fam.name: Counter(SGLANG_PREFIX + fam.name, fam.help, labelnames=("engine", *fam.labels),
                                  registry=registry)
                for fam in families(SglangStats).values()}
        return made


class AdapterMetrics:
    """The ``SglangStats`` families (``AdapterStats``'s and the per-pool one) as
    prometheus_client counters labelled ``engine=<engine>`` (SGLang's channel; see
    the module docstring).

    ``update`` is thread-safe and adds only increases (``Increases``).
    """

    def __init__(self, engine: str, registry: Any = None):
        if registry is None:
            from prometheus_client import REGISTRY as registry  # noqa: N811 (the process registry)
        self.engine = engine
        self._counters = _counters(registry)
        self._increases = Increases(SglangStats)
        self._lock = threading.Lock()

    def update(self, stats: AdapterStats) -> None:
        """Add to each series what ``stats`` gained since the previous call. Mutates the counters."""
        with self._lock:
            for fam, labels, delta in self._increases.take(stats):
                self._counters[fam.name].labels(engine=self.engine, **labels).inc(delta)

    def check_integrity(self) -> None:
        """Every series seen is a declared family with its labels. Raises ``IntegrityError``."""
        with self._lock:
            self._increases.check_integrity()


def start_line(log: logging.Logger, engine: str, url: str, fingerprint: str, capacity: str) -> None:
    """The adapter's INFO line at start: where L3 is (secrets redacted), which layout, how much."""
    log.info("hicache %s adapter started: L3 %s, layout fingerprint %s, %s", engine, redact_url(url),
             fingerprint, capacity)


def warnings_for(log: logging.Logger) -> LogLimiter:
    """A rate limiter for the adapter's warnings: 5 lines per kind and minute, then a count."""
    return LogLimiter(log, burst=5, interval_s=60.0)
