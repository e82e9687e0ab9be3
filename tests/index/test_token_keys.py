"""tokens_to_bytes: every input form gives the same key, and out-of-range ids raise."""
from __future__ import annotations

from array import array
from collections.abc import Sequence

import numpy as np
import pytest
import torch

from hicache.index.prefix_cache import as_key
from hicache.core.hashing import page_hashes, tokens_to_bytes

IDS = [0, 1, 255, 256, 65535, 65536, 151_935, 2**31, 2**32 - 1]
WANT = b"".join(i.to_bytes(4, "little") for i in IDS)


class _ReadOnlyIds(Sequence):
    """A read-only view of a list, as vLLM's ``ConstantList`` of a request's ids."""

    def __init__(self, ids):
        self._ids = ids

    def __getitem__(self, i):
        return self._ids[i]

    def __len__(self):
        return len(self._ids)


@pytest.mark.parametrize("form", [
    list, tuple,
    lambda x: np.array(x, dtype=np.int64), lambda x: np.array(x, dtype=np.uint64),
    lambda x: np.array(x, dtype=np.uint32), lambda x: np.array(x, dtype=">u4"),
    lambda x: [np.int64(i) for i in x],  # numpy scalars in a list take the general path
    lambda x: torch.tensor(x, dtype=torch.int64),
    lambda x: array("q", x), lambda x: array("L", x), lambda x: array("I", x),
    lambda x: _ReadOnlyIds(x),  # another Sequence (vLLM's ConstantList): copied to a list first
])
def test_every_form_gives_the_same_key(form):
    assert as_key(form(IDS)) == WANT


def test_small_signed_arrays_and_bools():
    assert tokens_to_bytes(np.array([7, 0], dtype=np.int32)) == b"\x07\0\0\0\0\0\0\0"
    assert tokens_to_bytes([True, 2]) == b"\x01\0\0\0\x02\0\0\0"
    assert tokens_to_bytes([]) == b"" and tokens_to_bytes(np.array([], dtype=np.int64)) == b""


@pytest.mark.parametrize("bad", [
    [5, -1], [2**32], (3, 2**40), [2**40, None],
    np.array([4, -1], dtype=np.int64), np.array([-5], dtype=np.int32), np.array([2**32], dtype=np.uint64),
    array("q", [1, -2]), array("Q", [2**33]), _ReadOnlyIds([3, -1]),
    np.array([1, -2**63], dtype=np.int64), np.array([1, 0, -7, 0], dtype=np.int64)[::2],  # strided
])
def test_out_of_range_raises_value_error(bad):
    with pytest.raises(ValueError, match=r"\[0, 2\*\*32\)"):
        tokens_to_bytes(bad)


def test_not_one_dimensional_raises():
    with pytest.raises(ValueError, match="1-D"):
        tokens_to_bytes([[1, 2]])


def test_page_hashes_equal_for_list_and_array():
    toks = list(range(1000, 1064))
    assert page_hashes(toks, 16) == page_hashes(np.array(toks), 16) == page_hashes(tuple(toks), 16)
