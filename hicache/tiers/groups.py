"""One hybrid layer group's items on L1, L2 and L3, keyed (group, page hash).

An item is one page of the group's own ``KVLayout``: the SWA layers' planes of one page,
or one snapshot of every state layer as a single ``kind="rows"`` row. ``GroupTiers``
indexes which tier holds each item and how many recorded boundaries need it (``need``);
it moves no bytes. Its moves are plans carrying the group's index (``plan.group``) that
the one transfer engine runs on the group's pools and ``TierManager.complete_group``
completes: write-through (``keep``: an L1 -> L2 copy, then L2 -> L3 once it completed),
an L3 fetch (``fetch``), the L2 -> L1 load of what a request takes (``load_plan``). The
index changes when a plan is made; ids a job holds outlive a drop until it completes.
An item nobody needs is dropped from every tier; one some boundary needs that left every
tier is handed to the caller (``take_gone``). Running requests hold *private* L1 ids
they write and *pin* items they read.
"""
from __future__ import annotations

import hashlib
from collections import Counter, OrderedDict
from typing import NamedTuple

from hicache.core.errors import IntegrityError, OutOfPages
from hicache.core.layout import KVLayout
from hicache.core.stats import TierMoveStats
from hicache.memory.pools import DevicePool, HostPool
from hicache.storage import StorageBackend
from hicache.transfer.engine import LoadHandle
from hicache.tiers.plans import BackupPlan, LoadPlan, PrefetchPlan, StorePlan
from hicache.core.types import DevicePageId, HostPageId, PageHash

GroupPlan = BackupPlan | LoadPlan | StorePlan | PrefetchPlan


class TierCounts(NamedTuple):
    """Items of one group per tier (L3: the ones this process stored and still needs)."""

    l1: int
    l2: int
    l3: int


class GroupStats(NamedTuple):
    taken_l1: int  # items a request took that were on L1
    taken_l2: int  # ... loaded from L2
    taken_l3: int  # ... fetched from L3
    dropped: int  # items no boundary needed any more (freed from every tier)
    lost: int  # items that left every tier (evicted with no copy below, an L3 object gone): a later miss


class GroupTiers:
    """One group's items on three tiers. Not thread-safe (one scheduler thread)."""

    def __init__(self, name: str, layout: KVLayout, device_pages: int, host_pages: int, device: str,
                 storage: StorageBackend | None = None, *, group: int = 0):
        """``group``: the layer group's index, carried by every plan (``plan.group``)."""
        self.name, self.layout, self.storage, self.group = name, layout, storage, group
        self.moves = TierMoveStats()  # the tier manager's once added to it (``TierManager.add_group``)
        self.device = DevicePool(layout, device_pages, device)
        self.host = HostPool(layout, host_pages)
        self.sizes = [p.page_bytes for p in layout.planes]
        self.l1: OrderedDict[PageHash, DevicePageId] = OrderedDict()  # least recently used first
        self.l2: OrderedDict[PageHash, HostPageId] = OrderedDict()
        self.stored: set[PageHash] = set()  # put into L3 by this store and not deleted since
        self.need: dict[PageHash, int] = {}  # the record: boundaries that read each item
        self.pins: dict[PageHash, int] = {}  # running requests reading each item's L1 copy
        self.private: set[DevicePageId] = set()  # L1 ids that requests allocated and own
        self.pending: dict[PageHash, tuple[HostPageId, DevicePageId]] = {}  # taken; L2 -> L1 copy not started
        self.loading: dict[PageHash, LoadHandle] = {}  # copy started (its load's handle); not yet completed
        self._fetched: set[PageHash] = set()  # on L2 because take() just fetched them from L3
        self._gone: set[PageHash] = set()  # needed items that left every tier (see take_gone)
        self._taken = [0, 0, 0]
        self._dropped = self._lost = 0
        # Jobs in flight. The index changes when a plan is made (an item is on L2 from its
        # backup's plan on); the ids a job reads or writes stay allocated until it completes:
        # an item dropped meanwhile leaves them as orphans, freed then.
        self._backing: dict[HostPageId, tuple[PageHash, DevicePageId]] = {}  # L1 -> L2, by destination
        self._copying: dict[PageHash, HostPageId] = {}  # items whose backup is in flight (kept on L1 and L2)
        self._storing: dict[bytes, tuple[PageHash, HostPageId]] = {}  # L2 -> L3, by L3 key
        self._fetching: dict[HostPageId, PageHash] = {}  # L3 -> L2, by destination (not indexed yet)
        self._held_l1: Counter[DevicePageId] = Counter()  # ids jobs read
        self._held_l2: Counter[HostPageId] = Counter()
        self._orphans_l1: set[DevicePageId] = set()  # dropped while a job holds them
        self._orphans_l2: set[HostPageId] = set()
        self._plans: list[GroupPlan] = []  # prepared, for the caller to submit (``take_plans``)

    # ------------------------------------------------------------ requests
    def alloc(self, n: int) -> list[DevicePageId]:
        """``n`` private L1 ids (evicts unpinned items, least recently used first). Raises
        ``OutOfPages`` naming the group, allocating nothing, when that is not enough."""
        a = self.device.allocator
        if a.num_free < n and a.num_free + sum(h not in self.pins and h not in self._copying
                                               for h in self.l1) >= n:
            self.evict_l1(n - a.num_free)
        if a.num_free < n:
            raise OutOfPages(f"{self.name}: asked for {n} L1 pages, {a.num_free} free of {a.capacity} "
                             f"({len(self.pins)} pinned items, {len(self.private)} private pages); "
                             "finish requests or enlarge the pool")
        ids = [DevicePageId(i) for i in a.alloc(n)]
        self.private.update(ids)
        return ids

    def free(self, ids: list[DevicePageId]) -> None:
        """Return private ids (raises ``IntegrityError`` for an id that is not private)."""
        bad = [i for i in ids if i not in self.private]
        if bad:
            raise IntegrityError(f"{self.name}: freeing L1 ids {bad} that no request owns privately")
        self.private.difference_update(ids)
        self.device.allocator.free(ids)

    def keep(self, h: PageHash, dev: DevicePageId, *, needed: bool = True) -> DevicePageId:
        """The private page ``dev`` holds item ``h``: count one more boundary that needs it
        (``needed``), index it on L1 (or free ``dev`` when ``h`` is there already) and write
        it through to L2 and L3. Returns the L1 id now holding ``h``, pinned for the caller."""
        if needed:
            self.need[h] = self.need.get(h, 0) + 1
        self._gone.discard(h)  # held again: the boundaries that need it can resume again
        have = self.l1.get(h)
        if h in self.pending:
            raise IntegrityError(f"{self.name}: keep({h.hex()[:8]}) while its load is planned but not started "
                                 "(keep runs between admissions, never inside one)")
        if h in self.loading:  # another admission is loading it: the caller reads its L1 page next
            self.loading[h].wait()
        if have is not None:
            self.free([dev])
        else:
            self.private.discard(dev)
            self.l1[h] = have = dev
        self.pin(h)
        if h in self.l2:
            self._store(h)
        else:
            self._to_l2(h)
        return have

    def ref(self, h: PageHash) -> None:
        """One more boundary needs item ``h`` (already held)."""
        self.need[h] = self.need.get(h, 0) + 1

    def unref(self, h: PageHash) -> None:
        """One boundary less needs ``h``; at none it is dropped from every tier (once unpinned)."""
        n = self.need.get(h, 0) - 1
        if n < 0:
            raise IntegrityError(f"{self.name}: unref of item {h.hex()} that no boundary needs")
        if n:
            self.need[h] = n
            return
        del self.need[h]
        self._drop_if_unused(h)

    def pin(self, h: PageHash) -> None:
        self.pins[h] = self.pins.get(h, 0) + 1
        self.l1.move_to_end(h)

    def unpin(self, h: PageHash) -> None:
        n = self.pins[h] - 1
        if n:
            self.pins[h] = n
            return
        del self.pins[h]
        self._drop_if_unused(h)

    def take(self, h: PageHash) -> DevicePageId | None:
        """Item ``h``'s L1 page, pinned for the caller: on L1 already (perhaps still being
        loaded: see ``loading``), else a new L1 page for its L2 copy (fetched from L3 first
        when only L3 holds it; the codec checks it: a corrupt or foreign object is a miss)
        whose copy is listed in ``pending`` for the caller to start. None: a miss."""
        dev = self.l1.get(h)
        if dev is not None:
            self._taken[0] += 1
        elif h in self.l2:
            self._taken[1 if h not in self._fetched else 2] += 1
            self._fetched.discard(h)
            dev = self.alloc(1)[0]
            self.private.discard(dev)
            self.l1[h] = dev
            self.pending[h] = (self.l2[h], dev)
            self.pin(h)  # the load's own pin: released once its completion is observed
        else:
            return None
        self.pin(h)
        return dev

    def cancel_pending(self, keep: set[PageHash]) -> None:
        """Un-take the pending items not in ``keep`` that no request pins (an admission that
        took them, then lowered its floor): their L1 pages are freed, L2 keeps them."""
        for h in [h for h in self.pending if h not in keep]:
            if self.pins[h] != 1:
                raise IntegrityError(f"{self.name}: item {h.hex()[:8]} is pinned by a request but its load "
                                     "is not started")
            del self.pending[h], self.pins[h]
            self.device.allocator.free([self.l1.pop(h)])
            self._drop_if_unused(h)

    def load_plan(self) -> LoadPlan | None:
        """The pending copies as one L2 -> L1 load of this group, for the caller to submit to the
        one transfer engine and hand its handle to ``started``; None: nothing pending."""
        if not self.pending:
            return None
        rows = list(self.pending.values())
        return LoadPlan(None, (), [hid for hid, _ in rows], [dev for _, dev in rows], None, group=self.group)

    def started(self, handle: LoadHandle) -> None:
        """Every pending copy runs in ``handle``'s load: readers wait on it until it completes."""
        for h in self.pending:
            self.loading[h] = handle
        self.pending.clear()

    def _loaded(self, plan: LoadPlan) -> None:
        """A load completed (failed: its L1 pages hold unknown bytes; the cache stops serving):
        each item's load pin is released."""
        filled = set(plan.device)
        for h in [h for h in self.loading if self.l1[h] in filled]:
            del self.loading[h]
            self.unpin(h)

    def holding(self, hashes: list[PageHash]) -> list[bool]:
        """Whether each item is on some tier (L3: listed; its bytes are verified by ``take``).
        An item this store put in L3 that L3 no longer lists is recorded as gone (``take_gone``)."""
        out = [h in self.l1 or h in self.l2 for h in hashes]
        rest = [i for i, ok in enumerate(out) if not ok]
        if rest and self.storage is not None:
            for i, ok in zip(rest, self.storage.exists([self.l3_key(hashes[i]) for i in rest])):
                out[i] = ok
                if not ok and hashes[i] in self.stored:
                    self._lose(hashes[i])  # L3 evicted it (its own capacity policy)
        return out

    # ------------------------------------------------------------- tiers
    def _alloc_l2(self) -> HostPageId | None:
        a = self.host.allocator
        if a.num_free < 1:
            self.evict_l2(1)
        return HostPageId(a.alloc(1)[0]) if a.num_free else None

    def _to_l2(self, h: PageHash) -> None:
        """Index item ``h`` on a new L2 page and plan its L1 -> L2 copy (both ids held until it
        completes; the item stays on L1 meanwhile). L2 full of nothing evictable: L1 only."""
        hid = self._alloc_l2()
        if hid is None:
            self.moves.backup_dropped_pages += 1
            return
        dev = self.l1[h]
        self.l2[h] = hid
        self._copying[h] = hid
        self._backing[hid] = (h, dev)
        self._held_l1[dev] += 1
        self._held_l2[hid] += 1
        self._plans.append(BackupPlan(None, [dev], [hid], False, True, group=self.group))

    def _store(self, h: PageHash) -> None:
        """Plan the L2 -> L3 write of item ``h`` once its L2 copy is complete."""
        key = self.l3_key(h)
        if self.storage is None or h in self.stored or key in self._storing or h in self._copying:
            return
        hid = self.l2[h]
        self._storing[key] = (h, hid)
        self._held_l2[hid] += 1
        self._plans.append(StorePlan(None, [hid], [key], group=self.group))

    def fetch(self, hashes: list[PageHash]) -> int:
        """Plan one L3 -> L2 fetch of the items of ``hashes`` no tier above L3 holds (the codec
        checks each: a corrupt or foreign object is a miss); ``take`` finds them on L2 once
        it completed. Returns how many it asks for (0: no L3, or no L2 room)."""
        busy = set(self._fetching.values())
        want = [h for h in dict.fromkeys(hashes) if h not in self.l1 and h not in self.l2 and h not in busy]
        if self.storage is None or not want:
            return 0
        host = []
        for h in want:
            hid = self._alloc_l2()
            if hid is None:
                break
            self._fetching[hid] = h
            host.append(hid)
        if host:
            keys = [self.l3_key(h) for h in want[:len(host)]]
            self._plans.append(PrefetchPlan(b"", "", 0, host, keys, group=self.group))
        return len(host)

    def take_plans(self) -> list[GroupPlan]:
        """The plans prepared since the last call, for the caller to submit (mutates)."""
        out, self._plans = self._plans, []
        return out

    def complete(self, plan: GroupPlan, ok: bool, pages: int) -> list[GroupPlan]:
        """Record what a submitted plan of this group did (exactly once per plan, also when it
        failed) and release what it held; returns the plans that follow (an L2 copy on to L3)."""
        if isinstance(plan, LoadPlan):
            self._loaded(plan)
        elif isinstance(plan, BackupPlan):
            self._backed_up(plan.host[0], ok)
        elif isinstance(plan, StorePlan):
            self._stored(plan.hashes[0], ok and pages == 1)
        else:
            self._fetched_from_l3(plan, ok, pages)
        return self.take_plans()

    def _backed_up(self, hid: HostPageId, ok: bool) -> None:
        h, dev = self._backing.pop(hid)
        self._release(dev, hid)
        if self._copying.get(h) != hid:
            return  # dropped meanwhile: its ids were orphans, freed by the release
        del self._copying[h]
        if ok:
            self.moves.backup_pages += 1
            self._store(h)
            return
        self.moves.transfer_errors += 1
        self._free_l2(self.l2.pop(h))  # unknown bytes: not an L2 copy
        if h not in self.l1 and h not in self.stored:
            self._lose(h)

    def _stored(self, key: bytes, ok: bool) -> None:
        h, hid = self._storing.pop(key)
        self._release(None, hid)
        self.moves.storage_put_pages += ok
        self.moves.storage_put_dropped_pages += not ok
        if ok and self.l2.get(h) == hid:
            self.stored.add(h)
        elif ok and self.storage is not None:
            self.storage.delete([key])  # dropped while it was written
            if h in self.l2:
                self._store(h)  # and kept again meanwhile

    def _fetched_from_l3(self, plan: PrefetchPlan, ok: bool, pages: int) -> None:
        landed = pages if ok else 0
        for i, hid in enumerate(plan.host):
            h = self._fetching.pop(hid)
            wanted = (h in self.need or h in self.pins) and h not in self.l1 and h not in self.l2
            if i < landed and wanted:
                self.l2[h] = hid
                self._fetched.add(h)
                self.moves.prefetch_pages += 1
                continue
            self.host.allocator.free([hid])
            if ok and i == landed:
                self._lose(h)  # a miss, corrupt or foreign: L3 no longer holds it

    def _release(self, dev: DevicePageId | None, hid: HostPageId) -> None:
        """A job completed: its ids are free again for the index (orphans: freed now)."""
        for held, orphans, i, alloc in ((self._held_l1, self._orphans_l1, dev, self.device.allocator),
                                        (self._held_l2, self._orphans_l2, hid, self.host.allocator)):
            if i is None:
                continue
            held[i] -= 1
            if not held[i]:
                del held[i]
                if i in orphans:
                    orphans.discard(i)
                    alloc.free([i])

    def _free_l1(self, dev: DevicePageId) -> None:
        if dev in self._held_l1:
            self._orphans_l1.add(dev)
        else:
            self.device.allocator.free([dev])

    def _free_l2(self, hid: HostPageId) -> None:
        if hid in self._held_l2:
            self._orphans_l2.add(hid)
        else:
            self.host.allocator.free([hid])

    def copies_in_flight(self) -> bool:
        """Some L1 -> L2 copy of this group is in flight (its items cannot leave L1 until it completes)."""
        return bool(self._backing)

    def in_flight(self) -> int:
        """Plans of this group prepared or submitted and not yet completed."""
        return len(self._plans) + len(self._backing) + len(self._fetching) + len(self._storing)

    def evict_l1(self, n: int) -> int:
        """Drop up to ``n`` unpinned L1 copies, least recently used first; returns how many."""
        victims = [h for h in self.l1 if h not in self.pins and h not in self._copying][:n]
        for h in victims:
            self._free_l1(self.l1.pop(h))
            if h not in self.l2 and h not in self.stored:
                self._lose(h)
        return len(victims)

    def evict_l2(self, n: int) -> int:
        """Drop up to ``n`` L2 copies, least recently used first; returns how many."""
        victims = [h for h, hid in self.l2.items() if h not in self.pending and h not in self.loading
                   and hid not in self._held_l2][:n]  # (a copy or a write in flight holds its L2 page)
        for h in victims:
            self._free_l2(self.l2.pop(h))
            if h not in self.l1 and h not in self.stored:
                self._lose(h)
        return len(victims)

    def _lose(self, h: PageHash) -> None:
        """Item ``h`` is on no tier any more (not dropped: some boundary may still need it)."""
        self.stored.discard(h)
        if h in self.l1 or h in self.l2:
            return
        self._lost += 1
        if h in self.need:
            self._gone.add(h)

    def lost(self, h: PageHash) -> bool:
        """Item ``h`` is needed but left every tier (not yet handed out by ``take_gone``)."""
        return h in self._gone

    def take_gone(self) -> set[PageHash]:
        """The items some boundary needs that left every tier since the last call (the
        caller forgets those boundaries, which drops the items' counts). Mutates."""
        out, self._gone = self._gone, set()
        return out

    def _drop_if_unused(self, h: PageHash) -> None:
        if h in self.need or h in self.pins:
            return
        self._gone.discard(h)
        self._copying.pop(h, None)  # a backup in flight completes into orphans
        if h in self.l1:
            self._free_l1(self.l1.pop(h))
        if h in self.l2:
            self._free_l2(self.l2.pop(h))
        if h in self.stored and self.storage is not None:
            self.storage.delete([self.l3_key(h)])
        self.stored.discard(h)
        self._dropped += 1

    def l3_key(self, h: PageHash) -> bytes:
        """The L3 key of item ``h``: derived from the group's name, so that it never equals
        the key of a full-attention page or another group's item with the same hash, even
        where a backend names objects by key alone (file://)."""
        return hashlib.blake2b(b"hicache-group\0" + self.name.encode() + b"\0" + h, digest_size=16).digest()

    # ------------------------------------------------------------- reports
    def counts(self) -> TierCounts:
        return TierCounts(len(self.l1), len(self.l2), len(self.stored))

    def stats(self) -> GroupStats:
        return GroupStats(*self._taken, self._dropped, self._lost)

    def check_integrity(self) -> None:
        """Pools, accounting (free + indexed + private == capacity, no id twice) and the
        record: every indexed item is needed by a boundary or pinned by a request."""
        self.device.check_integrity()
        self.host.check_integrity()
        ids = list(self.l1.values())
        if len(set(ids)) != len(ids) or set(ids) & self.private:
            raise IntegrityError(f"{self.name}: an L1 id is held twice (indexed {sorted(ids)}, "
                                 f"private {sorted(self.private)})")
        if len(ids) + len(self.private) + len(self._orphans_l1) != self.device.allocator.num_used:
            raise IntegrityError(f"{self.name}: L1 holds {len(ids)} items + {len(self.private)} private pages "
                                 f"+ {len(self._orphans_l1)} held by copies but {self.device.allocator.num_used} "
                                 "are allocated")
        moving = len(self._fetching) + len(self._orphans_l2)
        if len(set(self.l2.values())) != len(self.l2) or len(self.l2) + moving != self.host.allocator.num_used:
            raise IntegrityError(f"{self.name}: L2 holds {len(self.l2)} items and {moving} copies in flight but "
                                 f"{self.host.allocator.num_used} pages are allocated")
        for h in [*self.l1, *self.l2, *self.stored]:
            if h not in self.need and h not in self.pins:
                raise IntegrityError(f"{self.name}: item {h.hex()} is held but no boundary needs it "
                                     "and no request reads it")
        held = [h for h in self._gone if h in self.l1 or h in self.l2 or h in self.stored]
        if held:
            raise IntegrityError(f"{self.name}: items {[h.hex()[:8] for h in held]} are listed as gone from "
                                 "every tier but are held")
        if any(h not in self.l1 for h in self.pins) or any(v < 1 for v in [*self.pins.values(),
                                                                          *self.need.values()]):
            raise IntegrityError(f"{self.name}: a pinned item is not on L1, or a count is below 1")
        self._check_loads()
        if self.storage is not None:
            self.storage.check_integrity()

    def _check_loads(self) -> None:
        """Each load in flight (pending or started) reads the item's L2 page into its L1 page,
        both indexed, and pins it."""
        both = set(self.pending) & set(self.loading)
        if both:
            raise IntegrityError(f"{self.name}: items {[h.hex()[:8] for h in both]} are pending and loading")
        bad = [h for h, (hid, dev) in self.pending.items() if self.l2.get(h) != hid or self.l1.get(h) != dev]
        bad += [h for h in self.loading if h not in self.l1 or h not in self.l2]
        bad += [h for h in [*self.pending, *self.loading] if self.pins.get(h, 0) < 1]
        if bad:
            raise IntegrityError(f"{self.name}: loads of items {[h.hex()[:8] for h in bad]} do not hold their L2 "
                                 "source, their L1 page or a pin")
