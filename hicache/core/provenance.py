"""Row provenance: every row written into the KV cache says where it came from.

Only ``VALID`` rows are stored or persisted. Padding rows exist only because a
kernel computed a fixed shape; they must never reach an indexed page.
"""
from __future__ import annotations

from enum import IntEnum

import torch

from hicache.core.errors import ProvenanceError


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
