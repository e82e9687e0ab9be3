"""Which L2 an embedded ``HiCache`` gets: the one place the configuration decides it."""
from __future__ import annotations

from typing import NamedTuple

from hicache.core.config import HiCacheConfig
from hicache.tiers.l2.base import L2Tier
from hicache.tiers.l2.private import PrivateL2
from hicache.tiers.l2.segment import ServiceHostTier
from hicache.tiers.l2.shared import SharedL2
from hicache.core.layout import KVLayout
from hicache.memory.pools import HostPool
from hicache.client.link import SCHEME


class OpenedL2(NamedTuple):
    tier: L2Tier
    l3_url: str  # the L3 the caller should open ("" when storage.url named the service: its L3 is behind L2)


def open_l2(cfg: HiCacheConfig, layout: KVLayout, device: str, *, l3_given: bool = False) -> OpenedL2:
    """The node service's shared segment when ``storage.url`` names its socket
    (``hicache+unix://``) and no L3 object was passed in (``l3_given``), else a
    private pinned pool of ``pool.host_pages`` (``ConfigError`` when the host
    cannot hold it, or when the service does not answer)."""
    url = cfg.storage.url
    if not l3_given and url.startswith(SCHEME + ":"):
        return OpenedL2(SharedL2(ServiceHostTier.open(cfg, layout, device), cfg.policy), "")
    cfg.check_host_memory(layout)
    return OpenedL2(PrivateL2(HostPool(layout, cfg.pool.host_pages)), url)
