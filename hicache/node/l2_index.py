"""The service's L2 index: which host pages hold which page hashes, who holds what.

Keyed by chained page hash: since a page's hash covers its whole prefix, "the
leading pages present" is a correct prefix lookup with a dict, no tree needed.

Every host page is in exactly one state:

* free (in the allocator),
* reserved by one owner (a client connection) that is writing it,
* committed: indexed under its hash, lookup-able; it may be acquired (locked
  for reading) by any number of owners, and is evictable only while unlocked.

Owners (connections) belong to clients (the server: a peer process). A client may
hold at most ``client_pages`` pages reserved or acquired at once, across its
owners, so that one client cannot pin the whole pool and starve the others.
"""
from __future__ import annotations

from collections import Counter, OrderedDict, deque
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol, Sequence

from hicache.memory.allocator import PageAllocator
from hicache.core.errors import ForeignPage, IntegrityError, OutOfPages, ServiceError
from hicache.core.hashing import HASH_BYTES
from hicache.client.protocol import CommitResult
from hicache.node.snapshot import EventKind, EventLog, Taken
from hicache.core.types import HostPageId, PageHash

OwnerId = int
ClientKey = str  # who a share of pages is counted for ("pid 1234"); named in refusals


class PageJournal(Protocol):
    """Mirrors committed pages outside the process (the segment's page table)."""

    def committed(self, page: int, h: PageHash, draft: bool) -> None:
        """``page`` now holds ``h`` (``draft``: its draft rows are valid)."""

    def dropped(self, page: int) -> None:
        """``page`` left the index; called before the page is freed."""


@dataclass(slots=True)
class _Owner:
    client: ClientKey | None = None  # whose share its pages count against (None: no cap, e.g. the L3 writer)
    reserved: set[int] = field(default_factory=set)  # page ids written, not yet committed
    acquired: dict[PageHash, int] = field(default_factory=dict)  # page hash -> acquisitions (> 0)

    @property
    def held(self) -> int:
        """Pages this owner keeps from eviction and reuse: reserved, and acquired (distinct)."""
        return len(self.reserved) + len(self.acquired)


class Reclaimed(NamedTuple):
    reserved: int  # reserved pages returned to free
    acquired: int  # acquisitions dropped (counted per acquire)


@dataclass(slots=True)
class IndexCounters:
    """Monotonic counters since start (pages unless named otherwise)."""

    lookups: int = 0  # lookup calls
    hits: int = 0  # pages found by lookups
    misses: int = 0  # pages asked for and not found (up to the first miss and after)
    evictions: int = 0
    reservations: int = 0  # pages reserved
    commits: int = 0  # pages inserted by commits
    acquired: int = 0  # pages locked by acquire calls (each one is read out of L2 by a client)
    flushed: int = 0  # pages dropped by flush()
    duplicates: int = 0
    cancelled: int = 0
    reclaimed: int = 0  # reserved pages and acquisitions taken back from dead owners
    draft_cut_pages: int = 0  # present pages a need_draft lookup/acquire did not return (draft rows missing)
    draft_upgraded: int = 0  # draft-incomplete pages replaced by a complete copy


class L2Index:
    """Page-hash index, LRU eviction and per-owner holdings over one allocator.

    Hot paths (``lookup``, ``acquire``) run as C-level ``map`` calls over the
    request's hashes: a lookup of an 8K-token prompt is 512 of them.

    Eviction is LRU over unlocked committed pages. The recency order holds every
    committed page; eviction passes over a locked page by moving it to the recent
    end (it is in use). A chain's pages enter the order deepest first (and a
    lookup or release refreshes them deepest first), so a prefix loses its tail
    before its head and the survivors stay lookup-able.

    Draft validity: a committed page may lack valid draft-model rows (an engine
    that does not run its draft head commits target planes only).
    ``commit(..., draft_pages=k)`` says which leading pages are complete;
    ``lookup``/``acquire``/``peek*`` with ``need_draft=True`` stop at the first
    incomplete page, as an embedded cache's ``match(need_draft=True)`` does. A
    later commit of a complete copy upgrades an incomplete page in place of it
    (unless the page is acquired: then the copy is a duplicate).

    A ``PageJournal`` (optional) is told which page holds which committed hash,
    so that a restarted server can adopt the segment (``restore``).

    KV events: the index records pages entering and leaving it in a bounded
    ``EventLog`` (``hicache.node.snapshot``); its owner pulls them with
    ``take_events()`` (the server does after every request, feeding its L3
    writer and the REST event stream). Nothing is called back.

    Not thread-safe: the server touches it only from its event loop thread. The
    one exception is ``generation(page)``, a single list read that any thread may
    make (the L3 writer uses it as a seqlock, see ``hicache.node.l3_tier``).
    """

    def __init__(self, allocator: PageAllocator, journal: PageJournal | None = None,
                 max_events: int | None = None, client_pages: int | None = None, share_setting: str = ""):
        """``max_events``: how many KV events wait for ``take_events`` before new
        ones are dropped (default: four times the pages, at least 1024; enough for
        whatever one call records, so an owner that takes after each call loses none).
        ``client_pages``: the most pages one client may hold reserved or acquired at
        once (None: no cap); ``share_setting`` names where it was set, for refusals."""
        self.allocator = allocator
        self.client_pages = client_pages
        self.share_setting = share_setting
        self._held: Counter[ClientKey] = Counter()  # pages held per capped client, over its owners
        self.journal = journal
        self._events = EventLog(max_events if max_events is not None else max(1024, 4 * allocator.capacity))
        self._incomplete: set[PageHash] = set()  # committed hashes whose page lacks valid draft rows
        self._page_of: dict[PageHash, HostPageId] = {}  # committed hash -> its page
        self._hash_of: dict[int, PageHash] = {}  # committed page id -> its hash
        self._refs: dict[PageHash, int] = {}  # locked (acquired) hashes -> acquisitions, all owners
        self._lru: OrderedDict[PageHash, None] = OrderedDict()  # every committed hash, oldest first
        self._owners: dict[OwnerId, _Owner] = {}
        # Per page id: bumped whenever a committed page leaves the index, so
        # "same generation" means "still holds the bytes committed under its hash".
        self._gen: list[int] = [0] * allocator.capacity
        self.counters = IndexCounters()

    # ---------------------------------------------------------------- owners
    def add_owner(self, owner: OwnerId, client: ClientKey | None = None) -> None:
        """Register ``owner``; its pages count against ``client``'s share (None: no cap)."""
        if owner in self._owners:
            raise IntegrityError(f"L2 index: owner {owner!r} is already registered (owner ids are never reused)")
        self._owners[owner] = _Owner(client if self.client_pages is not None else None)

    def drop_owner(self, owner: OwnerId) -> Reclaimed:
        """Forget ``owner``: free its uncommitted reservations, drop its acquisitions."""
        o = self._owners.pop(owner)
        self._count(o, -o.held)
        if o.reserved:
            self.allocator.free(o.reserved)
        for h, n in reversed(o.acquired.items()):  # deepest first
            self._unref(h, n)
        out = Reclaimed(len(o.reserved), sum(o.acquired.values()))
        self.counters.reclaimed += out.reserved + out.acquired
        return out

    @property
    def num_owners(self) -> int:
        return len(self._owners)

    # ----------------------------------------------------------------- reads
    def lookup(self, hashes: Sequence[PageHash], need_draft: bool = False) -> list[HostPageId]:
        """Host pages of the leading present ``hashes`` (``need_draft``: and
        draft-complete); refreshes their recency."""
        pages = self._leading(hashes, need_draft)
        c = self.counters
        c.lookups += 1
        c.hits += len(pages)
        c.misses += len(hashes) - len(pages)
        deque(map(self._lru.move_to_end, reversed(hashes[:len(pages)])), maxlen=0)
        return pages

    def peek(self, hashes: Sequence[PageHash], need_draft: bool = False) -> int:
        """How many leading ``hashes`` are present. Mutates nothing (no recency, no counters)."""
        return len(self._leading(hashes, need_draft, count=False))

    def peek_pages(self, hashes: Sequence[PageHash], need_draft: bool = False) -> list[HostPageId]:
        """Pages of the leading present ``hashes``. Mutates nothing (no recency, no counters)."""
        return self._leading(hashes, need_draft, count=False)

    def draft_complete(self, h: PageHash) -> bool:
        """Whether committed ``h``'s page has valid draft rows. Mutates nothing."""
        return h not in self._incomplete

    def page_of(self, h: PageHash) -> HostPageId | None:
        """The committed page holding ``h``, or None. Mutates nothing."""
        return self._page_of.get(h)

    def generation(self, page: int) -> int:
        """How many times committed page ``page`` has left the index (evicted or
        flushed). Safe from any thread: an unchanged value across a copy of the
        page proves the copy holds the committed bytes (committed pages are
        never written; a page is only rewritten after it left the index)."""
        return self._gen[page]

    def _leading(self, hashes: Sequence[PageHash], need_draft: bool = False,
                 count: bool = True) -> list[HostPageId]:
        """Pages of the leading present (and, with ``need_draft``, draft-complete)
        hashes; validates the rest (a hit is a valid hash)."""
        pages = self._present(hashes)
        if need_draft and self._incomplete and pages:
            cut = next((i for i, h in enumerate(hashes[:len(pages)]) if h in self._incomplete), len(pages))
            if count:
                self.counters.draft_cut_pages += len(pages) - cut
            del pages[cut:]
        return pages

    def _present(self, hashes: Sequence[PageHash]) -> list[HostPageId]:
        if not isinstance(hashes, (list, tuple)):
            raise ServiceError("bad_args", f"expected a list of page hashes, got {type(hashes).__name__}")
        try:
            pages = list(map(self._page_of.get, hashes))
        except TypeError:  # an unhashable element
            _check_hashes(hashes)
            raise AssertionError("unreachable: _check_hashes raises") from None
        try:
            k = pages.index(None)
        except ValueError:
            return pages
        _check_hashes(hashes[k:])
        del pages[k:]
        return pages

    # ---------------------------------------------------------------- writes
    def reserve(self, owner: OwnerId, n: int) -> list[HostPageId]:
        """``n`` pages for ``owner`` to write, evicting LRU pages if needed.

        Raises ``OutOfPages`` (reserving nothing) when even evicting every
        unlocked committed page would not free ``n``.
        """
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise ServiceError("bad_args", f"reserve needs an integer n >= 0, got {n!r}")
        o = self._owners[owner]
        room = self._room(o)
        if room is not None and n > room:
            raise OutOfPages(f"L2: client {o.client} asked for {n} pages and holds {self._held[o.client]} "
                             f"(reserved or acquired); one client may hold at most {self.client_pages} of the "
                             f"{self.allocator.capacity} at once ({self.share_setting}), so that others are "
                             "served; commit, cancel or release pages first")
        evictable = len(self._lru) - len(self._refs)
        short = n - self.allocator.num_free
        if short > evictable:
            raise OutOfPages(f"L2: asked for {n} pages; {self.allocator.num_free} free and "
                             f"{evictable} evictable of {self.allocator.capacity} "
                             "(the rest are reserved or acquired); release pages or enlarge pool.host_pages")
        if short > 0:
            gone = [self._evict_one() for _ in range(short)]
            self._events.record(EventKind.REMOVED, "L2", [(h, None) for h in gone])
        pages = self.allocator.alloc(n)
        o.reserved.update(pages)
        self._count(o, n)
        self.counters.reservations += n
        return pages  # HostPageId is a NewType: no runtime wrapping

    def _evict_one(self) -> PageHash:
        lru, refs = self._lru, self._refs
        while True:
            h, _ = lru.popitem(last=False)
            if h not in refs:
                break
            lru[h] = None  # locked: in use, so recent; reserve() checked that one is unlocked
        self._drop_entry(h)
        self.counters.evictions += 1
        return h

    def _drop_entry(self, h: PageHash) -> None:
        if h in self._refs:
            raise IntegrityError(f"L2 index: dropping page {h.hex()} while {self._refs[h]} holders use it")
        page = self._page_of.pop(h)
        del self._hash_of[page]
        self._incomplete.discard(h)
        if self.journal is not None:
            self.journal.dropped(page)
        self._gen[page] += 1  # before free: a reader that sees the old value read the old bytes
        self.allocator.free([page])

    def flush(self) -> int:
        """Drop every unlocked committed page (acquired pages stay); returns how many."""
        gone = [h for h in self._lru if h not in self._refs]
        for h in gone:
            del self._lru[h]
            self._drop_entry(h)
        self.counters.flushed += len(gone)
        if gone:
            self._events.record(EventKind.REMOVED, "L2", [(h, None) for h in gone])
        return len(gone)

    def commit(self, owner: OwnerId, hashes: Sequence[PageHash], pages: Sequence[int],
               draft_pages: int | None = None) -> CommitResult:
        """Index reserved ``pages`` under ``hashes`` (same order); all or nothing.

        ``draft_pages``: the leading pages whose draft rows are valid (None: all).
        A hash already present (or repeated in this call) keeps its existing
        page and the newly written page goes back to free, except that a
        complete copy replaces an unlocked draft-incomplete page (the old page
        is freed instead; counted as a duplicate and in ``draft_upgraded``).
        """
        _check_hashes(hashes)
        o = self._owners[owner]
        self._check_reserved(o, pages, "commit")
        if len(hashes) != len(pages):
            raise ServiceError("bad_args", f"commit got {len(hashes)} hashes but {len(pages)} pages; "
                               "pass one page id per hash")
        n_complete = len(hashes) if draft_pages is None else draft_pages
        if not isinstance(n_complete, int) or isinstance(n_complete, bool) or not 0 <= n_complete <= len(hashes):
            raise ServiceError("bad_args", f"commit: draft_pages={draft_pages!r} must be an integer in "
                               f"[0, {len(hashes)}] (the leading pages with valid draft rows)")
        dup_pages, inserted, upgraded, j = [], [], [], self.journal
        for i, (h, p) in enumerate(zip(hashes, pages)):
            o.reserved.discard(p)
            complete = i < n_complete
            if h in self._page_of:
                if complete and h in self._incomplete and h not in self._refs:
                    dup_pages.append(self._upgrade(h, p))
                    upgraded.append(h)
                else:
                    dup_pages.append(p)
                continue
            if not complete:
                self._incomplete.add(h)
            if j is not None:
                j.committed(p, h, complete)
            self._page_of[h] = p
            self._hash_of[p] = h
            inserted.append(h)
        self._count(o, -len(pages))  # none of them is reserved any more
        for h in reversed(inserted):  # deepest first: evicted before its parents
            self._lru[h] = None
        if dup_pages:
            self.allocator.free(dup_pages)
        c = self.counters
        c.commits += len(inserted)
        c.duplicates += len(dup_pages)
        if inserted or upgraded:
            # Newly lookup-able pages head first, then pages whose draft-incomplete copy a
            # complete one replaced (the L3 writer stores those now). The parent is the
            # previous hash of the same commit, or None for its first page.
            prev: dict[PageHash, PageHash | None] = {}
            for i, h in enumerate(hashes):
                prev.setdefault(h, hashes[i - 1] if i else None)
            self._events.record(EventKind.STORED, "L2", [(h, prev[h]) for h in inserted + upgraded], owner)
        return CommitResult(len(inserted), len(dup_pages))

    def _upgrade(self, h: PageHash, p: int) -> int:
        """Move ``h`` onto its complete copy ``p``; returns the old page (to free)."""
        old = self._page_of[h]
        if self.journal is not None:
            self.journal.dropped(old)
            self.journal.committed(p, h, True)
        self._page_of[h] = p
        del self._hash_of[old]
        self._hash_of[p] = h
        self._gen[old] += 1  # it left the index: an L3 copy in flight of it is stale
        self._incomplete.discard(h)
        self._lru.move_to_end(h)
        self.counters.draft_upgraded += 1
        return old

    def restore(self, entries: Sequence[tuple[int, PageHash, bool]]) -> int:
        """Rebuild the committed pages of an adopted segment from ``(page, hash,
        draft complete)``; the index must be empty (no owners, nothing allocated).
        Entries with a bad page id, a malformed hash or a hash seen before are
        skipped. Returns how many pages were restored."""
        assert not self._owners and self.allocator.num_used == 0, "restore() needs a fresh index"
        cap = self.allocator.capacity
        keep: dict[int, tuple[PageHash, bool]] = {}
        seen: set[PageHash] = set()
        for p, h, draft in entries:
            if not 0 <= p < cap:
                continue
            if p not in keep and isinstance(h, bytes) and len(h) == HASH_BYTES and h not in seen:
                keep[p] = (h, draft)
                seen.add(h)
            elif self.journal is not None and keep.get(p, (None,))[0] != h:
                self.journal.dropped(p)  # not restored: its entry must not claim the page
        every = self.allocator.alloc(cap)
        self.allocator.free([p for p in every if p not in keep])
        for p, (h, draft) in sorted(keep.items()):
            self._page_of[h] = p
            self._hash_of[p] = h
            self._lru[h] = None
            if not draft:
                self._incomplete.add(h)
        return len(keep)

    def cancel(self, owner: OwnerId, pages: Sequence[int]) -> None:
        """Give reserved, unwritten ``pages`` back; all or nothing."""
        o = self._owners[owner]
        self._check_reserved(o, pages, "cancel")
        o.reserved.difference_update(pages)
        self._count(o, -len(pages))
        self.allocator.free(pages)
        self.counters.cancelled += len(pages)

    def check_reserved(self, owner: OwnerId, pages: Sequence[int], op: str) -> None:
        """Raise as ``op`` would when ``pages`` are not all reserved by ``owner``; mutates nothing."""
        self._check_reserved(self._owners[owner], pages, op)

    def _check_reserved(self, o: _Owner, pages: Sequence[int], op: str) -> None:
        if not isinstance(pages, (list, tuple)):
            raise ServiceError("bad_args", f"{op} needs a list of page ids, got {type(pages).__name__}")
        cap = self.allocator.capacity
        seen = set()
        for p in pages:
            if not isinstance(p, int) or isinstance(p, bool) or not 0 <= p < cap:
                raise ForeignPage(f"{op}: page id {p!r} is not in [0, {cap})")
            if p not in o.reserved or p in seen:
                raise ServiceError("not_reserved", f"{op}: page {p} is not reserved by this client "
                                   "(or is listed twice); reserve pages first and commit each once")
            seen.add(p)

    # ----------------------------------------------------------------- locks
    def acquire(self, owner: OwnerId, hashes: Sequence[PageHash], need_draft: bool = False) -> list[HostPageId]:
        """Lock the leading present (``need_draft``: and draft-complete) ``hashes``
        against eviction; returns their pages.

        The result may be shorter than ``hashes`` (pages evicted since a lookup, or
        past what the client's share lets it hold); only the returned prefix is
        locked, and must be released by hash.
        """
        pages = self._leading(hashes, need_draft)
        o = self._owners[owner]
        refs, mine = self._refs, o.acquired
        room = self._room(o)
        if room is not None and room < len(pages):  # only then can the share cut the prefix
            del pages[_within(hashes, len(pages), mine, room):]
        new = 0
        for h in hashes[:len(pages)]:
            refs[h] = refs.get(h, 0) + 1
            n = mine.get(h, 0)
            new += not n
            mine[h] = n + 1
        self._count(o, new)
        self.counters.acquired += len(pages)
        return pages

    def release(self, owner: OwnerId, hashes: Sequence[PageHash]) -> None:
        """Undo one acquisition per listed hash; all or nothing."""
        if not isinstance(hashes, (list, tuple)):
            raise ServiceError("bad_args", f"expected a list of page hashes, got {type(hashes).__name__}")
        mine = self._owners[owner].acquired
        try:
            want = Counter(hashes)
        except TypeError:  # an unhashable element
            _check_hashes(hashes)
            raise AssertionError("unreachable: _check_hashes raises") from None
        for h, n in want.items():
            if mine.get(h, 0) < n:
                _check_hashes([h])  # a malformed hash is bad_args, not "not acquired"
                raise ServiceError("not_acquired", f"release of page hash {h.hex()} x{n}, but this "
                                   f"client holds {mine.get(h, 0)} acquisition(s) of it")
        o = self._owners[owner]
        for h, n in reversed(want.items()):  # deepest first
            left = mine[h] - n
            if left:
                mine[h] = left
            else:
                del mine[h]
                self._count(o, -1)
            self._unref(h, n)

    def _room(self, o: _Owner) -> int | None:
        """Pages ``o``'s client may still take (None: no cap)."""
        if o.client is None or self.client_pages is None:  # add_owner keeps a client only under a cap
            return None
        return max(0, self.client_pages - self._held[o.client])

    def _count(self, o: _Owner, delta: int) -> None:
        if o.client is not None and delta:
            left = self._held[o.client] + delta
            if left < 0:
                raise IntegrityError(f"client {o.client} would hold {left} pages: a release without its reserve")
            if left:
                self._held[o.client] = left
            else:
                del self._held[o.client]

    def held_by(self, client: ClientKey) -> int:
        """Pages ``client`` holds reserved or acquired (0 when uncapped or unknown). Mutates nothing."""
        return self._held.get(client, 0)

    def _unref(self, h: PageHash, n: int) -> None:
        left = self._refs[h] - n
        if left < 0:
            raise IntegrityError(f"L2 index: releasing {n} holds of page {h.hex()}, which has {self._refs[h]}")
        if left:
            self._refs[h] = left
            return
        del self._refs[h]
        # Just used, so most recent. Callers unref a chain deepest first, so
        # its head ends up most recent and is evicted last.
        self._lru.move_to_end(h)

    # ----------------------------------------------------------------- state
    @property
    def num_committed(self) -> int:
        return len(self._page_of)

    @property
    def num_reserved(self) -> int:
        return sum(len(o.reserved) for o in self._owners.values())

    @property
    def num_locked(self) -> int:
        return len(self._refs)

    @property
    def num_evictable(self) -> int:
        """Committed pages ``reserve`` may evict now (those nobody has acquired)."""
        return len(self._lru) - len(self._refs)

    def take_events(self) -> Taken:
        """KV events recorded since the previous call, oldest first, and how many a full
        log dropped meanwhile; clears them. STORED: ``(hash, parent)`` of pages that
        became lookup-able (``owner``: whose commit), then of draft upgrades; REMOVED:
        pages evicted or flushed."""
        return self._events.take()

    def committed_pages(self) -> dict[int, tuple[PageHash, bool]]:
        """``{page: (hash, draft complete)}`` of every committed page (a fresh dict)."""
        return {p: (h, h not in self._incomplete) for h, p in self._page_of.items()}

    def check_integrity(self) -> None:
        """Every page is free, reserved by one owner, or committed once; refs balance;
        the event log is bounded and balanced."""
        self.allocator.check_integrity()
        self._events.check_integrity()
        reserved: set[int] = set()
        for oid, o in self._owners.items():
            if reserved & o.reserved:
                raise IntegrityError(f"owner {oid} shares reserved pages {sorted(reserved & o.reserved)}")
            reserved |= o.reserved
        committed = set(self._hash_of)
        if len(committed) != len(self._page_of) or set(self._lru) != set(self._page_of):
            raise IntegrityError(f"{len(self._page_of)} committed hashes, {len(committed)} committed "
                                 f"pages, {len(self._lru)} in the recency order: they must agree")
        for h, p in self._page_of.items():
            if self._hash_of.get(p) != h:
                raise IntegrityError(f"hash {h.hex()} -> page {p}, page maps back to {self._hash_of.get(p)!r}")
        if reserved & committed:
            raise IntegrityError(f"pages both reserved and committed: {sorted(reserved & committed)}")
        for p in reserved | committed:
            if not self.allocator.is_allocated(p):
                raise IntegrityError(f"page {p} is held but free in the allocator")
        if len(reserved) + len(committed) != self.allocator.num_used:
            raise IntegrityError(f"reserved {len(reserved)} + committed {len(committed)} != "
                                 f"allocated {self.allocator.num_used}")
        owned: Counter = Counter()
        for o in self._owners.values():
            owned.update(o.acquired)
        if +owned != owned or dict(owned) != self._refs:
            bad = {h.hex(): (owned.get(h), self._refs.get(h)) for h in set(owned) | set(self._refs)
                   if owned.get(h) != self._refs.get(h)}
            raise IntegrityError(f"acquisitions held by owners vs locks (hash: owners, index): {bad}")
        for h in self._refs:
            if h not in self._page_of:
                raise IntegrityError(f"locked hash {h.hex()} is not committed")
        held: Counter[ClientKey] = Counter()
        for o in self._owners.values():
            if o.client is not None:
                held[o.client] += o.held
        if +held != self._held:
            raise IntegrityError(f"pages held per client: owners say {dict(+held)}, the counts {dict(self._held)}")
        if self.client_pages is not None and any(n > self.client_pages for n in held.values()):
            raise IntegrityError(f"a client holds more than its {self.client_pages} pages: {dict(+held)}")
        if not self._incomplete <= self._page_of.keys():
            raise IntegrityError(f"{len(self._incomplete - self._page_of.keys())} draft-incomplete hashes "
                                 "are not committed")


def _within(hashes: Sequence[PageHash], present: int, mine: dict[PageHash, int], room: int) -> int:
    """How many of the ``present`` leading ``hashes`` an owner already holding ``mine``
    may acquire while taking at most ``room`` more distinct pages."""
    new: set[PageHash] = set()
    for i, h in enumerate(hashes[:present]):
        if h not in mine and h not in new:
            if len(new) == room:
                return i
            new.add(h)
    return present


def _check_hashes(hashes: Sequence[PageHash]) -> None:
    if not isinstance(hashes, (list, tuple)):
        raise ServiceError("bad_args", f"expected a list of page hashes, got {type(hashes).__name__}")
    for h in hashes:
        if not isinstance(h, bytes) or len(h) != HASH_BYTES:
            raise ServiceError("bad_args", f"page hash {h!r:.60} must be {HASH_BYTES} raw bytes "
                               "(hicache.core.hashing.page_hashes)")
