"""``RestState``: everything the REST routes use, in a module of its own so that
the statistics, metrics and route modules read it without importing the
FastAPI dependencies (``hicache.api.deps``, which re-exports it); and its
``RateTracker`` (bytes/s of monotonic counters over a sliding window)."""
from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from hicache.api.events import EventBus
from hicache.core.config import HiCacheConfig
from hicache.core.errors import IntegrityError
from hicache.core.layout import KVLayout
from hicache.node.snapshot import ServiceView
from hicache.storage import StorageBackend


RATE_WINDOW_S = 10.0


class RateTracker:
    """Bytes/s of monotonic counters over the last ``window_s`` seconds. Thread-safe."""

    def __init__(self, window_s: float = RATE_WINDOW_S, clock: Callable[[], float] = time.monotonic):
        self.window_s = window_s
        self.clock = clock
        self._lock = threading.Lock()
        self._samples: deque[tuple[float, dict[str, int]]] = deque()

    def sample(self, counters: dict[str, int]) -> dict[str, float]:
        """Record ``counters`` now; returns each one's rate over the window (0 until two samples)."""
        now = self.clock()
        with self._lock:
            self._samples.append((now, dict(counters)))
            # Keep one sample at or before the window start so the rate spans the whole window.
            while len(self._samples) > 2 and self._samples[1][0] <= now - self.window_s:
                self._samples.popleft()
            t0, first = self._samples[0]
        dt = now - t0
        if dt <= 0:
            return {k: 0.0 for k in counters}
        return {k: max(v - first.get(k, v), 0) / dt for k, v in counters.items()}

    def check_integrity(self) -> None:
        with self._lock:
            times = [t for t, _ in self._samples]
        if times != sorted(times):
            raise IntegrityError(f"rate samples out of order: {times}")


@dataclass(slots=True)
class RestState:
    """Everything the routes use. Built by ``serve`` (or a test) before the app.

    ``engine`` is the node service as the routes see it (``ServiceView``: an
    ``NodeServer`` in ``serve``, anything with those five methods in a test);
    it must be serving before requests arrive. ``storage`` is None when no L3
    is configured. The app does not own either: whoever built them stops and
    closes them.
    """

    config: HiCacheConfig
    layout: KVLayout
    engine: ServiceView
    storage: StorageBackend | None
    admin_token: str  # resolved (file read); never logged or returned
    bus: EventBus = field(default_factory=EventBus)
    rates: RateTracker = field(default_factory=RateTracker)
    started_at: float = field(default_factory=time.monotonic)
    l3_flushed: int = 0  # guarded by flush_lock
    flush_lock: threading.Lock = field(default_factory=threading.Lock)

    def check_integrity(self) -> None:
        self.engine.check_integrity()
        self.bus.check_integrity()
        self.rates.check_integrity()
        if self.storage is not None:
            self.storage.check_integrity()
        if self.l3_flushed < 0:
            raise IntegrityError(f"l3_flushed={self.l3_flushed} < 0")
