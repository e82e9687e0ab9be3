"""Context parallelism: which CP rank owns which logical page, and row order.

With ``cp_size > 1`` logical page ``j`` of a sequence lives only on the rank
``ownership.owner(j)``; every other rank keeps the page's tokens in its index
but holds no page id for it. A rank's page list for a sequence is therefore
the ids of its *owned* logical pages, in increasing ``j``, and its KV rows are
addressed in that *CP-local* order: local row ``r`` is offset ``r % page_size``
of the ``r // page_size``-th owned page. ``CPRowOrder`` is the one helper that
converts between that order and global request order.

Ownership is pluggable: any object with ``cp_size``, ``owner(j)`` and
``count(start, end, rank)``; the built-in ones are listed in ``OWNERSHIPS``.
"""
from __future__ import annotations

from types import MappingProxyType
from typing import Mapping, Protocol

import numpy as np
import torch


class PageOwnership(Protocol):
    """Maps a logical page index to the CP rank that stores it. Stateless."""

    cp_size: int

    def owner(self, page: int) -> int:
        """Rank that owns logical page ``page``."""

    def count(self, start: int, end: int, rank: int) -> int:
        """How many logical pages in ``[start, end)`` ``rank`` owns."""


class RoundRobin:
    """Page ``j`` is owned by rank ``j mod cp_size`` (the default)."""

    __slots__ = ("cp_size",)

    def __init__(self, cp_size: int):
        if cp_size < 1:
            raise ValueError(f"cp_size must be >= 1, got {cp_size}")
        self.cp_size = cp_size

    def __repr__(self) -> str:
        return f"RoundRobin(cp_size={self.cp_size})"

    def owner(self, page: int) -> int:
        return page % self.cp_size

    def count(self, start: int, end: int, rank: int) -> int:
        if end <= start:
            return 0
        n = self.cp_size
        if n == 1:
            return end - start
        # pages j < x with j % n == rank: ceil((x - rank) / n), floored at 0
        return max(0, -(-(end - rank) // n)) - max(0, -(-(start - rank) // n))


class Blocked:
    """Runs of ``block`` pages go to one rank in turn: owner ``(j // block) mod cp_size``."""

    __slots__ = ("cp_size", "block")

    def __init__(self, cp_size: int, block: int = 4):
        if cp_size < 1 or block < 1:
            raise ValueError(f"Blocked ownership needs cp_size >= 1 and block >= 1, got {cp_size}, {block}")
        self.cp_size, self.block = cp_size, block

    def __repr__(self) -> str:
        return f"Blocked(cp_size={self.cp_size}, block={self.block})"

    def owner(self, page: int) -> int:
        return (page // self.block) % self.cp_size

    def count(self, start: int, end: int, rank: int) -> int:
        if self.cp_size == 1:
            return max(0, end - start)
        return sum(1 for j in range(start, end) if self.owner(j) == rank)


OWNERSHIPS: Mapping[str, type] = MappingProxyType({"round_robin": RoundRobin, "blocked": Blocked})


def make_ownership(spec: str | PageOwnership, cp_size: int) -> PageOwnership:
    """An ownership object from a name in ``OWNERSHIPS`` or an instance (checked)."""
    if isinstance(spec, str):
        if spec not in OWNERSHIPS:
            raise ValueError(f"unknown CP page ownership {spec!r}; known: {sorted(OWNERSHIPS)}")
        return OWNERSHIPS[spec](cp_size)
    if spec.cp_size != cp_size:
        raise ValueError(f"ownership has cp_size={spec.cp_size}, the layout has cp_size={cp_size}")
    return spec


class CPRowOrder:
    """Converts KV rows between CP-local order and global request order.

    For tokens ``[start, end)`` of one sequence, rank ``r`` holds the rows of
    the tokens whose page it owns, in increasing token position (its local
    order). ``local_positions`` lists those global positions; ``to_local``
    selects a rank's rows from a global-order tensor; ``to_global`` stitches
    every rank's local rows back into global order. Pure functions of the
    arguments; returned tensors are new (no views into the inputs).
    """

    __slots__ = ("ownership", "page_size")

    def __init__(self, ownership: PageOwnership, page_size: int):
        self.ownership, self.page_size = ownership, page_size

    def local_positions(self, start: int, end: int, rank: int) -> np.ndarray:
        """Global token positions (int64) of ``rank``'s rows for tokens ``[start, end)``."""
        if not 0 <= start <= end:
            raise ValueError(f"token range [{start}, {end}) is not a valid range")
        ps, own = self.page_size, self.ownership
        first, last = start // ps, -(-end // ps)
        pages = np.array([j for j in range(first, last) if own.owner(j) == rank], dtype=np.int64)
        pos = (pages[:, None] * ps + np.arange(ps, dtype=np.int64)).reshape(-1)
        return pos[(pos >= start) & (pos < end)]

    def to_local(self, rows: torch.Tensor, start: int, rank: int) -> torch.Tensor:
        """``rank``'s rows, in local order, of ``rows`` (global order, tokens ``[start, start+len)``)."""
        pos = self.local_positions(start, start + rows.shape[0], rank) - start
        return rows[torch.from_numpy(pos).to(rows.device)]

    def to_global(self, per_rank: list[torch.Tensor], start: int) -> torch.Tensor:
        """Stitch ``per_rank[r]`` (rank ``r``'s local rows) into global order from ``start``.

        Raises ``ValueError`` when a rank's row count does not match what it owns.
        """
        if len(per_rank) != self.ownership.cp_size:
            raise ValueError(f"got rows of {len(per_rank)} ranks, cp_size is {self.ownership.cp_size}")
        total = sum(t.shape[0] for t in per_rank)
        out = per_rank[0].new_empty((total, *per_rank[0].shape[1:]))
        for rank, rows in enumerate(per_rank):
            pos = self.local_positions(start, start + total, rank) - start
            if len(pos) != rows.shape[0]:
                raise ValueError(f"rank {rank} passed {rows.shape[0]} rows but owns {len(pos)} of "
                                 f"tokens [{start}, {start + total})")
            out[torch.from_numpy(pos).to(out.device)] = rows
        return out
