"""An L3 backend's outage state: the circuit breaker ``StorageBackend`` consults
before every raw call, the backoff that spaces its probes, and how long a
local call may take before it counts as an outage (``call_budget``).

One warning per outage (when the circuit opens) and one when L3 answers
again. Not thread-safe: the backend calls it under its lock.
"""
from __future__ import annotations

import logging
import os
import time
from typing import Any, Callable

log = logging.getLogger(__name__)

DOWN: Any = object()  # what a raw call answers when it was skipped (circuit open) or failed

# A local store's call budget per attempt: timeout_ms per page (at least
# MIN_ATTEMPT_S in all) plus its bytes at FLOOR_BYTES_PER_S (a slow disk; tmpfs
# moves 1-10 GB/s), scaled by how far the run queue exceeds the cores: a loaded
# box is slow, not down. A flat 50 ms per page reported the embedded L3 down on
# a 2-core box at load average 5-10.
FLOOR_BYTES_PER_S = 100e6
MIN_ATTEMPT_S = 0.25
_LOAD_REREAD_S = 1.0


def _cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


class LoadFactor:
    """The 1-minute load average over the usable cores (>= 1), re-read at most once
    a second. Not thread-safe, and need not be (a stale read is as good)."""

    def __init__(self) -> None:
        self.at, self.factor = -_LOAD_REREAD_S, 1.0

    def __call__(self) -> float:
        now = time.monotonic()
        if now - self.at >= _LOAD_REREAD_S:
            try:
                avg = os.getloadavg()[0]
            except OSError:  # not available: assume an idle box
                avg = 0.0
            self.at, self.factor = now, max(1.0, avg / _cpus())
        return self.factor


def call_budget(timeout_s: float, max_retries: int, pages: int, nbytes: int, load: float = 1.0) -> float:
    """Seconds a local call of ``pages`` pages and ``nbytes`` bytes may take, all
    ``1 + max_retries`` attempts included, at ``load`` (``LoadFactor()``)."""
    per_try = max(MIN_ATTEMPT_S, timeout_s * max(1, pages)) + nbytes / FLOOR_BYTES_PER_S
    return (1 + max_retries) * per_try * load


def probe_backoff(probe_max_ms: int, timeout_s: float) -> Any:
    """redis-py's ``ExponentialBackoff`` for probe spacing. The memory and file
    backends must also work where redis-py is not installed (the core imports
    without service dependencies); they never have network outages, so a
    fixed spacing at the cap is enough there."""
    cap = probe_max_ms / 1000.0
    try:
        from redis.backoff import ExponentialBackoff
    except ImportError:
        class _Fixed:
            def compute(self, failures: int) -> float:
                return cap
        return _Fixed()
    return ExponentialBackoff(cap=cap, base=timeout_s)


class Health:
    """Outage state: one warning per outage, probes spaced by a redis-py backoff
    (``probe_max_ms`` and ``timeout_s`` as in ``StorageOptions``)."""

    def __init__(self, name: str, probe_max_ms: int, timeout_s: float, clock: Callable[[], float] = time.monotonic):
        self.name = name
        self.clock = clock
        self.backoff = probe_backoff(probe_max_ms, timeout_s)
        self.down = False
        self.failures = 0  # consecutive failed calls in this outage
        self.probe_at = 0.0

    def allow(self) -> bool:
        """Calls may go to L3: the circuit is closed (while open, only the pinger probes)."""
        return not self.down

    def failed(self, op: str, exc: BaseException) -> bool:
        """Count a failed call; True when it opens the circuit (an outage starts)."""
        started = not self.down
        self._failed(op, exc)
        return started

    def _failed(self, op: str, exc: BaseException) -> None:
        self.failures += 1
        wait = self.backoff.compute(self.failures)
        self.probe_at = self.clock() + wait
        if not self.down:
            self.down = True
            log.warning("L3 %s unreachable (%s failed: %s: %s); answering misses and dropping writes "
                        "until it answers again", self.name, op, type(exc).__name__, exc)

    def succeeded(self) -> bool:
        """True when this success ends an outage."""
        if not self.down:
            return False
        log.warning("L3 %s answers again after %d failed call(s)", self.name, self.failures)
        self.down, self.failures = False, 0
        return True
