"""``L1Room``: making room on L1 (the device tier), one policy in one place.

``HiCache`` owns one and asks it for room at three moments:

- ``make_room(n)`` before an admission allocates L1 pages for an L2 hit: it
  never waits (a miss, ``OutOfPages``, rather than a stalled admission);
- ``room_to_compute(n)`` before a running request allocates L1 pages for the
  tokens it computes: it must get them, so it may wait (``evict``);
- ``clean_ahead()`` after each admission and each ``poll``: start the
  write-back of the next victims so that the next admission finds clean ones.
"""
from __future__ import annotations

import math
from typing import Any, Generator, NamedTuple, TypeVar, Union

from hicache.index.prefix_cache import PrefixCache
from hicache.core.errors import IntegrityError, InvalidArgument, OutOfPages
from hicache.index.node import Node
from hicache.tiers.inflight import InFlight
from hicache.tiers.l2.base import L2Tier
from hicache.core.config import PolicyConfig
from hicache.tiers.plans import BackupPlan
from hicache.core.types import WritePolicy
from hicache.core.stats import TierMoveStats
from hicache.core.types import JobId


class WaitJob(NamedTuple):
    """Block until ``job`` is done, then complete every finished transfer (reply: None)."""

    job: JobId


class CompleteJob(NamedTuple):
    """Complete ``job`` if it finished, never waiting (reply: how many completed, 0 or 1)."""

    job: JobId


T = TypeVar("T")
# What a room operation yields to its owner: a backup plan to submit (reply: its job id,
# recorded in the in-flight registry), or a job to wait for or to complete.
RoomStep = Union[BackupPlan, WaitJob, CompleteJob]
Work = Generator[RoomStep, Any, T]


class L1Room:
    """Eviction from L1 and the write-back queue.

    Under ``write_back`` an L1 page may be the only copy of its KV: evicting it
    would lose it. So a victim not yet on L2 is not evicted; its backup (and its
    path's, top-down: L2 stays prefix-closed) is queued in the one in-flight
    registry (``InFlight.queue_write_back``), pinning it on L1, and it leaves L1
    when the copy completes (``written``). Under the other write policies every
    L1 page is on L2 or dropped on purpose, and the index's own eviction runs
    (``PrefixCache.alloc_device``); only ``evict`` is called here.

    The room never calls its owner: each operation that may start a copy or need a
    completion is a generator (``Work``) that yields what it needs, a ``BackupPlan`` to
    submit (the reply: its job id), ``WaitJob`` or ``CompleteJob``, and returns its
    result; the owner drives it (``HiCache._run_room``), so every job is submitted,
    recorded and completed in one place. Not thread-safe: the scheduler thread calls everything.
    """

    def __init__(self, cache: PrefixCache, l2: L2Tier, jobs: InFlight, policy: PolicyConfig,
                 stats: TierMoveStats):
        if cache.device_allocator is None:
            raise InvalidArgument("L1Room needs a PrefixCache with an L1 pool (its device_allocator is None)")
        self.cache = cache
        self._l1 = cache.device_allocator  # the L1 allocator: its free pages are the room
        self.l2 = l2
        self._jobs = jobs
        self._write_back = policy.write_policy is WritePolicy.WRITE_BACK
        self._stats = stats
        # write_back: L1 pages at the eviction end kept clean ahead of eviction (``clean_ahead``)
        self.clean_pages = math.ceil(policy.write_back_clean_fraction * self._l1.capacity)

    def evict(self, num_pages: int) -> Work[int]:
        """Take at least ``num_pages`` logical pages off L1 (unlocked leaves, by the
        device eviction policy). Under ``write_back`` a victim whose pages are not
        yet on L2 is backed up first (its path too) and this call waits for those
        copies, so the victims stay L2 hits (admission never waits: ``make_room``).
        Returns pages evicted (fewer only when nothing else is evictable)."""
        jobs = self._jobs
        before = self._device_evicted()
        for job in jobs.write_backs():  # cleaning ahead pins its nodes: let those copies land first
            if job in jobs and not jobs.is_victim(job):
                yield WaitJob(job)
        yield from self._evict_now(num_pages - jobs.victim_pages())  # (queued victims leave once written)
        while (got := self._device_evicted() - before) < num_pages and (victims := jobs.victim_jobs()):
            yield WaitJob(victims[0])  # completing it evicts the written victims
            now = self._device_evicted() - before
            short = num_pages - now - jobs.victim_pages()
            if short > 0 and (yield from self._evict_now(short)) == 0 and now == got:
                break  # the copy failed (the victim stays on L1): no progress to wait for
        return self._device_evicted() - before

    def make_room(self, num_pages: int) -> Work[None]:
        """Before an admission allocates ``num_pages`` L1 pages: under ``write_back``
        evict here (the index's own eviction would drop unwritten pages), never
        waiting: victims not yet on L2 are skipped and their write-back queued;
        the copies already done (inline CPU copies: all) complete here and their
        victims go. Raises ``OutOfPages`` when that leaves too few free: the load
        is a miss."""
        a = self._l1
        if not self._write_back or a.num_free >= num_pages:
            return
        yield from self._reap_write_backs()  # the copies of the pages cleaned ahead that landed: evictable now
        while a.num_free < num_pages:
            free = a.num_free
            short = num_pages - free - self._jobs.victim_pages()  # queued victims leave once written
            if short > 0:
                yield from self._evict_now(short)
            yield from self._reap_write_backs()  # victims written already (inline copies: all) go; parents next
            if a.num_free == free:
                break
        if a.num_free < num_pages:
            raise OutOfPages(f"L1: {num_pages} pages needed to load an L2 hit, {a.num_free} free; the write-back "
                             f"of {len(self._jobs.victim_jobs())} victim(s) is queued (poll() evicts them once "
                             "written); admission does not wait for it")

    def room_to_compute(self, num_pages: int) -> Work[None]:
        """Before a running request allocates ``num_pages`` L1 pages for the tokens it
        computes (it must get them): under ``write_back``, if short, evict and wait
        for the queued write-backs (``evict``)."""
        a = self._l1
        if self._write_back and a.num_free < num_pages:
            yield from self.evict(num_pages - a.num_free)

    def clean_ahead(self) -> Work[None]:
        """write_back: keep room ready for the next admission, never waiting. Free L1
        pages and the pages of backups in flight count as room; when they and the
        clean candidates at the eviction end cover fewer than the watermark
        (``write_back_clean_fraction`` of L1), start the write-back of the dirty
        candidates among them, in eviction order (they stay on L1, clean once the
        copy completes in ``poll()``), so an admission that needs room evicts clean
        victims and keeps its L2 hit. Nothing is written while L1 has room."""
        if not self._write_back:
            return
        want = self.clean_pages - self._l1.num_free - self._jobs.write_back_pages()
        if want <= 0:
            return
        for v in self.cache.device_victims(want):
            if self.l2.unbacked(v):
                yield from self._queue_write_back(v, evict=False)

    def written(self, job: JobId, node: Node) -> None:
        """The backup ``job`` of ``node`` completed (and left the registry): if it was a
        queued victim's, evict ``node`` now when it has its L2 copy and is still an
        unlocked L1 leaf (a failed copy or a new user keeps it on L1)."""
        if self._jobs.end_write_back(job) and not self.l2.unbacked(node):
            self.cache.drop_device([node])  # skips it unless it is an unlocked L1 leaf

    def _evict_now(self, num_pages: int) -> Work[int]:
        """Evict ``num_pages`` L1 pages without waiting: victims on L2 already go now;
        under ``write_back`` the others are skipped and their write-back queued
        (``_queue_write_back``: they go once written), counting toward ``num_pages``.
        Returns the pages evicted now."""
        got = queued = 0
        while got + queued < num_pages:
            victims = self.cache.device_victims(num_pages - got - queued)
            if not victims:
                break
            now = []
            for v in victims:
                if (yield from self._queue_write_back(v)):
                    queued += v.num_pages
                else:
                    now.append(v)
            if now:
                dropped = self.cache.drop_device(now)
                if not dropped:
                    break
                got += dropped
        return got

    def _device_evicted(self) -> int:
        return self.cache.stats().device_evicted_pages

    def _reap_write_backs(self) -> Work[None]:
        """Complete the queued write-backs that are done already, in the order they were
        queued (a path's upper nodes first), stopping at the first still running; never
        waits. Their victims leave L1 (``written``). CPU copies run inline
        (``inline_transfers``) are all done here."""
        for job in self._jobs.write_backs():
            if not (yield CompleteJob(job)):
                return

    def _queue_write_back(self, victim: Node, evict: bool = True) -> Work[bool]:
        """write_back: queue the backup of an eviction victim whose pages are not yet
        on L2 (and of its path), without waiting. True: queued; the backup pins the
        victim on L1 until it completes in ``poll()``, which then evicts it (``evict``;
        else it stays on L1, clean: ``clean_ahead``). False: evict it now (it is on
        L2 already, or L2 has no room for it: dropped)."""
        unbacked = self.l2.unbacked
        if not self._write_back or not unbacked(victim):
            return False
        own = None
        for n in self.cache.tree.path(victim):  # top-down: L2 stays prefix-closed
            if not unbacked(n):
                continue
            plan = self.l2.prepare_backup(n, pin=True)  # pinned on L1 until the copy completes
            job = None if plan is None else (yield plan)
            if job is None and unbacked(n):
                return False  # no L2 room: the victim goes without a copy (the path queued so far stays)
            if job is not None:
                self._jobs.queue_write_back(job, victim=evict and n is victim)
            own = job if n is victim else own
        if own is None:  # the shared L2 held it already: it is backed now
            return False
        if evict:
            self._stats.write_back_queued_pages += len(victim.device_pages or ())
        return True

    def check_integrity(self) -> None:
        """Write-backs are queued only under ``write_back``; each one in flight copies a
        node still on L1 whose L2 copy is being made; the clean watermark fits L1."""
        capacity = self._l1.capacity
        if not 0 <= self.clean_pages <= capacity:
            raise IntegrityError(f"L1 room: clean watermark {self.clean_pages} pages outside 0..{capacity}")
        queued = self._jobs.write_backs()
        if queued and not self._write_back:
            raise IntegrityError(f"L1 room: {len(queued)} write-back(s) queued (jobs {queued[:4]}) while the "
                                 "write policy is not write_back")
        plans = dict(self._jobs.items())
        for job in queued:
            plan = plans.get(job)
            if not isinstance(plan, BackupPlan):
                raise IntegrityError(f"L1 room: write-back job {job} is not a backup in flight ({plan!r})")
            if plan.node.device_pages is None or self.l2.unbacked(plan.node):
                raise IntegrityError(f"L1 room: write-back job {job} copies {plan.node!r}, which is off L1 "
                                     "or has no L2 copy being made")
