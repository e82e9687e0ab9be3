"""Rate-limited logging: a flood of one kind of message costs a few lines.

``LogLimiter(logger)`` lets ``burst`` records of one key through per
``interval_s``; the rest are counted, and the next record let through for
that key says how many were suppressed. Keys are caller-chosen strings (a
message kind, not the varying values), so a hostile peer cannot grow the
table without bound beyond ``max_keys`` (the oldest keys are forgotten).
Thread-safe.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from typing import Callable

from hicache.core.errors import InvalidArgument


class LogLimiter:
    def __init__(self, logger: logging.Logger, *, burst: int = 5, interval_s: float = 60.0,
                 max_keys: int = 1024, clock: Callable[[], float] = time.monotonic):
        if burst < 1 or not interval_s > 0 or max_keys < 1:
            raise InvalidArgument(f"LogLimiter needs burst >= 1, interval_s > 0, max_keys >= 1; got burst={burst}, "
                                  f"interval_s={interval_s}, max_keys={max_keys}")
        self.logger = logger
        self.burst = burst
        self.interval_s = interval_s
        self.max_keys = max_keys
        self.clock = clock
        self._lock = threading.Lock()
        # key -> [window start, records let through in it, suppressed since the last one let through]
        self._keys: OrderedDict[str, list[float]] = OrderedDict()
        self.suppressed_total = 0

    def log(self, level: int, key: str, msg: str, *args: object) -> bool:
        """Log ``msg % args`` at ``level`` unless ``key`` is over its budget; True when logged."""
        if not self.logger.isEnabledFor(level):
            return False
        now = self.clock()
        with self._lock:
            st = self._keys.get(key)
            if st is None:
                st = self._keys[key] = [now, 0, 0]
                if len(self._keys) > self.max_keys:
                    self._keys.popitem(last=False)
            else:
                self._keys.move_to_end(key)
            if now - st[0] >= self.interval_s:
                st[0], st[1] = now, 0
            if st[1] >= self.burst:
                st[2] += 1
                self.suppressed_total += 1
                return False
            st[1] += 1
            dropped, st[2] = int(st[2]), 0
        if dropped:
            msg = f"{msg} ({dropped} similar message(s) suppressed)"
        self.logger.log(level, msg, *args)
        return True

    def warning(self, key: str, msg: str, *args: object) -> bool:
        return self.log(logging.WARNING, key, msg, *args)

    def info(self, key: str, msg: str, *args: object) -> bool:
        return self.log(logging.INFO, key, msg, *args)
