"""What crosses between the connector's scheduler half and its worker half.

Plain data only (ints, bytes, tuples): an engine may run the two halves in
different processes and pickle these. The scheduler half
(``hicache.cache.connector``) builds one ``StepPlan`` per engine step; every
worker (TP rank) runs it (``hicache.cache.connector_worker``) and answers with
``JobReport`` s, which the scheduler half completes once every rank reported.
Page ``i`` of a spec is block ``blocks[i]`` of the engine's KV tensors (page id
== block id) and L2 page ``host[i]`` of every rank's host pool.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field


class JobKind(enum.StrEnum):
    LOAD = "load"  # L3 -> L2 (part) then L2 -> engine blocks
    SAVE = "save"  # engine blocks -> L2
    STORE = "store"  # L2 -> L3, after a save


@dataclass(frozen=True, slots=True)
class LoadSpec:
    """Load pages into engine blocks: the L2 part, then the L3 part continuing it."""

    job: int
    rid: str
    blocks: tuple[int, ...]  # one engine block per page, in page order: L2 part, L3 part, missing part
    host: tuple[int, ...]  # L2 pages of the first len(host) blocks
    l3_host: tuple[int, ...] = ()  # L2 pages reserved for the L3 part (the next len(l3_host) blocks)
    l3_hashes: tuple[bytes, ...] = ()  # the L3 keys of that part
    layerwise: bool = False  # True: the forward of this step waits per layer; False: loads between steps

    @property
    def missing(self) -> tuple[int, ...]:
        """Blocks the engine allocated that this load cannot fill (reported as load errors)."""
        return self.blocks[len(self.host) + len(self.l3_host):]


@dataclass(frozen=True, slots=True)
class SaveSpec:
    """Copy engine blocks into L2 pages, then (``hashes`` given) those L2 pages to L3."""

    job: int
    rid: str
    blocks: tuple[int, ...]
    host: tuple[int, ...]
    hashes: tuple[bytes, ...] = ()  # L3 keys, one per page (() : no L3)


@dataclass(frozen=True, slots=True)
class StepPlan:
    loads: tuple[LoadSpec, ...] = ()
    saves: tuple[SaveSpec, ...] = ()


@dataclass(frozen=True, slots=True)
class JobReport:
    """One rank's outcome of one job stage."""

    job: int
    rank: int
    kind: JobKind
    ok: bool  # the stage's copies succeeded (a load: its L2 part reached the blocks)
    pages: int = 0  # LOAD: leading pages of the L3 part that landed verified; STORE: pages L3 accepted
    seconds: float = 0.0  # LOAD: L2 -> blocks copy time; else 0
    l3_seconds: float = 0.0  # LOAD: L3 read time
    nbytes: int = 0  # LOAD: bytes copied into blocks


@dataclass(slots=True)
class WorkerStep:
    """What one worker hands the engine after a step (see ``ConnectorWorker.finish_step``)."""

    finished_loads: set[str] = field(default_factory=set)  # rids whose asynchronous load ended (ok or not)
    finished_saves: set[str] = field(default_factory=set)  # rids whose blocks the saves no longer read
    load_errors: set[int] = field(default_factory=set)  # blocks whose load failed or failed verification
    reports: list[JobReport] = field(default_factory=list)
