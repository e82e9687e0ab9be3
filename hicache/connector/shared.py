"""Scheduler half of an engine connector whose L2 is the node service's shared segment.

With ``storage.url = hicache+unix:///path.sock`` every engine process of a node
(DP ranks, several servers) maps the one segment ``hicache serve`` owns, so a
page is held once per node; the service indexes it by page hash and keeps its
own L3 behind it. This half asks the service (``ServiceHostTier``: an outage is a
miss, a dropped save, a no-op release) and queues the same plain-data plans as
the private one; the workers copy between the engine's blocks and the mapped
segment. A load ``acquire`` s its pages (the service never evicts them) and
``release`` s them once every rank reported; a save ``reserve`` s pages, the
workers fill them, and ``commit`` makes them visible to every engine (``cancel``
when a copy failed). Not thread-safe.
"""
from __future__ import annotations

import dataclasses

from hicache.connector.scheduler import WAIT, ConnectorJobs, Hit, _event_fields, _Load, _Save
from hicache.connector.plan import L2
from hicache.connector.plan import LoadSpec, SaveSpec
from hicache.core.errors import CacheStateError, IntegrityError
from hicache.core.layout import KVLayout
from hicache.index.prefix_cache import as_key
from hicache.tiers.cost import CostModel
from hicache.tiers.l2.shared import ServiceHostTier


@dataclasses.dataclass(slots=True)
class _Shared:
    hashes: list  # the pages' hashes at the service (what release / commit take)


class SharedConnectorScheduler(ConnectorJobs):
    """The scheduler half over the node service's segment (see the module docstring)."""

    def __init__(self, layout: KVLayout, link: ServiceHostTier, *, cost: CostModel | None = None, ranks: int = 1,
                 layerwise: bool = False, fetch_wait_ms: int = 0):
        """``fetch_wait_ms``: how long a lookup may wait for the service to bring pages
        its L2 lacks in from its L3 (0: what it has now)."""
        super().__init__(layout, cost=cost, ranks=ranks, layerwise=layerwise)
        self.link = link
        self.fetch_wait_ms = fetch_wait_ms
        self._held: dict[int, _Shared] = {}  # job -> the hashes it acquired (load) or will commit (save)

    @property
    def host_pages(self) -> int:
        return self.link.pool.num_pages

    def lookup(self, rid: str, tokens, engine_hit: int, namespace: str = "", key: bytes | None = None) -> Hit:
        """Page-floored tokens beyond ``engine_hit`` the segment holds (after letting the
        service fetch from its L3 for ``fetch_wait_ms``); at least one token stays.
        ``key``: as ``ConnectorScheduler.lookup``."""
        self._lookups += 1
        ps = self.page_size
        key = as_key(tokens) if key is None else key
        cap = max(0, len(key) // 4 - 1) // ps
        first = engine_hit // ps
        if cap <= first:
            return self._decide(rid, engine_hit, 0, 0)
        if self._waits(rid, key, namespace, first, cap):
            return WAIT
        link = self.link
        hashes = self.page_hashes(key, namespace, cap)
        got = link.call(link.client.fetch, hashes, self.fetch_wait_ms)
        return self._decide(rid, engine_hit, max(0, (got.num_pages if got else 0) - first), 0)

    def allocated(self, rid: str, tokens, block_ids, num_external: int, namespace: str = "",
                  keys=(), key: bytes | None = None) -> LoadSpec | None:
        """Acquire the segment pages for ``num_external`` tokens of the last lookup (the
        service may hand fewer: the rest are queued as missing)."""
        span = self._allocated_span(rid, num_external)
        if span is None:
            return None
        hit, first, end = span
        key = as_key(tokens) if key is None else key
        hashes = self.page_hashes(key, namespace, end)[first:end]
        link = self.link
        pages = link.call(link.client.acquire, hashes, default=[])
        spec = LoadSpec(self.new_job(), rid, tuple(int(b) for b in block_ids[first:end]), tuple(pages),
                        layerwise=not hit.is_async)
        self._held[spec.job] = _Shared(hashes[:len(pages)])
        return self._queue_load(rid, _Load(rid, spec, None, None), key, namespace, first)

    def finished(self, rid: str, tokens, computed_tokens: int, block_ids, namespace: str = "", keys=(),
                 key: bytes | None = None) -> bool:
        """Reserve segment pages for the computed full pages the segment lacks; True: the
        engine keeps the blocks until the workers copied them."""
        key, n = self._saveable(rid, tokens, computed_tokens, block_ids, key)
        if n == 0:
            return False
        link = self.link
        hashes = self.page_hashes(key, namespace, n)
        found = link.call(link.client.lookup, hashes)
        if found is None:  # the service is away: nothing to save into
            self._c["save_dropped"] += n
            return False
        have = found.num_pages
        if have >= n:
            return False
        pages = link.call(link.client.reserve, n - have)
        if not pages:
            self._c["save_dropped"] += n - have
            return False
        spec = SaveSpec(self.new_job(), rid, tuple(int(b) for b in block_ids[have:n]), tuple(pages))
        ev_keys, ev_parent, ev_tokens = _event_fields(keys, tokens, have, n, self.page_size)
        self._saves[spec.job] = _Save(rid, spec, b"", namespace, have, None, keys=ev_keys, parent=ev_parent,
                                      tokens=ev_tokens)
        self._held[spec.job] = _Shared(hashes[have:n])
        self._plan_saves.append(spec)
        return True

    def _complete_load(self, ld: _Load) -> None:
        if self._loading.get(ld.rid) == ld.spec.job:
            del self._loading[ld.rid]
        held = self._held.pop(ld.spec.job)
        if held.hashes:
            self.link.call(self.link.client.release, held.hashes)
        self._count_load(ld, len(ld.spec.host) if all(r.ok for r in ld.reports) else 0)

    def _complete_save(self, sv: _Save) -> None:
        spec = sv.spec
        del self._saves[spec.job]
        held = self._held.pop(spec.job)
        link = self.link
        if not all(r.ok for r in sv.reports):
            link.call(link.client.cancel, list(spec.host))
            self._c["save_dropped"] += len(spec.host)
            return
        res = link.call(link.client.commit, held.hashes, list(spec.host))
        inserted = res.inserted if res is not None else 0
        self._c["saved"] += inserted
        self._c["save_dropped"] += len(spec.host) - inserted
        if res is not None and not res.duplicates:
            self.events.stored(L2, sv.keys, sv.parent, sv.tokens)

    def _complete_store(self, sv: _Save) -> None:
        raise CacheStateError(f"save job {sv.spec.job}: the service's L3 sits behind its segment; "
                              "no worker stores to L3 here")

    def check_integrity(self) -> None:
        """Every job in flight holds its service pages (``IntegrityError``), and the service agrees."""
        jobs = set(self._loads) | set(self._saves)
        if jobs != set(self._held):
            raise IntegrityError(f"jobs {sorted(jobs)} but service holds for {sorted(self._held)}")
        self.cost.check_integrity()
        self.link.call(self.link.client.check_integrity)

    def close(self) -> None:
        self.link.close()
