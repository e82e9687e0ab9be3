"""The one registry of in-flight work: every submitted, not yet completed
transfer by its typed ``JobId``.

One map, ``JobId -> plan``. Readers that must wait for a load (a request
about to use L1 pages still filling) find it through ``load_job(node)``, an
index over the same entries (each node of a ``LoadPlan``'s path -> its job),
added and removed with them; ``check_integrity`` proves the two agree and that
each load still pins what it fills. Layer-wise handles stay with the transfer
engine, keyed by the same ``JobId`` (``TransferController.load_handle``).
Not thread-safe: the scheduler thread calls everything.
"""
from __future__ import annotations

from typing import Iterator

from hicache.errors import CacheStateError, IntegrityError
from hicache.index.node import Node
from hicache.plans import LoadPlan
from hicache.transfer import Plan
from hicache.types import JobId


class InFlight:
    """Submitted, uncompleted jobs and their plans (see the module docstring)."""

    def __init__(self) -> None:
        self._jobs: dict[JobId, Plan] = {}
        self._filling: dict[Node, JobId] = {}  # node whose L1 pages a load is filling -> that load's job

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
        load's path is indexed, and each load pins what it fills on L1."""
        for n, job in self._filling.items():
            plan = self._jobs.get(job)
            if not isinstance(plan, LoadPlan) or n not in plan.path:
                raise IntegrityError(f"{n!r} is loading but its job {job} is not a load in flight "
                                     f"over it ({plan!r})")
        for job, plan in self._jobs.items():
            if not isinstance(plan, LoadPlan):
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
