"""``HiCache``: the embedded three-tier cache an engine links against.

It composes the index (``PrefixCache``), the L1/L2 pools, an L3 backend and
the transfer controller, and implements the write policies, load back and
prefetch on top of the index. The index never calls up: requests made here
are ``TieredRequest`` handles, which act on what each index call returns
(back up the nodes an insert created, wait for loads and copy draft planes
before adopting the index's pages, write back eviction victims)::

    hc = HiCache(HiCacheConfig.load())
    req = hc.new_request("r1", prompt_ids)
    adm = hc.admit(req)                 # match L1/L2/L3, prefetch, lock, start load back
    req.alloc(len(prompt_ids) - adm.hit_tokens)
    # forward pass: adm.wait_layer(i) before attention of layer i
    req.commit(); req.finish()
    hc.poll()                           # once per scheduler step

Not thread-safe: one scheduler thread calls everything; completions run in
that thread during ``poll``.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from hicache.cache import MatchResult, PrefixCache, Request, RequestState, Tokens, as_key
from hicache.config import HiCacheConfig
from hicache.errors import CacheStateError, OutOfPages, TransferError
from hicache.hashing import page_hashes
from hicache.layout import KVLayout
from hicache.pools import DevicePool, HostPool
from hicache.node import InsertResult, Node
from hicache.transfer import LoadHandle, Transfer, TransferController

log = logging.getLogger(__name__)


@dataclass(slots=True)
class TierStats:
    """Tier movement counters (pages unless named otherwise)."""

    storage_lookups: int = 0
    storage_hit_pages: int = 0  # L3 pages continuing the L2 hit, at admission
    prefetch_started: int = 0
    prefetch_pages: int = 0  # pages that landed in L2 from L3
    prefetch_waited_ms: float = 0.0
    load_back_pages: int = 0  # L2 -> L1
    backup_pages: int = 0  # L1 -> L2 completed
    backup_dropped_pages: int = 0  # no L2 space, or the path was not on L2
    storage_put_pages: int = 0  # L2 -> L3 completed
    storage_put_dropped_pages: int = 0
    storage_put_skipped_draft_pages: int = 0  # not stored: their L2 draft rows are incomplete
    transfer_errors: int = 0

    def as_dict(self) -> dict[str, float]:
        return dataclasses.asdict(self)


class Admission(NamedTuple):
    """What ``admit`` decided for a request. Valid until the request ends."""

    match: MatchResult  # the final (post-prefetch, post-load) match the request locked
    device_tokens: int  # hit already on L1 before admission
    host_tokens: int  # hit loaded back from L2 (includes pages prefetched from L3)
    storage_tokens: int  # part of host_tokens that came from L3 in this admission
    loads: tuple[LoadHandle, ...]  # loads this request must wait for (its own and shared)

    @property
    def hit_tokens(self) -> int:
        return self.match.device_tokens

    def wait_layer(self, i: int) -> None:
        for h in self.loads:
            h.wait_layer(i)

    def wait(self) -> None:
        for h in self.loads:
            h.wait()


class HiCache:
    """Embedded L1/L2/L3 cache. See the module docstring for the call order."""

    def __init__(self, config: HiCacheConfig | None = None, *, layout: KVLayout | None = None,
                 device_buffers=None, storage=None):
        self.config = cfg = config or HiCacheConfig.load()
        self.layout = layout or cfg.layout()
        self.device_pool = DevicePool(self.layout, cfg.pool.device_pages, cfg.resolved_device(),
                                      buffers=device_buffers)
        self.host_pool = HostPool(self.layout, cfg.pool.host_pages)
        if storage is None and cfg.storage.url:
            from hicache.storage import open_storage
            storage = open_storage(cfg.storage.url, fingerprint=self.layout.fingerprint(), layout=self.layout,
                                   timeout_ms=cfg.storage.timeout_ms, max_retries=cfg.storage.max_retries)
        self.storage = storage
        self.policy = cfg.policy
        self.transfers = TransferController(self.device_pool, self.host_pool, storage)
        self.cache = PrefixCache(self.layout, self.device_pool, self.host_pool,
                                 eviction=cfg.policy.device_eviction, host_eviction=cfg.policy.host_eviction)
        self.tier_stats = TierStats()
        self._loading: dict[Node, LoadHandle] = {}  # L1 pages of these nodes are still arriving
        self._backing_up: set[Node] = set()
        self._host_in_flight: dict[int, list[int]] = {}  # transfer id -> host pages it holds (for integrity)
        self._storage_enabled = storage is not None and self.layout.cp_size == 1
        self._failed: TransferError | None = None  # set by a failed load back; fatal

    # ------------------------------------------------------------- requests
    def new_request(self, rid: str, tokens: Tokens, namespace: str = "", *, draft: bool | None = None) -> Request:
        """A WAITING request handle (see ``hicache.cache.Request``). ``draft``: the
        request runs the draft head (default: the layout has draft planes)."""
        c = self.cache
        return c.add_request(TieredRequest(self, rid, as_key(tokens), namespace,
                                           c.has_draft if draft is None else draft))

    def match(self, tokens: Tokens, namespace: str = "", *, storage: bool = False) -> tuple[MatchResult, int]:
        """Page-floored hits per tier without side effects beyond statistics:
        ``(L1/L2 match, L3 tokens continuing it)``; L3 is probed only when asked."""
        m = self.cache.match(tokens, namespace)
        if not storage or not self._storage_enabled:
            return m, 0
        key = as_key(tokens)
        ps = self.layout.page_size
        hashes = self._page_hashes(key, namespace, len(key) // (4 * ps))
        return m, self.transfers.storage_probe(hashes[m.tokens // ps:]) * ps

    def _page_hashes(self, key: bytes, namespace: str, num_pages: int) -> list:
        """Chained hashes (L3 keys) of the first ``num_pages`` pages of a bytes key."""
        ps = self.layout.page_size
        return page_hashes(np.frombuffer(key[:num_pages * ps * 4], dtype="<u4"), ps, namespace)

    def admit(self, req: Request) -> Admission:
        """Schedule ``req``: match every tier, prefetch from L3 per the policy, load
        the L2 hit back into L1 and lock the whole hit. WAITING/PREEMPTED -> RUNNING.
        Afterwards ``req.computed_tokens`` counts the hit; allocate and compute the rest."""
        self._check_healthy()
        m = req.match()
        device_tokens = m.device_tokens
        storage_tokens = self._maybe_prefetch(req, m)
        if storage_tokens or m.epoch != self.cache.epoch:
            m = req.match()  # prefetched pages joined L2, or L2 room was made by eviction
        own = self._load_host_hit(m)
        if own is not None or m.epoch != self.cache.epoch:
            m = req.match()
        req.lock(m)
        loads = [own] if own is not None else []
        if m.device_node is not None:
            for n in self.cache.path(m.device_node):
                h = self._loading.get(n)
                if h is not None and h not in loads:
                    loads.append(h)
            if self.policy.write_policy == "write_through_selective":
                self._selective_backup(m.device_node)
        host_tokens = m.device_tokens - device_tokens
        return Admission(m, device_tokens, host_tokens, min(storage_tokens, host_tokens), tuple(loads))

    # ----------------------------------------------------------------- L3 -> L2
    def _maybe_prefetch(self, req: Request, m: MatchResult) -> int:
        if not self._storage_enabled:
            return 0
        ps = self.layout.page_size
        have = m.tokens // ps
        cap = max(0, req.num_tokens - 1) // ps
        if cap - have < self.policy.storage_hit_min_pages:
            return 0
        key = req.key
        hashes = self._page_hashes(key, req.namespace, cap)
        self.tier_stats.storage_lookups += 1
        s = self.transfers.storage_probe(hashes[have:cap])
        if s < self.policy.storage_hit_min_pages:
            return 0
        self.tier_stats.storage_hit_pages += s
        host = self._alloc_host(s)
        if host is None:
            return 0
        self.tier_stats.prefetch_started += 1
        end_key = key[:(have + s) * ps * 4]

        def landed(t: Transfer) -> None:
            self._host_in_flight.pop(id(t), None)
            n = t.result or 0
            got = host[:n]
            unused = host[n:]
            if n:
                node, dup = self.cache.insert_host(end_key[:(have + n) * ps * 4], req.namespace, have, got)
                unused = unused + dup
                if node is not None:
                    self.cache.set_stored(node)
            if unused:
                self.cache.host_allocator.free(unused)
            self.tier_stats.prefetch_pages += s - len(unused)

        t = self.transfers.storage_get(hashes[have:have + s], host, on_done=landed)
        self._host_in_flight[id(t)] = host
        self._wait_prefetch(t, req.num_tokens)
        return s * ps if t.done else 0

    def _wait_prefetch(self, t: Transfer, num_tokens: int) -> None:
        p = self.policy
        if p.prefetch_policy == "best_effort":
            self.transfers.poll()
            return
        timeout = None
        if p.prefetch_policy == "timeout":
            timeout = min(p.prefetch_timeout_cap_ms,
                          p.prefetch_timeout_base_ms + p.prefetch_timeout_per_1k_tokens_ms * num_tokens / 1000) / 1e3
        t0 = time.perf_counter()
        self.transfers.wait(t, timeout)
        self.tier_stats.prefetch_waited_ms += (time.perf_counter() - t0) * 1e3

    # ----------------------------------------------------------------- L2 -> L1
    def _load_host_hit(self, m: MatchResult) -> LoadHandle | None:
        """Give the L2-only part of ``m`` L1 pages and start copying it in."""
        if not m.host_tokens or m.host_node is None:
            return None
        cache, ps = self.cache, self.layout.page_size
        end_page = m.tokens // ps
        last = cache.split_at(m.host_node, end_page - m.host_node.start_page)
        path = cache.path(last, stop=m.device_node)
        assert path and all(n.device_pages is None and n.host_pages is not None for n in path), path
        self.cache.inc_host_lock(last)
        if m.device_node is not None:
            self.cache.inc_lock(m.device_node)
        try:
            need = sum(len(n.host_pages) for n in path)
            self._make_room(need)
            dev = self.cache.alloc_device(need)
        except OutOfPages:
            self.cache.dec_host_lock(last)
            return None
        finally:
            if m.device_node is not None:
                self.cache.dec_lock(m.device_node)
        host_ids, at = [], 0
        for n in path:
            k = len(n.host_pages)
            host_ids += n.host_pages
            self.cache.set_device(n, dev[at:at + k])
            at += k
        # The transfer itself pins the L1 pages it fills: the admitting request
        # may abort, finish or be preempted before the copy completes.
        self.cache.inc_lock(last)

        def loaded(t: Transfer) -> None:
            self.cache.dec_host_lock(last)
            self.cache.dec_lock(last)
            for n in path:
                if self._loading.get(n) is handle:
                    del self._loading[n]
            if t.error is not None:
                self.tier_stats.transfer_errors += 1
                self._failed = TransferError(
                    f"load back of L2 pages {host_ids[:8]}{'...' if len(host_ids) > 8 else ''} into L1 "
                    f"pages {dev[:8]}{'...' if len(dev) > 8 else ''} failed ({t.error!r}); those L1 pages "
                    "are indexed with unknown bytes, so this cache refuses to serve; rebuild it")

        handle = self.transfers.load_back(host_ids, dev, on_done=loaded)
        for n in path:
            self._loading[n] = handle
        self.tier_stats.load_back_pages += need
        return handle

    # ----------------------------------------------------------------- L1 -> L2
    def _alloc_host(self, n: int) -> list[int] | None:
        a = self.cache.host_allocator
        if a.num_free < n:
            self.cache.evict_host(n - a.num_free)
        return a.alloc(n) if a.num_free >= n else None

    def _selective_backup(self, deepest: Node) -> None:
        for n in self.cache.path(deepest):
            if (n.host_pages is None and n not in self._backing_up
                    and n.hit_count >= self.policy.write_through_threshold):
                self._backup(n)

    def _write_back(self, node: Node) -> None:
        """write_back: save an eviction victim (and its path) to L2 before its L1 pages go."""
        if node.host_pages is not None:
            return
        for n in self.cache.path(node):
            if n.host_pages is None and n not in self._backing_up:
                t = self._backup(n, synchronous=True)
                if t is None:
                    return

    def _backup(self, node: Node, synchronous: bool = False) -> Transfer | None:
        dev = list(node.device_pages)
        draft = node.draft_device  # what the copy will hold: rows upgraded later are not in it
        host = self._alloc_host(len(dev))
        if host is None:
            self.tier_stats.backup_dropped_pages += len(dev)
            return None
        if not synchronous:
            self.cache.inc_lock(node)
        self._backing_up.add(node)

        def done(t: Transfer) -> None:
            self._host_in_flight.pop(id(t), None)
            self._backing_up.discard(node)
            if not synchronous:
                self.cache.dec_lock(node)
            self._attach_backup(node, dev, host, t, draft)

        t = self.transfers.backup(dev, host, on_done=done)
        self._host_in_flight[id(t)] = host
        if synchronous:
            self.transfers.wait(t)
        return t

    def _attach_backup(self, node: Node, dev: list[int], host: list[int], t: Transfer, draft: bool) -> None:
        """Record the L2 copy on ``node`` and on the upper parts split off it meanwhile."""
        if t.error is not None:
            self.tier_stats.transfer_errors += 1
            self.cache.host_allocator.free(host)
            return
        where = {d: i for i, d in enumerate(dev)}
        chain, n = [], node
        while (n.parent is not None and n.device_pages and n.host_pages is None
               and all(d in where for d in n.device_pages)):
            chain.append(n)
            n = n.parent
        used: set[int] = set()
        for n in reversed(chain):
            ids = [host[where[d]] for d in n.device_pages]
            try:
                self.cache.set_host(n, ids, draft=draft)
            except CacheStateError:
                break  # the parent never reached L2: drop this copy
            used.update(ids)
            self.tier_stats.backup_pages += len(ids)
            self._store(n)
        rest = [h for h in host if h not in used]
        if rest:
            self.tier_stats.backup_dropped_pages += len(rest)
            self.cache.host_allocator.free(rest)

    def _store(self, node: Node) -> None:
        """L2 -> L3 once the L2 copy is complete."""
        if not self._storage_enabled or node.in_storage:
            return
        if self.cache.has_draft and not node.draft_host:  # L3 holds complete pages only
            self.tier_stats.storage_put_skipped_draft_pages += len(node.host_pages)
            return
        self.cache.inc_host_lock(node)
        hashes = self.cache.hashes(node)
        host = list(node.host_pages)

        def stored(t: Transfer) -> None:
            self.cache.dec_host_lock(node)
            n = t.result or 0
            self.tier_stats.storage_put_pages += n
            self.tier_stats.storage_put_dropped_pages += len(host) - n
            if n == len(host):
                self.cache.set_stored(node)

        self.transfers.storage_put(host, hashes, on_done=stored)

    # ------------------------------------------------------------- eviction
    def evict(self, num_pages: int) -> int:
        """Take at least ``num_pages`` logical pages off L1 (unlocked leaves, by the
        device eviction policy). Under ``write_back`` each victim and its path are
        first backed up to L2 (waiting for the copy), so they stay as L2 hits.
        Returns pages evicted (fewer only when nothing else is evictable)."""
        got = 0
        while got < num_pages:
            victims = self.cache.device_victims(num_pages - got)
            if not victims:
                break
            if self.policy.write_policy == "write_back":
                for n in victims:
                    self._write_back(n)
            dropped = self.cache.drop_device(victims)
            if not dropped:
                break  # the write-back's completions changed every victim: give up this round
            got += dropped
        return got

    def evict_host(self, num_pages: int) -> list[int]:
        """Drop at least ``num_pages`` logical pages from L2 (never pages a transfer
        holds); returns the freed L2 ids (already free in the host pool)."""
        return self.cache.evict_host(num_pages)

    def _make_room(self, num_pages: int) -> None:
        """Before allocating ``num_pages`` L1 pages: under ``write_back`` evict with
        the write-back here (the index's own eviction would drop dirty pages)."""
        if self.policy.write_policy != "write_back":
            return
        a = self.cache.device_allocator
        if a.num_free < num_pages:
            self.evict(num_pages - a.num_free)

    # ------------------------------------------------------------- sharing
    def _settle_share(self, req: Request, res: InsertResult | None) -> None:
        """Act on what a request's insert returned: wait for loads still filling the
        index pages it now uses, copy the draft planes it supplied onto them,
        free its duplicates, then back up the new nodes (write_through)."""
        if res is None:
            return
        self._wait_loads(res.node)
        if res.draft_copies:  # before the duplicates (the copies' sources) are freed
            self._copy_draft(res.draft_copies)
        req._adopt(res)
        if self.policy.write_policy == "write_through":
            for n in res.created:
                self._backup(n)

    def _copy_draft(self, pairs) -> None:
        """Copy the draft planes of L1 page ``a`` onto page ``b`` for each ``(a, b)``."""
        from hicache.kernels.page_copy import copy_pages
        planes = [s.index for s in self.layout.planes if s.draft]
        copy_pages(self.device_pool, self.device_pool, [a for a, _ in pairs], [b for _, b in pairs],
                   planes=planes)

    # ------------------------------------------------------------- lifecycle
    def poll(self) -> int:
        """Observe finished transfers without blocking; returns how many. Raises
        ``TransferError`` once a load back has failed (see ``_check_healthy``)."""
        n = len(self.transfers.poll())
        self._check_healthy()
        return n

    def _check_healthy(self) -> None:
        if self._failed is not None:
            raise self._failed

    def _wait_loads(self, node: Node) -> None:
        """A request is about to use the index's L1 pages on ``node``'s path (or
        write draft rows into them): wait for loads still filling them."""
        for n in self.cache.path(node):
            h = self._loading.get(n)
            if h is not None:
                h.wait()

    def drain(self) -> None:
        """Block until every transfer has finished and been observed."""
        self.transfers.drain()

    def stats(self) -> dict:
        """A JSON-ready snapshot: index, tiers, bytes moved, L3 backend."""
        out = {"index": self.cache.stats().as_dict(), "tiers": self.tier_stats.as_dict(),
               "bytes_moved": dict(self.transfers.bytes_moved),
               "capacity_pages": {"L1": self.device_pool.num_pages, "L2": self.host_pool.num_pages}}
        if self.storage is not None:
            s = self.storage.stats()
            out["storage"] = dataclasses.asdict(s)
        return out

    def check_integrity(self) -> None:
        """Index invariants + pool accounting, counting pages held by transfers."""
        host_in_flight = [h for ids in self._host_in_flight.values() for h in ids]
        self.cache.check_integrity(host_in_flight=host_in_flight)
        self.device_pool.check_integrity()
        self.host_pool.check_integrity()
        if self.storage is not None:
            self.storage.check_integrity()

    def close(self) -> None:
        self.transfers.close()
        if self.storage is not None:
            self.storage.close()



class TieredRequest(Request):
    """A request of a ``HiCache``: the same handle and states as ``Request``; each
    step that changes the index hands the index's answer to its ``HiCache``,
    which acts on it (see ``HiCache._settle_share`` and ``HiCache._make_room``)."""

    def __init__(self, hc: HiCache, rid: str, key: bytes, namespace: str, draft: bool):
        super().__init__(hc.cache, rid, key, namespace, draft)
        self._hc = hc

    def alloc(self, num_tokens: int) -> list[int]:
        end = self.allocated_tokens + num_tokens
        if self.state is RequestState.RUNNING and 0 <= num_tokens and end <= self.num_tokens:
            self._hc._make_room(self._pages_for(end))
        return super().alloc(num_tokens)

    def commit(self, num_tokens: int | None = None, *, draft_tokens: int | None = None) -> int:
        self._check(RequestState.RUNNING, op="commit")
        self._advance(num_tokens, draft_tokens)
        self._hc._settle_share(self, self._share())
        return self.computed_tokens

    def finish(self) -> None:
        self._check(RequestState.WAITING, RequestState.RUNNING, RequestState.PREEMPTED, op="finish")
        if self.state is RequestState.RUNNING:
            self._hc._settle_share(self, self._share())
        self._end_finish()

    def preempt(self) -> None:
        self._check(RequestState.RUNNING, op="preempt")
        self._hc._settle_share(self, self._share())
        self._end_preempt()
