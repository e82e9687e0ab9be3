"""The scheduler side's one registry of in-flight work: every submitted, not yet completed
transfer by its typed ``JobId``.

One map, ``JobId -> plan``. Readers that must wait for a load (a request
about to use L1 pages still filling) find it through ``load_job(node)``, an
index over the same entries (each node of a ``LoadPlan``'s path -> its job),
added and removed with them; ``check_integrity`` proves the two agree and that
each load still pins what it fills. Layer-wise handles stay with the transfer
engine, keyed by the same ``JobId`` (``TransferController.load_handle``).
"""
from __future__ import annotations

from typing import Iterator, cast

from hicache.core.errors import CacheStateError, IntegrityError
from hicache.index.node import Node
from hicache.tiers.plans import BackupPlan, LoadPlan, Plan
from hicache.core.types import JobId


class InFlight:
    """Submitted, uncompleted jobs and their plans.

    Write-back (``write_policy = write_back``) marks, in the same registry, the
    backups it queued instead of waiting for them, in queue order, and which of
    them copy an eviction victim (the backup's node, pinned on L1 by it) that
    leaves L1 once written: ``queue_write_back`` / ``end_write_back``.
    Not thread-safe: the scheduler thread calls everything.
    """

    def __init__(self) -> None:
        self._jobs: dict[JobId, Plan] = {}
        self._filling: dict[Node, JobId] = {}  # node whose L1 pages a load is filling -> that load's job
        # write-back backups in flight, in queue order -> True: its node is a victim evicted once written
        self._write_backs: dict[JobId, bool] = {}

    def add(self, job: JobId, plan: Plan) -> None:
        """Record ``plan`` as submitted under ``job`` (``CacheStateError`` if ``job`` is
        already in flight, or a node of a load is already being filled by another)."""
        if job in self._jobs:
            raise CacheStateError(f"job {job} submitted twice ({self._jobs[job]!r}, {plan!r})")
        if isinstance(plan, LoadPlan):
            busy = [n for n in plan.path if n in self._filling]
            if busy:
                raise CacheStateError(f"{busy[0]!r} is filled by two loads in flight "
                                      f"(jobs {self._filling[busy[0]]} and {job})")
            for n in plan.path:
                self._filling[n] = job
        self._jobs[job] = plan

    def pop(self, job: JobId) -> Plan:
        """Forget a completed ``job``; its plan (``KeyError`` if not in flight)."""
        plan = self._jobs.pop(job)
        if isinstance(plan, LoadPlan):
            for n in plan.path:
                del self._filling[n]
        return plan

    def queue_write_back(self, job: JobId, victim: bool) -> None:
        """Mark the backup ``job`` (in flight) as queued by write-back; ``victim``: its node
        leaves L1 once written (``CacheStateError`` if ``job`` is no backup in flight)."""
        if not isinstance(self._jobs.get(job), BackupPlan):
            raise CacheStateError(f"write-back of job {job}: not a backup in flight ({self._jobs.get(job)!r})")
        self._write_backs[job] = victim or self._write_backs.get(job, False)

    def end_write_back(self, job: JobId) -> bool:
        """Forget the write-back mark of the completed ``job`` (after ``pop``); True when
        its node was a victim to evict now."""
        return self._write_backs.pop(job, False)

    def is_victim(self, job: JobId) -> bool:
        """``job`` is a queued write-back whose node leaves L1 once written."""
        return self._write_backs.get(job, False)

    def write_backs(self) -> list[JobId]:
        """The write-back backups still in flight, in the order they were queued."""
        return list(self._write_backs)

    def write_back_pages(self) -> int:
        """L1 pages the write-back backups in flight are copying to L2."""
        return sum(len(cast(BackupPlan, self._jobs[j]).device) for j in self._write_backs)

    def victim_pages(self) -> int:
        """Logical L1 pages of the victims whose write-back is queued (they leave once written)."""
        return sum(cast(BackupPlan, self._jobs[j]).node.num_pages for j, v in self._write_backs.items() if v)

    def victim_jobs(self) -> list[JobId]:
        """The queued write-backs whose node leaves L1 once written, in queue order."""
        return [j for j, v in self._write_backs.items() if v]

    def load_job(self, node: Node) -> JobId | None:
        """The job of the load still filling ``node``'s L1 pages (None: none is)."""
        return self._filling.get(node)

    def __contains__(self, job: object) -> bool:
        return job in self._jobs

    def __len__(self) -> int:
        return len(self._jobs)

    def __iter__(self) -> Iterator[JobId]:
        return iter(self._jobs)

    def items(self) -> Iterator[tuple[JobId, Plan]]:
        return iter(self._jobs.items())

    def check_integrity(self) -> None:
        """Every node being filled leads to a load in flight whose path holds it, every
        load's path is indexed, and each load pins what it fills on L1; every
        write-back is a backup in flight, and each victim's pins it on L1."""
        for job, victim in self._write_backs.items():
            plan = self._jobs.get(job)
            if not isinstance(plan, BackupPlan) or (victim and plan.node.lock_ref < 1):
                raise IntegrityError(f"write-back job {job} is not a backup in flight pinning its victim "
                                     f"on L1 ({plan!r})")
        for n, job in self._filling.items():
            plan = self._jobs.get(job)
            if not isinstance(plan, LoadPlan) or n not in plan.path:
                raise IntegrityError(f"{n!r} is loading but its job {job} is not a load in flight "
                                     f"over it ({plan!r})")
        for job, plan in self._jobs.items():
            if not isinstance(plan, LoadPlan) or plan.last is None:  # (None: a layer group's items)
                continue
            for n in plan.path:
                if self._filling.get(n) != job:
                    raise IntegrityError(f"load job {job}: {n!r} of its path is not recorded as filling "
                                         f"(led to job {self._filling.get(n)})")
                if n.device_pages is None:
                    raise IntegrityError(f"load job {job}: {n!r} of its path is not on L1")
            if plan.last.lock_ref < 1 or (plan.shared is None and plan.last.host_lock_ref < 1):
                raise IntegrityError(f"load job {job}: {plan.last!r} is not pinned on L1 (and, from the "
                                     "private L2, on L2) while it fills")
