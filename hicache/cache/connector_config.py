"""An engine connector's settings: hicache's configuration plus the connector's own keys.

The engine hands one JSON object (vLLM: ``kv_connector_extra_config``). Its
keys are ``HiCacheConfig`` sections (``{"pool": {"host_pages": 4096},
"storage": {"url": "file:///var/cache/hicache"}, "admission": {...}}``, merged
over ``HICACHE_*`` and ``$HICACHE_CONFIG`` as everywhere in hicache) and:

* ``load``: ``"async"`` (default: loads run between engine steps, the request
  waits) or ``"layerwise"`` (L2-only hits load inside the step's forward,
  waited for per layer; hits with an L3 part stay asynchronous);
* ``host_bytes``: size L2 in bytes instead of ``pool.host_pages``.

``storage.url = "hicache+unix:///path.sock"`` makes L2 the node service's shared
segment (its L3 sits behind it); otherwise L2 is the connector's own pool.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from hicache.core.config import HiCacheConfig
from hicache.core.errors import ConfigError
from hicache.core.layout import KVLayout
from hicache.tiers.cost import CostModel

LOAD_MODES = ("async", "layerwise")
_OWN_KEYS = ("load", "host_bytes")


@dataclass(frozen=True)
class ConnectorSettings:
    config: HiCacheConfig
    layerwise: bool = False
    host_bytes: int = 0  # 0: config.pool.host_pages

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any] | None, env: Mapping[str, str] | None = None) -> "ConnectorSettings":
        """Validate the engine's connector object (``ConfigError`` names the key and the fix)."""
        extra = dict(extra or {})
        load = extra.pop("load", "async")
        if load not in LOAD_MODES:
            raise ConfigError(f"hicache connector: load={load!r}; use one of {', '.join(LOAD_MODES)}")
        host_bytes = extra.pop("host_bytes", 0)
        if not isinstance(host_bytes, int) or isinstance(host_bytes, bool) or host_bytes < 0:
            raise ConfigError(f"hicache connector: host_bytes={host_bytes!r}; must be an integer >= 0")
        overrides: dict[str, Any] = {}
        for section, values in extra.items():
            if isinstance(values, Mapping):
                overrides.update({f"{section}.{k}": v for k, v in values.items()})
            else:
                overrides[section] = values
        cfg = HiCacheConfig.load(overrides=overrides, env=env)
        if cfg.storage.url.startswith("memory:"):
            raise ConfigError("hicache connector: storage.url='memory://' is one store per process object, so "
                              "the scheduler and the workers would not share it; use file:///dir, redis://, "
                              "or '' for no L3")
        return cls(cfg, load == "layerwise", host_bytes)

    def host_pages(self, layout: KVLayout) -> int:
        """L2 pages of ``layout`` (``host_bytes`` when given); ``ConfigError`` when under one page."""
        n = self.host_bytes // layout.page_bytes if self.host_bytes else self.config.pool.host_pages
        if n < 1:
            raise ConfigError(f"hicache connector: host_bytes={self.host_bytes} holds no page of "
                              f"{layout.page_bytes} bytes; give at least one page")
        return n

    @property
    def shared(self) -> bool:
        """L2 is the node service's segment (``storage.url = hicache+unix:///path.sock``)."""
        from hicache.client.link import SCHEME
        return self.config.storage.url.startswith(SCHEME + ":")

    def open_link(self, layout: KVLayout, device: str):
        """Map the node service's segment (``ServiceHostTier``; ``ConfigError`` when no service answers)."""
        from hicache.tiers.l2.segment import ServiceHostTier
        return ServiceHostTier.open(self.config, layout, device)

    def open_l3(self, layout: KVLayout):
        """The L3 backend of ``storage.url`` for ``layout`` (None: no L3, or the service's behind its segment)."""
        s = self.config.storage
        if not s.url or self.shared:
            return None
        from hicache.storage import open_storage
        from hicache.storage.capacity import backend_options
        return open_storage(s.url, fingerprint=layout.fingerprint(), layout=layout, timeout_ms=s.timeout_ms,
                            max_retries=s.max_retries, auth_key=s.resolved_auth_key(), **backend_options(s))

    def cost_model(self, layout: KVLayout) -> CostModel:
        return CostModel.from_config(self.config.admission, layout.token_bytes)

    def probe_budget_s(self) -> float:
        """How long a lookup may wait for L3 (the prefetch policy's base budget)."""
        return self.config.policy.prefetch_timeout_base_ms / 1e3
