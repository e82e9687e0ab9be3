"""The service's L2 index: which host pages hold which page hashes, who holds what.

Keyed by chained page hash: since a page's hash covers its whole prefix, "the
leading pages present" is a correct prefix lookup with a dict, no tree needed.

Every host page is in exactly one state:

* free (in the allocator),
* reserved by one owner (a client connection) that is writing it,
* committed: indexed under its hash, lookup-able; it may be acquired (locked
  for reading) by any number of owners, and is evictable only while unlocked.

Eviction is LRU over unlocked committed pages. A chain's pages enter the LRU
order deepest first (and a lookup refreshes them deepest first), so a prefix
loses its tail before its head and the survivors stay lookup-able.

Not thread-safe: the server touches it only from its event loop thread.
"""
from __future__ import annotations

from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol, Sequence

from hicache.allocator import PageAllocator
from hicache.errors import ForeignPage, IntegrityError, OutOfPages, ServiceError
from hicache.hashing import HASH_BYTES
from hicache.types import HostPageId, PageHash

OwnerId = int


class L2Listener(Protocol):
    """Told about pages entering and leaving the index (KV events).

    Called on the index's thread, synchronously: implementations must not
    block and must not call back into the index.
    """

    def pages_stored(self, pages: Sequence[tuple[PageHash, PageHash | None]]) -> None:
        """``(page hash, parent hash)`` of newly lookup-able pages, head first.

        The parent is the previous hash of the same commit, or None for a
        commit's first page (the service does not know what preceded it).
        """

    def pages_removed(self, hashes: Sequence[PageHash]) -> None:
        """Pages that stopped being lookup-able (evicted or flushed)."""


@dataclass(slots=True)
class _Entry:
    page: HostPageId
    refs: int = 0  # acquisitions outstanding, over all owners


@dataclass(slots=True)
class _Owner:
    reserved: set[int] = field(default_factory=set)  # page ids written, not yet committed
    acquired: Counter = field(default_factory=Counter)  # page hash -> acquisitions


class CommitResult(NamedTuple):
    inserted: int  # pages that became lookup-able
    duplicates: int  # pages whose hash was already present; their page went back to free


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


class L2Index:
    """Page-hash index, LRU eviction and per-owner holdings over one allocator."""

    def __init__(self, allocator: PageAllocator, listener: L2Listener | None = None):
        self.allocator = allocator
        self.listener = listener
        self._entries: dict[PageHash, _Entry] = {}
        self._hash_of: dict[int, PageHash] = {}  # committed page id -> its hash
        self._lru: OrderedDict[PageHash, None] = OrderedDict()  # unlocked committed, oldest first
        self._owners: dict[OwnerId, _Owner] = {}
        self.counters = IndexCounters()

    # ---------------------------------------------------------------- owners
    def add_owner(self, owner: OwnerId) -> None:
        assert owner not in self._owners, owner
        self._owners[owner] = _Owner()

    def drop_owner(self, owner: OwnerId) -> Reclaimed:
        """Forget ``owner``: free its uncommitted reservations, drop its acquisitions."""
        o = self._owners.pop(owner)
        if o.reserved:
            self.allocator.free(o.reserved)
        for h, n in reversed(o.acquired.items()):
            self._unref(h, n)
        out = Reclaimed(len(o.reserved), sum(o.acquired.values()))
        self.counters.reclaimed += out.reserved + out.acquired
        return out

    @property
    def num_owners(self) -> int:
        return len(self._owners)

    # ----------------------------------------------------------------- reads
    def lookup(self, hashes: Sequence[PageHash]) -> list[HostPageId]:
        """Host pages of the leading present ``hashes``; refreshes their recency."""
        _check_hashes(hashes)
        pages = self._leading(hashes)
        c = self.counters
        c.lookups += 1
        c.hits += len(pages)
        c.misses += len(hashes) - len(pages)
        for h in reversed(hashes[:len(pages)]):
            if h in self._lru:
                self._lru.move_to_end(h)
        return pages

    def peek(self, hashes: Sequence[PageHash]) -> int:
        """How many leading ``hashes`` are present. Mutates nothing (no recency, no counters)."""
        _check_hashes(hashes)
        return len(self._leading(hashes))

    def _leading(self, hashes: Sequence[PageHash]) -> list[HostPageId]:
        out = []
        for h in hashes:
            e = self._entries.get(h)
            if e is None:
                break
            out.append(e.page)
        return out

    # ---------------------------------------------------------------- writes
    def reserve(self, owner: OwnerId, n: int) -> list[HostPageId]:
        """``n`` pages for ``owner`` to write, evicting LRU pages if needed.

        Raises ``OutOfPages`` (reserving nothing) when even evicting every
        unlocked committed page would not free ``n``.
        """
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise ServiceError("bad_args", f"reserve needs an integer n >= 0, got {n!r}")
        short = n - self.allocator.num_free
        if short > len(self._lru):
            raise OutOfPages(f"L2: asked for {n} pages; {self.allocator.num_free} free and "
                             f"{len(self._lru)} evictable of {self.allocator.capacity} "
                             "(the rest are reserved or acquired); release pages or enlarge pool.host_pages")
        for _ in range(max(short, 0)):
            self._evict_one()
        pages = self.allocator.alloc(n)
        self._owners[owner].reserved.update(pages)
        self.counters.reservations += n
        return [HostPageId(p) for p in pages]

    def _evict_one(self) -> None:
        h, _ = self._lru.popitem(last=False)
        self._drop_entry(h)
        self.counters.evictions += 1
        if self.listener is not None:
            self.listener.pages_removed([h])

    def _drop_entry(self, h: PageHash) -> None:
        e = self._entries.pop(h)
        assert e.refs == 0, (h, e)
        del self._hash_of[e.page]
        self.allocator.free([e.page])

    def flush(self) -> int:
        """Drop every unlocked committed page (acquired pages stay); returns how many."""
        gone = list(self._lru)
        self._lru.clear()
        for h in gone:
            self._drop_entry(h)
        self.counters.flushed += len(gone)
        if gone and self.listener is not None:
            self.listener.pages_removed(gone)
        return len(gone)

    def commit(self, owner: OwnerId, hashes: Sequence[PageHash], pages: Sequence[int]) -> CommitResult:
        """Index reserved ``pages`` under ``hashes`` (same order); all or nothing.

        A hash already present (or repeated in this call) keeps its existing
        page; the newly written page goes back to free.
        """
        _check_hashes(hashes)
        o = self._owners[owner]
        self._check_reserved(o, pages, "commit")
        if len(hashes) != len(pages):
            raise ServiceError("bad_args", f"commit got {len(hashes)} hashes but {len(pages)} pages; "
                               "pass one page id per hash")
        dup_pages, inserted = [], []
        for h, p in zip(hashes, pages):
            o.reserved.discard(p)
            if h in self._entries:
                dup_pages.append(p)
                continue
            self._entries[h] = _Entry(HostPageId(p))
            self._hash_of[p] = h
            inserted.append(h)
        for h in reversed(inserted):  # deepest first: evicted before its parents
            self._lru[h] = None
        if dup_pages:
            self.allocator.free(dup_pages)
        c = self.counters
        c.commits += len(inserted)
        c.duplicates += len(dup_pages)
        if inserted and self.listener is not None:
            prev: dict[PageHash, PageHash | None] = {}
            for i, h in enumerate(hashes):
                prev.setdefault(h, hashes[i - 1] if i else None)
            self.listener.pages_stored([(h, prev[h]) for h in inserted])
        return CommitResult(len(inserted), len(dup_pages))

    def cancel(self, owner: OwnerId, pages: Sequence[int]) -> None:
        """Give reserved, unwritten ``pages`` back; all or nothing."""
        o = self._owners[owner]
        self._check_reserved(o, pages, "cancel")
        o.reserved.difference_update(pages)
        self.allocator.free(pages)
        self.counters.cancelled += len(pages)

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
    def acquire(self, owner: OwnerId, hashes: Sequence[PageHash]) -> list[HostPageId]:
        """Lock the leading present ``hashes`` against eviction; returns their pages.

        The result may be shorter than ``hashes`` (pages evicted since a lookup);
        only the returned prefix is locked, and must be released by hash.
        """
        _check_hashes(hashes)
        pages = self._leading(hashes)
        o = self._owners[owner]
        for h in hashes[:len(pages)]:
            e = self._entries[h]
            if e.refs == 0:
                del self._lru[h]
            e.refs += 1
            o.acquired[h] += 1
        self.counters.acquired += len(pages)
        return pages

    def release(self, owner: OwnerId, hashes: Sequence[PageHash]) -> None:
        """Undo one acquisition per listed hash; all or nothing."""
        _check_hashes(hashes)
        o = self._owners[owner]
        want = Counter(hashes)
        for h, n in want.items():
            if o.acquired[h] < n:  # Counter lookups never insert
                raise ServiceError("not_acquired", f"release of page hash {h.hex()} x{n}, but this "
                                   f"client holds {o.acquired.get(h, 0)} acquisition(s) of it")
        for h, n in reversed(want.items()):
            o.acquired[h] -= n
            if o.acquired[h] == 0:
                del o.acquired[h]
            self._unref(h, n)

    def _unref(self, h: PageHash, n: int) -> None:
        e = self._entries[h]
        assert e.refs >= n, (h, e, n)
        e.refs -= n
        if e.refs == 0:
            # Just used, so most recent. Callers unref a chain deepest first, so
            # its head ends up most recent and is evicted last.
            self._lru[h] = None

    # ----------------------------------------------------------------- state
    @property
    def num_committed(self) -> int:
        return len(self._entries)

    @property
    def num_reserved(self) -> int:
        return sum(len(o.reserved) for o in self._owners.values())

    @property
    def num_locked(self) -> int:
        return len(self._entries) - len(self._lru)

    def check_integrity(self) -> None:
        """Every page is free, reserved by one owner, or committed once; refs balance."""
        self.allocator.check_integrity()
        reserved: set[int] = set()
        for oid, o in self._owners.items():
            if reserved & o.reserved:
                raise IntegrityError(f"owner {oid} shares reserved pages {sorted(reserved & o.reserved)}")
            reserved |= o.reserved
        committed = set(self._hash_of)
        if len(committed) != len(self._entries):
            raise IntegrityError(f"{len(self._entries)} entries but {len(committed)} committed page ids")
        for h, e in self._entries.items():
            if self._hash_of.get(e.page) != h:
                raise IntegrityError(f"entry {h.hex()} -> page {e.page}, page maps back to "
                                     f"{self._hash_of.get(e.page)!r}")
            if (e.refs == 0) != (h in self._lru):
                raise IntegrityError(f"entry {h.hex()} refs={e.refs} but in_lru={h in self._lru}")
        if reserved & committed:
            raise IntegrityError(f"pages both reserved and committed: {sorted(reserved & committed)}")
        for p in reserved | committed:
            if not self.allocator.is_allocated(p):
                raise IntegrityError(f"page {p} is held but free in the allocator")
        if len(reserved) + len(committed) != self.allocator.num_used:
            raise IntegrityError(f"reserved {len(reserved)} + committed {len(committed)} != "
                                 f"allocated {self.allocator.num_used}")
        refs = Counter()
        for o in self._owners.values():
            refs.update(o.acquired)
        for h, n in refs.items():
            if n <= 0 or h not in self._entries or self._entries[h].refs != n:
                raise IntegrityError(f"owners hold {n} acquisitions of {h.hex()}, entry says "
                                     f"{self._entries[h].refs if h in self._entries else 'absent'}")
        if sum(e.refs for e in self._entries.values()) != sum(refs.values()):
            raise IntegrityError("entry refs do not sum to the owners' acquisitions")


def _check_hashes(hashes: Sequence[PageHash]) -> None:
    if not isinstance(hashes, (list, tuple)):
        raise ServiceError("bad_args", f"expected a list of page hashes, got {type(hashes).__name__}")
    for h in hashes:
        if not isinstance(h, bytes) or len(h) != HASH_BYTES:
            raise ServiceError("bad_args", f"page hash {h!r:.60} must be {HASH_BYTES} raw bytes "
                               "(hicache.hashing.page_hashes)")
