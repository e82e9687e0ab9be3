"""Scheduler side of tiering: a two-phase manager that moves no bytes.
"""
from __future__ import annotations

from typing import cast

from hicache.memory.allocator import PageAllocator
from hicache.index.prefix_cache import PrefixCache
from hicache.core.errors import CacheStateError, IntegrityError
from hicache.tiers.host_states import HostPageState, HostPageStates, enabled_by_env
from hicache.index.node import Node
from hicache.core.stats import TierMoveStats
from hicache.index.request import MatchResult
from hicache.tiers.plans import BackupPlan, LoadPlan, PrefetchPlan, StorePlan
from hicache.tiers.holds import LoadRequest
from hicache.tiers.groups import GroupPlan, GroupTiers
from hicache.core.types import DevicePageId, HostPageId, PageHash


class TierManager:
    """Two-phase tier movements over one ``PrefixCache``.

    ``TierManager`` decides what moves between tiers and records it in the index
    (``PrefixCache``); a transfer engine (``hicache.transfer.engine``) moves the bytes.
    Each movement is a pair: ``prepare_*`` reserves destination pages, pins the
    pages involved and returns a small typed plan (or ``None``: nothing to do, or
    no room); the caller submits the plan and, once the bytes moved, hands the
    outcome to ``complete_*``, which unpins and records the result. Between the
    two calls the plan's pages are protected from eviction:

    | pair | direction | pinned until complete |
    |---|---|---|
    | ``prepare_backup`` / ``complete_backup`` | L1 -> L2 | the node on L1 (``pin``), the new L2 ids |
    | ``plan_load`` + ``prepare_load`` / ``complete_load`` | L2 -> L1 | the path on L2 and its new L1 pages |
    | ``prepare_store`` / ``complete_store`` | L2 -> L3 | the node on L2 |
    | ``prepare_prefetch`` / ``complete_prefetch`` | L3 -> L2 | the new L2 ids, the L2 hit they continue (``after``) |

    Failure (as vLLM's ``complete_*(success=False)``): every ``complete_*`` must
    be called exactly once per plan, also when the transfer failed, and always
    unpins what its ``prepare_*`` pinned. What a failure leaves behind:

    | call | on failure |
    |---|---|
    | ``complete_backup(plan, ok=False)`` | no L2 copy recorded; the reserved L2 ids are freed; ``transfer_errors`` += 1 |
    | ``complete_load(plan, ok=False)`` | the L1 pages stay indexed with unknown bytes: the caller must stop serving (``HiCache`` raises ``TransferError`` from then on) |
    | ``complete_store(plan, stored)`` | partial: only ``stored`` leading pages reached L3; the node is flagged stored only when all did |
    | ``complete_prefetch(plan, loaded)`` | partial: the ``loaded`` leading pages are indexed on L2, the rest of the reserved ids freed |

    These are the movements of the private L2 (``hicache.tiers.l2.private``). In
    service mode the node's shared segment is L2 and ``hicache.tiers.l2.shared`` makes
    its own backup and load plans; only ``backing_up`` and ``stats`` are common.

    Debug mode (``HICACHE_DEBUG_STATES=1``, ``debug_states = true``): every
    private L2 page carries a state (``hicache.tiers.host_states``: free, reserved,
    protected, synced, backed up) moved at each step above; an illegal move
    raises ``IntegrityError`` and ``check_integrity`` cross-checks the table
    against the allocator, the index and the plans in flight.

    L1 pages for a load come from the caller (``prepare_load(..., device_pages)``):
    hicache's own allocator (``PrefixCache.alloc_device``) or an engine's block
    pool, whichever owns L1. L2 pages come from the index's
    host allocator, evicting L2 when short. Not thread-safe: the scheduler thread
    calls everything.
    """

    def __init__(self, cache: PrefixCache, *, debug_states: bool | None = None):
        """``debug_states``: keep the L2 page state table (None: ``HICACHE_DEBUG_STATES``)."""
        if cache.host_allocator is None:
            raise CacheStateError("TierManager needs a PrefixCache with a host (L2) allocator")
        self.cache = cache
        self._host: PageAllocator = cache.host_allocator
        self.stats = TierMoveStats()
        self.backing_up: set[Node] = set()  # nodes with a backup prepared and not completed (either L2)
        self._host_in_flight: set[HostPageId] = set()  # L2 ids held by prepared, uncompleted plans
        on = enabled_by_env() if debug_states is None else debug_states
        self.states: HostPageStates | None = HostPageStates(self._host.capacity) if on else None
        # Layer groups' items (hybrid layouts), keyed (group, page hash): their plans carry the
        # group index (``plan.group >= 0``) and complete here, as the index's pages do.
        self.groups: dict[int, GroupTiers] = {}

    def add_group(self, group: int, items: GroupTiers) -> None:
        """Manage layer group ``group``'s items (``hicache.tiers.groups``) with this manager's stats."""
        if group in self.groups:
            raise CacheStateError(f"layer group {group} is managed already")
        items.moves = self.stats
        self.groups[group] = items

    def complete_group(self, plan: GroupPlan, ok: bool, pages: int) -> list[GroupPlan]:
        """Complete a plan of a layer group's items (``plan.group >= 0``); the plans to submit
        next (an item's L2 copy on to L3)."""
        return self.groups[plan.group].complete(plan, ok, pages)

    @property
    def host_in_flight(self) -> list[HostPageId]:
        """L2 ids held by prepared, not yet completed backups and prefetches."""
        return list(self._host_in_flight)

    def _hold_host(self, ids: list[HostPageId]) -> None:
        held = self._host_in_flight.intersection(ids)
        if held:
            raise CacheStateError(f"L2 pages {sorted(held)[:8]} handed to a second plan while in flight")
        self._host_in_flight.update(ids)

    def _release_host(self, ids: list[HostPageId]) -> None:
        self._host_in_flight.difference_update(ids)

    def _to(self, pages: list[HostPageId], state: HostPageState) -> None:
        if self.states is not None:
            self.states.move(pages, state)

    def alloc_host(self, n: int) -> list[HostPageId] | None:
        """``n`` L2 pages (RESERVED), evicting unpinned L2 pages when short; None if
        that is not enough."""
        a = self._host
        if a.num_free < n:
            self.evict_host(n - a.num_free)
        if a.num_free < n:
            return None
        ids = cast(list[HostPageId], a.alloc(n))
        self._to(ids, HostPageState.RESERVED)
        return ids

    def free_host(self, ids: list[HostPageId]) -> None:
        """Give back L2 pages from ``alloc_host`` that nothing indexed (e.g. the duplicates
        ``index_host`` did not take) once no copy uses them."""
        if ids:
            self._to(ids, HostPageState.FREE)
            self._host.free(ids)

    def evict_host(self, num_pages: int) -> list[HostPageId]:
        """Drop at least ``num_pages`` logical pages from L2 (never pinned ones); the
        freed ids (FREE, already back in the allocator)."""
        freed = self.cache.evict_host(num_pages)
        self._to(freed, HostPageState.FREE)
        return freed

    # ----------------------------------------------------------------- L1 -> L2
    def prepare_backup(self, node: Node, *, pin: bool = True) -> BackupPlan | None:
        """Reserve L2 pages for ``node``'s L1 pages. ``pin``: lock the node on L1 until
        completion (an asynchronous backup; a synchronous write-back completes
        before anything can evict). None (counted as dropped) without L2 room."""
        dev = list(_on_l1(node))
        host = self.alloc_host(len(dev))
        if host is None:
            self.stats.backup_dropped_pages += len(dev)
            return None
        if pin:
            self.cache.inc_lock(node)
        self.backing_up.add(node)
        plan = BackupPlan(node, dev, host, node.draft_device, pin)
        self._hold_host(host)
        self._to(host, HostPageState.PROTECTED)
        return plan

    def complete_backup(self, plan: BackupPlan, ok: bool) -> list[Node]:
        """Record the L2 copy on ``plan.node`` and on the upper parts split off it
        meanwhile (top-down, while their parents are on L2); free what was not
        used. Returns the nodes that got L2 copies (ready for ``prepare_store``)."""
        node, dev, host = plan.node, plan.device, plan.host
        self.backing_up.discard(node)
        if plan.pinned:
            self.cache.dec_lock(node)
        self._release_host(host)
        if not ok:
            self.stats.transfer_errors += 1
            self._to(host, HostPageState.FREE)
            self._host.free(host)
            return []
        where = {d: i for i, d in enumerate(dev)}
        chain, n = [], node
        while (n.parent is not None and n.device_pages and n.host_pages is None
               and all(d in where for d in n.device_pages)):
            chain.append(n)
            n = n.parent
        used: set[HostPageId] = set()
        attached = []
        for n in reversed(chain):
            ids = [host[where[d]] for d in _on_l1(n)]
            try:
                self.cache.tree.set_host(n, ids, draft=plan.draft)
            except CacheStateError:
                break  # the parent never reached L2: drop this copy
            used.update(ids)
            self._to(ids, HostPageState.SYNCED)
            self.stats.backup_pages += len(ids)
            attached.append(n)
        rest = [h for h in host if h not in used]
        if rest:
            self.stats.backup_dropped_pages += len(rest)
            self._to(rest, HostPageState.FREE)
            self._host.free(rest)
        return attached

    # ----------------------------------------------------------------- L2 -> L1
    def plan_load(self, m: MatchResult) -> LoadRequest | None:
        """Pin ``m``'s L2-only part on L2 (and the device hit it continues on L1,
        until ``prepare_load`` or ``cancel_load``) and say how many L1 pages it
        needs. None when ``m`` has no L2 part."""
        if not m.host_tokens or m.host_node is None:
            return None
        cache, ps = self.cache, self.cache.page_size
        last = cache.tree.split_at(m.host_node, m.tokens // ps - m.host_node.start_page)
        path = tuple(cache.tree.path(last, stop=m.device_node))
        if not path or not all(n.device_pages is None and n.host_pages is not None for n in path):
            raise CacheStateError(f"plan_load: the host hit {path} is not an L2-only path below "
                                  f"{m.device_node!r}; match again")
        cache.inc_host_lock(last)
        if m.device_node is not None:
            cache.inc_lock(m.device_node)
        if self.states is not None:
            self.states.read(_host_ids(path))
        return LoadRequest(last, path, m.device_node, sum(len(_on_l2(n)) for n in path))

    def cancel_load(self, req: LoadRequest) -> None:
        """Release a ``plan_load`` that got no L1 pages."""
        self._unpin_anchor(req)
        self.cache.dec_host_lock(req.last)
        if self.states is not None:
            self.states.done_reading(_host_ids(req.path))

    def prepare_load(self, req: LoadRequest, device_pages: list[DevicePageId]) -> LoadPlan:
        """Give ``req``'s path the L1 pages ``device_pages`` (from whoever owns L1).
        From now on the index serves them as L1 hits; the plan pins them until
        ``complete_load`` (readers wait for the copy: the caller's in-flight registry)."""
        if len(device_pages) != req.num_pages:
            raise CacheStateError(f"prepare_load: {len(device_pages)} L1 pages for {req.num_pages}")
        self._unpin_anchor(req)
        host: list[HostPageId] = []
        at = 0
        for n in req.path:
            ids = _on_l2(n)
            k = len(ids)
            host += ids
            self.cache.tree.set_device(n, device_pages[at:at + k])
            at += k
        # The transfer itself pins the L1 pages it fills: the admitting request
        # may abort, finish or be preempted before the copy completes.
        self.cache.inc_lock(req.last)
        plan = LoadPlan(req.last, req.path, host, list(device_pages))
        self.stats.load_back_pages += req.num_pages
        return plan

    def _unpin_anchor(self, req: LoadRequest) -> None:
        if req.anchor is not None:
            self.cache.dec_lock(req.anchor)

    def complete_load(self, plan: LoadPlan, ok: bool) -> None:
        """Unpin a finished load. A failed one leaves the L1 pages indexed with
        unknown bytes: the caller must stop serving (``HiCache`` raises)."""
        self.cache.dec_host_lock(plan.last)
        if self.states is not None:
            self.states.done_reading(plan.host)
        self.cache.dec_lock(plan.last)
        if not ok:
            self.stats.transfer_errors += 1

    # ------------------------------------------------ L1 owned by an engine
    # The connector's movements: the engine's blocks are L1 (the index holds no L1 ids), so
    # they are keyed by prefix and page range; the blocks travel in the connector's plans.
    def pin_host(self, m: MatchResult, end_page: int) -> Node:
        """Pin on L2 the pages of ``m``'s host hit up to page ``end_page`` (a load from L2,
        or the prefix a save continues) until ``unpin_host``; returns the pinned node."""
        node = cast(Node, m.host_node)
        anchor = self.cache.tree.split_at(node, end_page - node.start_page)
        self.cache.inc_host_lock(anchor)
        return anchor

    def unpin_host(self, node: Node) -> None:
        self.cache.dec_host_lock(node)

    def index_host(self, key: bytes, namespace: str, first_page: int, host: list[HostPageId], *,
                   pin: bool) -> tuple[Node | None, list[HostPageId]]:
        """Index L2 pages ``host`` that an engine's blocks were copied into, continuing page
        ``first_page`` of ``key``. Returns the node that took them (None: none) and the ids
        it did not take (duplicates, for the caller to free). ``pin``: the node stays
        pinned on L2 (an L3 write reads it) until ``complete_engine_store``."""
        node, unused = self.cache.tree.insert_host(key, namespace, first_page, cast(list[int], host))
        if pin and node is not None:
            self.cache.inc_host_lock(node)
        return node, cast(list[HostPageId], unused)

    def complete_engine_store(self, node: Node, stored: bool) -> None:
        """Unpin ``node`` after its L3 write; ``stored``: L3 took every page (flag the node)."""
        if stored:
            self.cache.tree.set_stored(node)
        self.cache.dec_host_lock(node)

    # ----------------------------------------------------------------- L2 -> L3
    def prepare_store(self, node: Node) -> StorePlan | None:
        """Pin ``node`` on L2 to write it to L3; None if L3 has it already or (draft
        layouts) its L2 draft rows are incomplete — L3 holds complete pages only."""
        if node.in_storage:
            return None
        if self.cache.has_draft and not node.draft_host:
            self.stats.storage_put_skipped_draft_pages += len(_on_l2(node))
            return None
        self.cache.inc_host_lock(node)
        plan = StorePlan(node, list(_on_l2(node)), self.cache.tree.hashes(node))
        if self.states is not None:
            self.states.read(plan.host)
        return plan

    def complete_store(self, plan: StorePlan, stored: int) -> None:
        """``stored``: leading pages L3 accepted; the node is flagged only when all were."""
        self.cache.dec_host_lock(plan.node)
        self.stats.storage_put_pages += stored
        self.stats.storage_put_dropped_pages += len(plan.host) - stored
        if self.states is not None:
            self.states.done_reading(plan.host)
        if stored == len(plan.host):
            self.cache.tree.set_stored(plan.node)
            self._to(plan.host, HostPageState.BACKED_UP)

    # ----------------------------------------------------------------- L3 -> L2
    def prepare_prefetch(self, key: bytes, namespace: str, first_page: int,
                         hashes: list[PageHash], *, after: Node | None = None) -> PrefetchPlan | None:
        """Reserve L2 pages for L3 pages ``hashes`` continuing logical page
        ``first_page`` of ``key``: all of them, or the leading ones L2 has room for
        once evictable pages are gone (``len(plan.host)`` says how many); None
        without room for one. ``after``: the L2 hit the pages continue, pinned on L2
        (before room is made: L2 is prefix-closed, so evicting it would drop them)
        until ``complete_prefetch``, or now when the answer is None."""
        if after is not None:
            self.cache.inc_host_lock(after)
        host = self.alloc_host(len(hashes))
        if host is None and self._host.num_free:
            hashes = hashes[:self._host.num_free]
            host = self.alloc_host(len(hashes))
        if host is None:
            if after is not None:
                self.cache.dec_host_lock(after)
            return None
        self.stats.prefetch_started += 1
        ps4 = self.cache.page_size * 4
        plan = PrefetchPlan(key[:(first_page + len(hashes)) * ps4], namespace, first_page, host, hashes,
                            after=after)
        self._hold_host(host)
        self._to(host, HostPageState.PROTECTED)
        return plan

    def complete_prefetch(self, plan: PrefetchPlan, loaded: int) -> int:
        """Index the ``loaded`` leading pages that landed in L2 (as stored in L3);
        free the rest and unpin ``plan.after``. Returns the pages the index took."""
        self._release_host(plan.host)
        if plan.after is not None:
            self.cache.dec_host_lock(plan.after)
        got, unused = plan.host[:loaded], plan.host[loaded:]
        if loaded:
            end = (plan.first_page + loaded) * self.cache.page_size * 4
            node, taken_back = self.cache.tree.insert_host(plan.key[:end], plan.namespace, plan.first_page,
                                                           cast(list[int], got))
            dup = cast(list[HostPageId], taken_back)  # the ids the index did not take: the caller frees them
            unused = unused + dup
            if node is not None:
                self.cache.tree.set_stored(node)
            dups = set(dup)
            self._to([h for h in got if h not in dups], HostPageState.BACKED_UP)
        if unused:
            self._to(unused, HostPageState.FREE)
            self._host.free(unused)
        taken = len(plan.host) - len(unused)
        self.stats.prefetch_pages += taken
        return taken

    def check_integrity(self) -> None:
        """Every prepared backup's node is still on L1 (raises ``IntegrityError``; the
        L2 ids in flight are counted by the cache check through ``host_in_flight``)."""
        for n in self.backing_up:
            if n.device_pages is None:
                raise IntegrityError(f"{n!r} is being backed up but is not on L1")
        if self.states is not None:
            indexed = {p: n.host_lock_ref for n in self.cache.nodes() for p in n.host_pages or ()}
            self.states.check(self._host.is_allocated, indexed, set(self._host_in_flight))


def _on_l1(n: Node) -> list[DevicePageId]:
    if n.device_pages is None:
        raise CacheStateError(f"{n!r} is not on L1")
    return n.device_pages


def _host_ids(path: tuple[Node, ...]) -> list[HostPageId]:
    return [h for n in path for h in _on_l2(n)]


def _on_l2(n: Node) -> list[HostPageId]:
    if n.host_pages is None:
        raise CacheStateError(f"{n!r} is not on L2")
    return n.host_pages
