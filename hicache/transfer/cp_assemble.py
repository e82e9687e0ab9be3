"""Context parallelism at the KV boundary: per-rank row batches and page assembly,
both in terms of ``hicache.core.cp`` (ownership + ``CPRowOrder``).

* ``rank_batch`` builds the row batch one CP rank stores for several requests at
  once: its rows in CP-local order, padded to its page tails (``Row.CP_PAGE_TAIL``)
  and to a static batch size (``Row.STATIC_PAD``), each with its slot id and
  provenance, so ``store_rows`` persists exactly the ``VALID`` rows;
* ``assemble`` gives a non-CP consumer (a decode instance, an importer) the full
  logical pages of a sequence in global order, copying each page from the pool of
  the rank that owns it; it mutates only its destination pool.

The layout fingerprint ignores ``cp_rank``/``cp_size``, so a rank's pages copy byte
for byte into a ``cp_size 1`` pool.
"""
from __future__ import annotations

from typing import NamedTuple, Sequence

import numpy as np
import torch

from hicache.core.cp import CPRowOrder, PageOwnership
from hicache.memory.pools import DevicePool, HostPool
from hicache.kernels.page_copy import copy_pages, store_rows
from hicache.core.types import Row, check_provenance

Pool = DevicePool | HostPool


class RankPages(NamedTuple):
    """One rank's copy of a sequence: its pool and its owned page ids in logical order."""

    pool: Pool
    pages: list[int]


class RequestRows(NamedTuple):
    """One request's share of a batch: tokens ``[start, end)`` and the rank's page table."""

    start: int
    end: int
    pages: list[int]  # the rank's owned page ids of the request, logical order from page 0


class RankBatch(NamedTuple):
    """A rank's rows for a batch of requests, ready for ``store_rows``. Fresh tensors."""

    slot_ids: torch.Tensor  # [rows] int64; -1 for static padding
    provenance: torch.Tensor  # [rows] int8 ``Row`` codes
    positions: torch.Tensor  # [rows] int64 global token position; -1 for static padding
    request: torch.Tensor  # [rows] int64 index into the requests; -1 for static padding
    num_valid: int


def local_slots(ownership: PageOwnership, page_size: int, rank: int, pages: Sequence[int],
                positions: np.ndarray) -> np.ndarray:
    """Slot ids on ``rank`` of global token ``positions`` (all on pages ``rank`` owns),
    given its owned page ids ``pages`` (logical order from page 0)."""
    logical = positions // page_size
    if len(positions) and any(ownership.owner(int(j)) != rank for j in np.unique(logical)):
        raise ValueError(f"positions include pages rank {rank} does not own")
    ordinal = np.array([ownership.count(0, int(j), rank) for j in logical], dtype=np.int64)
    if len(ordinal) and int(ordinal.max()) >= len(pages):
        raise ValueError(f"rank {rank} owns {len(pages)} pages of the request, positions need "
                         f"ordinal {int(ordinal.max())}")
    ids = np.asarray(pages, dtype=np.int64)
    return ids[ordinal] * page_size + positions % page_size if len(positions) else positions.copy()


def rank_batch(order: CPRowOrder, rank: int, requests: Sequence[RequestRows],
               static_rows: int | None = None) -> RankBatch:
    """The rows ``rank`` computes for ``requests``, request after request, each in
    CP-local order and padded with ``CP_PAGE_TAIL`` rows up to the tail of its last
    owned page; then ``STATIC_PAD`` rows up to ``static_rows``. Tail padding rows
    carry the slot of their position (a kernel could write there; ``store_rows``
    must not); static padding rows carry slot -1. Raises ``ValueError`` when
    ``static_rows`` is smaller than the rows needed."""
    ps, own = order.page_size, order.ownership
    slots, prov, pos, req = [], [], [], []
    for r, q in enumerate(requests):
        valid = order.local_positions(q.start, q.end, rank)
        tail = np.zeros(0, dtype=np.int64)
        if len(valid) and (valid[-1] + 1) % ps:  # the rank's last page stops mid-page
            tail = np.arange(valid[-1] + 1, (valid[-1] // ps + 1) * ps, dtype=np.int64)
        p = np.concatenate([valid, tail])
        slots.append(local_slots(own, ps, rank, q.pages, p))
        prov.append(np.r_[np.full(len(valid), Row.VALID), np.full(len(tail), Row.CP_PAGE_TAIL)])
        pos.append(p)
        req.append(np.full(len(p), r))
    n = sum(len(p) for p in pos)
    if static_rows is not None:
        if static_rows < n:
            raise ValueError(f"static batch of {static_rows} rows is smaller than the {n} rows "
                             f"rank {rank} needs for {len(requests)} requests")
        pad = static_rows - n
        slots.append(np.full(pad, -1))
        prov.append(np.full(pad, Row.STATIC_PAD))
        pos.append(np.full(pad, -1))
        req.append(np.full(pad, -1))
    cat = lambda xs, dt: torch.from_numpy(np.concatenate(xs).astype(dt)) if xs else torch.zeros(0, dtype=dt)  # noqa: E731
    prov_t = cat(prov, np.int8)
    return RankBatch(cat(slots, np.int64), prov_t, cat(pos, np.int64), cat(req, np.int64),
                    int((prov_t == Row.VALID).sum()))


def page_sources(ownership: PageOwnership, num_pages: int, ranks: Sequence[RankPages]) -> list[tuple[int, int]]:
    """``(rank, page id)`` holding each logical page ``0 .. num_pages - 1``, in global order.

    Raises ``ValueError`` when a rank lists a different number of pages than it owns."""
    if len(ranks) != ownership.cp_size:
        raise ValueError(f"got pages of {len(ranks)} ranks, cp_size is {ownership.cp_size}")
    for r, rp in enumerate(ranks):
        want = ownership.count(0, num_pages, r)
        if len(rp.pages) != want:
            raise ValueError(f"rank {r} lists {len(rp.pages)} pages, it owns {want} of the "
                             f"first {num_pages} logical pages")
    seen = [0] * len(ranks)
    out = []
    for j in range(num_pages):
        r = ownership.owner(j)
        out.append((r, ranks[r].pages[seen[r]]))
        seen[r] += 1
    return out


def assemble(ownership: PageOwnership, ranks: Sequence[RankPages], dst: Pool, dst_pages: Sequence[int]) -> None:
    """Copy logical pages ``0 .. len(dst_pages) - 1`` from their owning ranks into
    ``dst_pages`` of ``dst`` (every plane, target and draft), one copy per rank.

    Mutates ``dst`` only. On a GPU the copies are asynchronous on the current
    stream of ``dst``'s (or the source's) device; synchronise before reading.
    Raises ``ContractMismatch`` when a rank's layout differs in anything but CP.
    """
    src = page_sources(ownership, len(dst_pages), ranks)
    for r, rp in enumerate(ranks):
        sel = [(pid, dst_pages[j]) for j, (owner, pid) in enumerate(src) if owner == r]
        if sel:
            copy_pages(rp.pool, dst, [s for s, _ in sel], [d for _, d in sel])


def store_batch(pool: DevicePool, plane_indices: Sequence[int], rows: Sequence[torch.Tensor], batch: RankBatch,
                order: CPRowOrder, rank: int, requests: Sequence[RequestRows]) -> int:
    """Store ``batch`` (from ``rank_batch``) with ``store_rows``: only ``VALID`` rows reach
    ``pool``. First checks that the VALID rows are exactly the tokens the requests
    account for on this rank (``check_provenance``), so a row lost to a wrong code
    or a short batch raises ``ProvenanceError`` instead of being dropped silently.
    Returns the rows written."""
    want = sum(len(order.local_positions(q.start, q.end, rank)) for q in requests)
    check_provenance(int(batch.slot_ids.numel()), batch.provenance, expected_valid=want)
    dev = pool.device
    return store_rows(pool, list(plane_indices), list(rows), batch.slot_ids.to(dev), batch.provenance.to(dev))
