"""A ``RestState`` over a started in-process ``NodeServer``, for the REST tests
(tests/api, tests/hardening): each builds its own configuration, both build and
tear down the state the same way."""
from __future__ import annotations

from hicache.api.deps import RestState
from hicache.node.server import NodeServer, open_l3
from hicache.api.events import EventBus
from hicache.core.config import HiCacheConfig


def open_state(cfg: HiCacheConfig, admin_token: str = "") -> RestState:
    """Start an engine server for ``cfg`` (and its L3, when configured) behind a ``RestState``."""
    layout = cfg.layout()
    bus = EventBus()
    engine = NodeServer(cfg, layout)
    engine.start()
    storage = open_l3(cfg, layout)  # as hicache serve opens it (cap, eviction, MAC key)
    return RestState(config=cfg, layout=layout, engine=engine, storage=storage, admin_token=admin_token, bus=bus)


def close_state(st: RestState) -> None:
    """Check the service's integrity, then stop it and close its L3."""
    st.check_integrity()
    st.engine.stop()
    if st.storage is not None:
        st.storage.close()
