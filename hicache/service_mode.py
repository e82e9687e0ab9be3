"""Service mode: ``HiCache``'s L2 is the node service's shared segment.

With ``storage.url = hicache+unix:///path.sock`` an embedded ``HiCache``
keeps no private L2. ``ServiceMode`` turns the service's answers into the
tier manager's plans; it moves no bytes (the transfer engine runs the
page-copy kernels between L1 and the mapped segment) and calls nothing of
its caller's. Two movements, each two-phase like ``hicache.tiers``:

* load back: ``acquire`` locks the shared pages continuing a request's L1
  hit (after letting the service fetch what its L2 lacks from its own L3);
  the caller finds L1 pages, then ``prepare_load`` indexes them as loading
  (or ``cancel`` gives the acquisition back); ``load_done`` releases it once
  the copy completed;
* backup: ``prepare_backup`` skips the leading pages the service already
  holds complete and reserves shared pages for the rest; ``backup_done``
  commits them under their page hashes once the copy completed (or gives
  the reservation back).

The service's index is the authority on which shared page holds which hash
and whether its draft rows are valid. A dead engine's reservations and
acquisitions are reclaimed by the service. See ``ServiceHostTier`` for the
failure model.
"""
from __future__ import annotations

from typing import NamedTuple

from hicache.config import HiCacheConfig
from hicache.errors import ConfigError
from hicache.cache import PrefixCache
from hicache.layout import KVLayout
from hicache.index.node import Node
from hicache.plans import BackupPlan, LoadPlan
from hicache.request import MatchResult
from hicache.shared_l2 import ServiceHostTier
from hicache.tiers import TierManager
from hicache.types import DevicePageId, HostPageId, PageHash


class Acquired(NamedTuple):
    """Shared pages locked for one request, not yet given L1 pages."""

    first_page: int  # logical page of ``key`` the first shared page holds
    host: list[HostPageId]  # the locked shared pages, in order
    hashes: list[PageHash]  # their hashes (what ``release`` takes)
    fetched: int  # of them, pages the service loaded from its L3 for this request
    draft: bool  # their draft rows are valid


def open_service_tier(cfg: HiCacheConfig, layout: KVLayout, device: str) -> ServiceHostTier:
    """Map the node service's segment as this engine's L2 (``ConfigError`` if it cannot be)."""
    from hicache.storage.service import SOCKET_SLACK_S, socket_path_of
    if layout.cp_size > 1:
        raise ConfigError(f"storage.url {cfg.storage.url!r} with cp_size={layout.cp_size}: the shared L2 holds "
                          "whole pages; context-parallel ranks use a private L2 (another storage.url)")
    wait_s = cfg.storage.timeout_ms * (1 + cfg.storage.max_retries) / 1e3
    wait_s = max(wait_s, cfg.policy.prefetch_timeout_cap_ms / 1e3)
    return ServiceHostTier(socket_path_of(cfg.storage.url), layout, pin=device.startswith("cuda"),
                           max_wait_s=wait_s, timeout_s=wait_s + SOCKET_SLACK_S)


class ServiceMode:
    """Plans between L1 and the shared segment for one ``HiCache`` (see the module docstring)."""

    def __init__(self, tier: ServiceHostTier, cache: PrefixCache, tiers: TierManager):
        self.tier, self.cache, self.tiers = tier, cache, tiers

    # ------------------------------------------------------------------ load
    def acquire(self, key: bytes, namespace: str, m: MatchResult, hashes: list[PageHash], *,
                need_draft: bool, wait_ms: int, min_pages: int) -> Acquired | None:
        """Lock the shared pages continuing ``m`` (an L1-only hit of ``key``) along
        ``hashes`` (the page hashes from ``m``'s end); None when fewer than
        ``min_pages`` are there. ``wait_ms``: how long the service may fetch
        from its L3 what its L2 lacks (0: not asked)."""
        sh = self.tier
        if sh.down or len(hashes) < min_pages:
            return None
        if self.cache.match(key, namespace).tokens != m.tokens:
            return None  # L1 holds more of it, without draft rows: not a shared load's business
        pages = sh.call(sh.shared.begin_load, hashes, need_draft=need_draft, default=[])
        fetched = 0
        if len(pages) < len(hashes) and wait_ms > 0 and not sh.down and sh.client.has_l3:
            rest = hashes[len(pages):]  # maybe in the service's L3: let it load them, then lock them too
            got = sh.call(sh.client.fetch, rest, wait_ms, need_draft=need_draft)
            if got is not None and got.num_pages:
                fetched = got.fetched
                pages = pages + sh.call(sh.shared.begin_load, rest, need_draft=need_draft, default=[])
        acq = Acquired(m.tokens // self.cache.page_size, pages, hashes[:len(pages)], min(fetched, len(pages)),
                       need_draft)
        if len(pages) < min_pages:
            self.cancel(acq)
            return None
        return acq

    def cancel(self, acq: Acquired) -> None:
        """Give back an acquisition that got no L1 pages."""
        if acq.hashes:
            self.tier.call(self.tier.shared.end_load, acq.hashes)

    def prepare_load(self, key: bytes, namespace: str, anchor: Node | None, acq: Acquired,
                     device_pages: list[DevicePageId]) -> LoadPlan:
        """Index ``acq``'s pages as L1 ``device_pages`` continuing ``anchor``, loading
        until ``complete_load`` (see ``TierManager.prepare_shared_load``)."""
        return self.tiers.prepare_shared_load(key, namespace, anchor, acq.first_page, acq.host, acq.hashes,
                                              device_pages, draft=acq.draft)

    def load_done(self, plan: LoadPlan) -> None:
        """After ``TierManager.complete_load``: release the shared pages."""
        if plan.shared:
            self.tier.call(self.tier.shared.end_load, plan.shared)

    # ---------------------------------------------------------------- backup
    def prepare_backup(self, node: Node) -> BackupPlan | None:
        """Reserve shared pages for ``node``'s pages the service lacks; None when it
        holds them all (the node is flagged shared), it is down or full."""
        sh, cache = self.tier, self.cache
        if sh.down:
            return None
        hashes = cache.hashes(node)
        draft = node.draft_device or not cache.has_draft
        skip = sh.call(sh.shared.lookup, hashes, need_draft=cache.has_draft and draft, default=None)
        if skip is None:
            return None
        if skip == len(hashes):
            cache.set_stored(node)
            return None
        pages = sh.call(sh.shared.begin_store, len(hashes) - skip, default=None)
        if pages is None:
            self.tiers.stats.backup_dropped_pages += len(hashes) - skip
            return None
        return self.tiers.prepare_shared_backup(node, skip, pages, hashes[skip:])

    def backup_done(self, plan: BackupPlan, ok: bool) -> None:
        """After ``TierManager.complete_backup``: commit the filled pages, or give them back."""
        sh = self.tier
        if not ok:
            sh.call(sh.shared.abort_store, plan.host)
            return
        dp = len(plan.host) if plan.draft else 0
        if sh.call(sh.shared.end_store, plan.shared, plan.host, dp) is not None:
            self.cache.set_stored(plan.node)
