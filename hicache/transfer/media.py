"""What the transfer engine reads of a plan: the (source, destination) medium pair that
picks its mover, and the ids. The plans themselves are the scheduler side's records
(``hicache.tiers.plans``); the engine reads these fields only."""
from __future__ import annotations

import enum
from typing import Protocol

from hicache.core.types import DevicePageId, HostPageId, PageHash


class Medium(enum.StrEnum):
    """Where a page's bytes are: a tier's memory. (A ``str`` enum: a route, a tuple of two,
    hashes in C at every ``submit``; a plain ``Enum`` member hashes in Python.)"""

    L1 = "L1"  # the device pool (or a layer group's)
    L2 = "L2"  # the host pool: private pinned memory or the node's shared segment
    L3 = "L3"  # the storage backend


Route = tuple[Medium, Medium]  # (source, destination): the key of a mover
L1_TO_L2: Route = (Medium.L1, Medium.L2)
L2_TO_L1: Route = (Medium.L2, Medium.L1)
L2_TO_L3: Route = (Medium.L2, Medium.L3)
L3_TO_L2: Route = (Medium.L3, Medium.L2)

# The ``group`` of every plan: which layer group's pools its ids are in. FULL: the index's
# full-attention pages; ``g >= 0``: items of layer group ``g`` of a hybrid layout.
FULL = -1


class Movable(Protocol):
    """A plan as the engine sees it: its route (a plain attribute: no call per job) and the
    layer group whose pools it uses."""

    @property
    def route(self) -> Route: ...

    @property
    def group(self) -> int: ...


class PageCopy(Movable, Protocol):
    """L1 <-> L2: ``device[i]`` and ``host[i]`` are one page's two copies."""

    @property
    def device(self) -> list[DevicePageId]: ...

    @property
    def host(self) -> list[HostPageId]: ...


class PageIo(Movable, Protocol):
    """L2 <-> L3: ``host[i]`` is stored under ``hashes[i]``."""

    @property
    def host(self) -> list[HostPageId]: ...

    @property
    def hashes(self) -> list[PageHash]: ...
