"""``SharedL2``: the node service's shared segment as this engine's L2 (service mode).
"""
from __future__ import annotations

import logging
import time
from typing import Any, Callable, cast

from hicache.client.link import ServiceClient, socket_path_of, SOCKET_SLACK_S
from hicache.core.config import HiCacheConfig, PolicyConfig
from hicache.core.errors import (CacheStateError, ConfigError, ContractMismatch, IntegrityError, OutOfPages, PoolError,
                                 ServiceError)
from hicache.core.hashing import namespace_root, raw_page_hashes
from hicache.core.layout import KVLayout
from hicache.core.types import DevicePageId, PageHash, PrefetchPolicy
from hicache.index.node import Node
from hicache.index.prefix_cache import PrefixCache, Request
from hicache.index.request import MatchResult
from hicache.memory.allocator import PageAllocator
from hicache.memory.pools import HostPool
from hicache.tiers.manager import TierManager
from hicache.tiers.plans import BackupPlan, LoadPlan
from hicache.tiers.holds import Acquired, LoadBack


log = logging.getLogger(__name__)


class ServiceHostTier:
    """The node's shared segment as an engine's host tier.

    The service must be up when the engine starts (the segment is mapped then;
    ``ConfigError`` names the socket otherwise). Afterwards a service that goes
    away turns every ``call`` into its ``default`` (a miss, a dropped backup or
    a no-op release), with one warning per outage; ``reconnect`` maps the
    restarted service's segment (the caller first lets every copy into the old
    mapping finish). A layout the service refuses is ``ContractMismatch`` at
    start. A dead engine's reservations and acquisitions are reclaimed by the
    service when its connection closes. Not thread-safe.
    """

    def __init__(self, socket_path: str, layout: KVLayout, *, pin: bool, timeout_s: float,
                 max_wait_s: float = 0.0):
        """``timeout_s``: the socket timeout; ``max_wait_s``: the longest ``fetch`` wait
        for the service's L3 (below ``timeout_s``)."""
        self.socket_path, self.layout, self.max_wait_s = socket_path, layout, max_wait_s
        self._pin, self._timeout = pin, timeout_s
        self.outages = self.reconnects = 0
        self.down = False
        self._down_since = 0.0
        try:
            self.client = self._connect()
        except ContractMismatch:
            raise
        except (OSError, PoolError, ServiceError) as e:
            raise ConfigError(f"storage.url hicache+unix://{socket_path}: no hicache service answers there "
                              f"({type(e).__name__}: {e}). In service mode the engine's L2 is the service's "
                              "shared segment: start `hicache serve` first (its service.socket_path is this "
                              "path), or set storage.url to another L3 for a private L2") from None

    @classmethod
    def open(cls, cfg: HiCacheConfig, layout: KVLayout, device: str) -> "ServiceHostTier":
        """Map the segment of the service ``cfg.storage.url`` names (``ConfigError`` if it cannot be)."""
        if layout.cp_size > 1:
            raise ConfigError(f"storage.url {cfg.storage.url!r} with cp_size={layout.cp_size}: the shared L2 "
                              "holds whole pages; context-parallel ranks use a private L2 (another storage.url)")
        wait_s = cfg.storage.timeout_ms * (1 + cfg.storage.max_retries) / 1e3
        wait_s = max(wait_s, cfg.policy.prefetch_timeout_cap_ms / 1e3)
        return cls(socket_path_of(cfg.storage.url), layout, pin=device.startswith("cuda"),
                   max_wait_s=wait_s, timeout_s=wait_s + SOCKET_SLACK_S)

    def _connect(self) -> ServiceClient:
        client = ServiceClient(self.socket_path, self.layout, timeout=self._timeout, pin=self._pin)
        if client.pool is None:
            client.close()
            raise PoolError(f"the service at {self.socket_path} mapped no segment for this engine")
        return client

    @property
    def pool(self) -> HostPool:
        """The shared pages (valid until ``reconnect`` maps a new segment, or ``close``)."""
        pool = self.client.pool
        if pool is None:
            raise ServiceError("closed", f"shared L2 hicache+unix://{self.socket_path}: the connection is closed")
        return pool

    def call(self, fn: Callable[..., Any], *args: Any, default: Any = None, **kw: Any) -> Any:
        """``fn(*args, **kw)``; during an outage (or when it starts one) ``default``.
        ``OutOfPages`` (the service cannot free pages now) is also ``default``."""
        if self.down:
            return default
        try:
            return fn(*args, **kw)
        except OutOfPages:
            return default
        except ServiceError as e:
            if e.kind != "closed":
                raise
            self._outage(e)
        except OSError as e:
            self._outage(e)
        return default

    def _outage(self, e: BaseException) -> None:
        self.down, self._down_since = True, time.monotonic()
        self.outages += 1
        log.warning(
            "shared L2 hicache+unix://%s unreachable (%s: %s): running without it until it is back",
            self.socket_path, type(e).__name__, e)

    def reconnect(self, min_interval_s: float = 1.0) -> bool:
        """After an outage, try (at most every ``min_interval_s``) to map the service's
        segment again; True when reconnected (``pool`` is then a new mapping; the caller
        let every copy into the old one finish, which is unmapped here)."""
        if not self.down or time.monotonic() - self._down_since < min_interval_s:
            return False
        try:
            client = self._connect()
        except Exception:  # still down (or refusing us): try again later
            self._down_since = time.monotonic()
            return False
        old, self.client = self.client, client
        old.close(send_bye=False)
        self.down = False
        self.reconnects += 1
        return True

    def close(self) -> None:
        self.client.close(send_bye=not self.down)


class SharedL2:
    """L2 in the node service's segment.

    With ``storage.url = hicache+unix:///path.sock`` an embedded ``HiCache``
    keeps no private L2: one host copy of each page serves every engine of the
    node. The service's index is the authority on which shared page holds which
    hash and whether its draft rows are valid; this engine's index records no
    L2 pages (``index_allocator`` is empty) and flags a node ``in_storage`` once
    the service holds it. This strategy moves no bytes (the transfer engine runs
    the page-copy kernels between L1 and the mapped segment) and calls nothing
    of its caller's. Its two movements (contract in ``hicache.tiers.l2.base``):

    * load back: ``plan_load`` acquires (locks) the shared pages continuing the
      request's L1 hit, after letting the service fetch what its L2 lacks from
      its own L3 within the request's budget; ``prepare_load`` indexes them as
      new L1 pages (loading); ``complete_load`` releases the acquisition.
    * backup: ``prepare_backup`` skips the leading pages the service already
      holds complete and reserves shared pages for the rest; ``complete_backup``
      commits them under their page hashes (or cancels the reservation).

    A service outage turns each call into a miss, a dropped backup or a no-op
    release (``ServiceHostTier``); a dead engine's reservations and acquisitions
    are reclaimed by the service.
    """

    def __init__(self, link: ServiceHostTier, index_allocator: PageAllocator, tiers: TierManager,
                 policy: PolicyConfig):
        """``tiers``: the tier manager over the index built with the empty ``index_allocator``
        (the index keeps no L2 ids of its own)."""
        if tiers.cache.host_allocator is not index_allocator or index_allocator.capacity:
            raise CacheStateError("SharedL2: the tier manager's index must be built over an empty L2 allocator "
                                  f"(this one has {index_allocator.capacity} pages)")
        self.link, self.policy = link, policy
        self._index_allocator = index_allocator
        self.cache: PrefixCache = tiers.cache
        self.tiers = tiers

    @property
    def pool(self) -> HostPool:
        return self.link.pool

    @property
    def private_bytes(self) -> int:
        return 0

    def unbacked(self, node: Node) -> bool:
        """Never committed to the shared L2 by this engine (the service may evict it
        later; it then comes back as a miss, never as wrong bytes)."""
        return not node.in_storage and node not in self.tiers.backing_up

    # ---------------------------------------------------------------- backup
    def prepare_backup(self, node: Node, *, pin: bool) -> BackupPlan | None:
        """Reserve shared pages for ``node``'s pages the service lacks, always pinning
        ``node`` on L1 (the copy runs after this returns). None when the service
        holds them all (the node is flagged stored), it is down or full."""
        link, cache = self.link, self.cache
        if link.down:
            return None
        hashes = cache.tree.hashes(node)
        need_draft = cache.has_draft and node.draft_device
        skip = link.call(lambda: link.client.lookup(hashes, need_draft=need_draft).num_pages, default=None)
        if skip is None:
            return None
        if skip == len(hashes):
            cache.tree.set_stored(node)
            return None
        pages = link.call(link.client.reserve, len(hashes) - skip, default=None)
        if pages is None:
            self.tiers.stats.backup_dropped_pages += len(hashes) - skip
            return None
        dev = list(node.device_pages or [])[skip:]
        if not len(dev) == len(pages) == len(hashes) - skip:
            link.call(link.client.cancel, pages)
            raise CacheStateError(f"SharedL2.prepare_backup: {len(dev)} L1 pages of {node!r} after {skip}, "
                                  f"{len(pages)} shared pages reserved, {len(hashes) - skip} hashes")
        cache.inc_lock(node)
        self.tiers.backing_up.add(node)
        return BackupPlan(node, dev, pages, node.draft_device, True, list(hashes[skip:]))

    def complete_backup(self, plan: BackupPlan, ok: bool) -> list[Node]:
        """Commit the filled pages (the node is flagged stored once the service took
        them), or cancel the reservation. No node gets index L2 ids: returns []."""
        tiers, link = self.tiers, self.link
        tiers.backing_up.discard(plan.node)
        self.cache.dec_lock(plan.node)
        if not ok:
            tiers.stats.transfer_errors += 1
            link.call(link.client.cancel, plan.host)
            return []
        tiers.stats.backup_pages += len(plan.host)
        dp = len(plan.host) if plan.draft else 0
        if link.call(link.client.commit, plan.shared, plan.host, draft_pages=dp) is not None:
            self.cache.tree.set_stored(plan.node)
        return []

    # ------------------------------------------------------------------ load
    def plan_load(self, req: Request, m: MatchResult, budget_s: float | None) -> LoadBack | None:
        """Acquire the shared pages continuing ``m``'s L1 hit (``m`` has no index L2
        part here), at least ``storage_hit_min_pages`` of them, and pin that L1 hit."""
        ps, p, link = self.cache.page_size, self.policy, self.link
        have, cap = m.tokens // ps, max(0, req.num_tokens - 1) // ps
        min_pages = max(1, p.storage_hit_min_pages)
        if cap - have < min_pages or link.down:
            return None
        if m.draft_cut_tokens:
            return None  # L1 holds more of it, without draft rows: not a shared load's business
        hashes = raw_page_hashes(req.key[:cap * ps * 4], ps, namespace_root(req.namespace))[have:]
        wait_s = link.max_wait_s if budget_s is None else min(budget_s, link.max_wait_s)
        wait_ms = 0 if p.prefetch_policy is PrefetchPolicy.BEST_EFFORT else int(1e3 * wait_s)
        acq = self._acquire(m, have, hashes, req.draft and self.cache.has_draft, wait_ms)
        if len(acq.host) < min_pages:
            self._release(acq.hashes)
            return None
        if acq.anchor is not None:  # as TierManager.plan_load: room for the load never evicts the hit it continues
            self.cache.inc_lock(acq.anchor)
        return LoadBack(len(acq.host), (have + len(acq.host)) * ps, acq.fetched, acq)

    def _acquire(self, m: MatchResult, first_page: int, hashes: list[PageHash], need_draft: bool,
                 wait_ms: int) -> Acquired:
        """Lock the leading shared pages of ``hashes``; with ``wait_ms``, let the service
        first load what its L2 lacks from its L3, then lock those too."""
        link = self.link
        pages = link.call(link.client.acquire, hashes, need_draft=need_draft, default=[])
        fetched = 0
        if len(pages) < len(hashes) and wait_ms > 0 and not link.down and link.client.has_l3:
            rest = hashes[len(pages):]
            got = link.call(link.client.fetch, rest, wait_ms, need_draft=need_draft)
            if got is not None and got.num_pages:
                fetched = got.fetched
                pages = pages + link.call(link.client.acquire, rest, need_draft=need_draft, default=[])
        return Acquired(m.device_node, first_page, pages, hashes[:len(pages)], min(fetched, len(pages)),
                        need_draft)

    def _release(self, hashes: list[PageHash]) -> None:
        if hashes:
            self.link.call(self.link.client.release, hashes)

    def cancel_load(self, lb: LoadBack) -> None:
        acq = _held(lb)
        if acq.anchor is not None:
            self.cache.dec_lock(acq.anchor)
        self._release(acq.hashes)

    def prepare_load(self, req: Request, lb: LoadBack, device_pages: list[DevicePageId]) -> LoadPlan:
        """Index the acquired pages as new L1 pages continuing the anchor along ``req``'s
        key (as stored: the service holds them), pinned and loading until ``complete_load``."""
        acq, cache = _held(lb), self.cache
        n, first = len(acq.host), acq.first_page
        if len(device_pages) != n or n == 0:
            raise CacheStateError(f"SharedL2.prepare_load: {len(device_pages)} L1 pages for {n} shared pages")
        end = first + n
        prefix = cast(list[DevicePageId], cache.tree.pages(acq.anchor, first)) if first else []
        res = cache.insert_device(req.key[:end * cache.page_size * 4], req.namespace, prefix + list(device_pages),
                                  end if acq.draft else 0)
        if res.new_pages != n or res.duplicates or res.draft_copies:
            raise CacheStateError(f"SharedL2.prepare_load: the index already held part of pages "
                                  f"[{first}, {end}) ({res.new_pages} new of {n}); match again")
        path = tuple(res.created)
        cache.inc_lock(path[-1])
        if acq.anchor is not None:
            cache.dec_lock(acq.anchor)
        for node in path:
            cache.tree.set_stored(node)  # the shared L2 holds them (a backup would copy nothing)
        self.tiers.stats.load_back_pages += n
        return LoadPlan(path[-1], path, list(acq.host), list(device_pages), list(acq.hashes))

    def complete_load(self, plan: LoadPlan, ok: bool) -> None:
        self.cache.dec_lock(plan.last)
        if not ok:
            self.tiers.stats.transfer_errors += 1
        self._release(plan.shared or [])

    # ------------------------------------------------------------- lifecycle
    def reconnect(self, idle: bool) -> HostPool | None:
        """After an outage, map the restarted service's segment once ``idle`` (no copy uses the old one)."""
        link = self.link
        return link.pool if link.down and idle and link.reconnect() else None

    def check_integrity(self) -> None:
        """The index holds no L2 ids of its own; the service runs its own check (when up)."""
        a = self._index_allocator
        if a.capacity != 0 or a.num_free != 0:
            raise IntegrityError(f"shared L2: the index's own L2 allocator must be empty, has "
                                 f"capacity {a.capacity}, {a.num_free} free")
        for n in self.tiers.backing_up:
            if n.lock_ref < 1:
                raise IntegrityError(f"{n!r} is being backed up to the shared L2 but is not pinned on L1")
        if not self.link.down:
            self.link.call(self.link.client.check_integrity)

    def close(self) -> None:
        self.link.close()


def _held(lb: LoadBack) -> Acquired:
    if not isinstance(lb.held, Acquired):
        raise CacheStateError(f"SharedL2 was handed another tier's load back ({type(lb.held).__name__})")
    return lb.held
