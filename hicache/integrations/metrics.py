"""What an engine adapter shows inside its engine: one metric set, one start line,
rate-limited warnings. Shared by the SGLang backend and the vLLM tier.

API (all of it):

* ``AdapterStats``: the adapter's counters, each declared once (a
  ``hicache.stat_schema.stat`` field: help, family, labels). The Prometheus
  families are derived from it; nothing else lists them.
* ``adapter_stats(store, **adapter_counts)``: an ``AdapterStats`` from an L3
  backend's counters plus the adapter's own (lookups, skipped stores).
* ``AdapterMetrics(engine, registry=None)``: the families as
  ``prometheus_client`` counters on ``registry`` (default: the process
  registry, where the engines' own metrics live); ``update(stats)`` adds what
  changed since the last update.
* ``start_line(log, engine, url, fingerprint, capacity)``: the INFO line at
  start (URL redacted).
* ``warnings_for(log)``: a ``hicache.ratelimit.LogLimiter`` (a few lines per
  kind of warning and minute).

Why prometheus_client counters and not a custom collector: SGLang serves
``/metrics`` from its HTTP process through ``multiprocess.MultiProcessCollector``
over ``PROMETHEUS_MULTIPROC_DIR`` (``sglang.srt.utils.common.
add_prometheus_middleware``), and the storage backend lives in a scheduler
process. Only values written by prometheus_client's own metric classes reach
that directory; a collector registered in the scheduler would never be
scraped. Without the multiprocess directory the same counters sit on the
process registry, which is what a single-process engine serves.

Names: ``hicache_adapter_<family>_total``, labels ``engine`` plus the field's
fixed labels (``result``, ``op``, ``reason``).
"""
from __future__ import annotations

import dataclasses
import logging
import threading
import weakref
from typing import Any, Iterator

from hicache.errors import IntegrityError
from hicache.ratelimit import LogLimiter
from hicache.redact import redact_url
from hicache.stat_schema import help_of, metric_of, stat

PREFIX = "hicache_adapter_"


@dataclasses.dataclass(slots=True)
class AdapterStats:
    """Counters of one adapter since it started (pages unless named otherwise)."""

    lookups: int = stat(default=0, help="pages asked of L3 by existence lookups", metric="lookup_pages",
                        labels={"result": "asked"}, family_help="pages asked of L3 by existence lookups, "
                        "and those found")
    lookup_hits: int = stat(default=0, help="pages lookups found in L3", metric="lookup_pages", labels={"result": "found"})
    hits: int = stat(default=0, help="pages read from L3 and verified", metric="load_pages", labels={"result": "hit"},
                     family_help="pages read from L3: verified hits, and misses (absent, rejected, L3 down)")
    misses: int = stat(default=0, help="pages not read: absent, rejected or L3 down", metric="load_pages",
                       labels={"result": "miss"})
    stored: int = stat(default=0, help="pages stored in L3", metric="store_pages", labels={"result": "stored"},
                       family_help="pages handed to L3: stored, dropped (L3 down or refused), or skipped "
                       "(another rank writes them)")
    dropped: int = stat(default=0, help="pages L3 did not take", metric="store_pages", labels={"result": "dropped"})
    skipped: int = stat(default=0, help="pages left to the writer rank", metric="store_pages", labels={"result": "skipped"})
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


def adapter_stats(store: Any, *, lookups: int = 0, lookup_hits: int = 0, skipped: int = 0) -> AdapterStats:
    """``AdapterStats`` of an L3 ``StorageBackend`` plus the adapter's own counts."""
    s = store.stats()
    return AdapterStats(lookups=lookups, lookup_hits=lookup_hits, hits=s.hits, misses=s.misses,
                        stored=s.put_ok, dropped=s.put_dropped, skipped=skipped, bytes_read=s.bytes_read,
                        bytes_written=s.bytes_written, corrupt=s.corrupt, foreign=s.fingerprint_mismatch,
                        errors=store.errors_by_op())


def _families() -> dict[str, tuple[str, tuple[str, ...]]]:
    """Family name -> (help, label names), from the ``AdapterStats`` declarations."""
    out: dict[str, tuple[str, tuple[str, ...]]] = {}
    for f in dataclasses.fields(AdapterStats):
        name = metric_of(f)
        if not name:
            raise IntegrityError(f"AdapterStats.{f.name} must name its metric family")
        labels = ("engine", *f.metadata["labels"], *((f.metadata["key_label"],) if f.metadata["key_label"] else ()))
        doc = f.metadata.get("family_help") or help_of(f)
        known = out.setdefault(name, (doc, labels))
        if known[1] != labels:
            raise IntegrityError(f"metric family {name}: fields disagree on labels {known[1]} != {labels}")
    return out


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
                name: Counter(PREFIX + name, doc, labelnames=labels, registry=registry)
                for name, (doc, labels) in _families().items()}
        return made


class AdapterMetrics:
    """The ``AdapterStats`` families as counters labelled ``engine=<engine>``.

    ``update`` is thread-safe and adds only increases (a counter never goes
    down; a decrease, e.g. a store reopened, rebases without subtracting).
    """

    def __init__(self, engine: str, registry: Any = None):
        if registry is None:
            from prometheus_client import REGISTRY as registry  # noqa: N811 (the process registry)
        self.engine = engine
        self._counters = _counters(registry)
        self._last: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
        self._lock = threading.Lock()

    def update(self, stats: AdapterStats) -> None:
        """Add to each series what ``stats`` gained since the previous call. Mutates the counters."""
        with self._lock:
            for name, labels, value in _series(stats):
                key = (name, tuple(sorted(labels.items())))
                delta = value - self._last.get(key, 0)
                self._last[key] = value
                if delta > 0:
                    self._counters[name].labels(engine=self.engine, **labels).inc(delta)

    def check_integrity(self) -> None:
        """Every series seen is a declared family. Raises ``IntegrityError``."""
        with self._lock:
            unknown = {name for name, _ in self._last} - set(self._counters)
        if unknown:
            raise IntegrityError(f"adapter metrics: series outside the declared families: {sorted(unknown)}")


def _series(stats: AdapterStats) -> Iterator[tuple[str, dict[str, str], float]]:
    for f in dataclasses.fields(stats):
        value, name, fixed = getattr(stats, f.name), metric_of(f) or f.name, f.metadata["labels"]
        if isinstance(value, dict):
            for key, v in value.items():
                yield name, {**fixed, f.metadata["key_label"]: str(key)}, float(v)
        else:
            yield name, dict(fixed), float(value)


def start_line(log: logging.Logger, engine: str, url: str, fingerprint: str, capacity: str) -> None:
    """The adapter's INFO line at start: where L3 is (secrets redacted), which layout, how much."""
    log.info("hicache %s adapter started: L3 %s, layout fingerprint %s, %s", engine, redact_url(url),
             fingerprint, capacity)


def warnings_for(log: logging.Logger) -> LogLimiter:
    """A rate limiter for the adapter's warnings: 5 lines per kind and minute, then a count."""
    return LogLimiter(log, burst=5, interval_s=60.0)
