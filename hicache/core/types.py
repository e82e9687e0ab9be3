"""Typed ids that prevent mixing L1 pages, L2 pages and page hashes, and the closed
sets of tiering policies (``policy.write_policy``, ``policy.prefetch_policy``) as
enums: the configuration parses names into them and the cache compares members,
never strings. Eviction policies are classes registered by name
(``hicache.index.eviction.POLICIES``); the names the configuration accepts are
``EVICTION_POLICIES``, which that registry must equal."""
from __future__ import annotations

import enum
from enum import IntEnum
from typing import TYPE_CHECKING, NewType

from hicache.core.errors import ProvenanceError

if TYPE_CHECKING:  # the CLI's help and info import this module and never torch
    import torch


DevicePageId = NewType("DevicePageId", int)
HostPageId = NewType("HostPageId", int)
# A submitted transfer (``TransferController.submit``): the one key of in-flight work.
JobId = NewType("JobId", int)
# 16-byte chained digest of a page: H(parent_hash, namespace, token ids).
PageHash = NewType("PageHash", bytes)


class WritePolicy(enum.StrEnum):
    """When L1 pages get an L2 copy."""

    WRITE_THROUGH = "write_through"  # every page the index takes, as it takes it
    WRITE_THROUGH_SELECTIVE = "write_through_selective"  # once hit write_through_threshold times
    WRITE_BACK = "write_back"  # only when evicted from L1 (the eviction waits for the copy)


class PrefetchPolicy(enum.StrEnum):
    """How long admission waits for pages fetched from L3."""

    BEST_EFFORT = "best_effort"  # the probe only; the fetch lands for later requests
    WAIT_COMPLETE = "wait_complete"  # until the fetch finishes
    TIMEOUT = "timeout"  # up to base + per-1k-tokens ms, capped


# The eviction policies by name (``policy.device_eviction`` / ``host_eviction``): one class each
# in hicache.index.eviction, which checks at import that its registry holds exactly these.
EVICTION_POLICIES = ("fifo", "ghost_lru", "lfu", "lru", "mru", "qd_lru", "s3fifo", "slru")


class Row(IntEnum):
    VALID = 0
    CP_PAGE_TAIL = 1  # compute padding up to a page tail under context parallelism
    STATIC_PAD = 2  # padding for a static batch shape (e.g. CUDA graphs)


def check_provenance(num_rows: int, provenance: torch.Tensor, expected_valid: int | None = None) -> int:
    """Validate a provenance vector for ``num_rows`` rows; return the VALID count.

    Raises ``ProvenanceError`` when lengths differ, a code is unknown, or the
    number of VALID rows differs from ``expected_valid`` (a length mismatch that
    provenance does not explain is never silently truncated).
    """
    if provenance.dim() != 1 or provenance.numel() != num_rows:
        raise ProvenanceError(f"provenance has shape {tuple(provenance.shape)}, rows={num_rows}; "
                              "pass one code per row")
    if num_rows and (int(provenance.min()) < 0 or int(provenance.max()) > max(Row)):
        raise ProvenanceError(f"unknown provenance code in [{int(provenance.min())}, "
                              f"{int(provenance.max())}]; valid codes: {[r.name for r in Row]}")
    valid = int((provenance == Row.VALID).sum())
    if expected_valid is not None and valid != expected_valid:
        raise ProvenanceError(f"{valid} VALID rows but the request accounts for {expected_valid} "
                              f"new tokens ({num_rows} rows in the batch); provenance does not "
                              "explain the difference")
    return valid
