"""An L3 backend's outage state: the circuit breaker ``StorageBackend`` consults
before every raw call, and the backoff that spaces its probes.

One warning per outage (when the circuit opens) and one when L3 answers
again. Not thread-safe: the backend calls it under its lock.
"""
from __future__ import annotations

import logging
import time
from typing import Any, Callable

log = logging.getLogger(__name__)

DOWN: Any = object()  # what a raw call answers when it was skipped (circuit open) or failed


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
