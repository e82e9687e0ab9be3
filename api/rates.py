"""``RateTracker``: bytes/s of monotonic counters over a sliding window (the REST
app samples once a second, and every statistics collection samples too)."""
from __future__ import annotations

import threading
import time
from collections import deque
from typing import Callable

from hicache.core.errors import IntegrityError

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
