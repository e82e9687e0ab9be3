"""``RestState``: everything the REST routes use, in a module of its own so that
the statistics, metrics and route modules read it without importing the
FastAPI dependencies (``hicache.api.deps``, which re-exports it)."""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from hicache.api.events import EventBus
from hicache.api.rates import RateTracker
from hicache.node.view import ServiceView
from hicache.core.config import HiCacheConfig
from hicache.core.errors import IntegrityError
from hicache.core.layout import KVLayout
from hicache.storage import StorageBackend


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
