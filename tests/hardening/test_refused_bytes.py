"""A page refused on read leaves nothing of itself in the destination (issue 36, row 11).

file:// reads a payload into the caller's memory and verifies it there
(``hicache.storage.into``); before the fix a forged page's bytes stayed in
SGLang's host pool and vLLM's rows (reported not loaded, but present). The
adapters now zero every page a ``DIRECT_IO`` read did not load
(``wipe_unloaded``); their own tests (tests/integrations/sglang
test_auth_and_bounds, tests/integrations/vllm test_tier_state) check the
engines' memory. This one checks the helper on a real keyed store.
"""
from __future__ import annotations

import numpy as np

from hicache.core.hashing import page_hashes
from hicache.storage import open_storage
from hicache.storage.into import wipe_unloaded

FP = "0f1e2d3c4b5a6978"
KEY = b"k" * 24
ROW = 256


def test_a_forged_page_read_in_place_is_zeroed_and_the_good_ones_kept(tmp_path):
    url = f"file://{tmp_path}/l3"
    keyed = open_storage(url, fingerprint=FP, auth_key=KEY)
    forger = open_storage(url, fingerprint=FP)  # same layout and keys, no key
    ks = page_hashes(list(range(12)), 4)
    good = [bytes([i + 1]) * ROW for i in range(3)]
    assert keyed.put([(k, g, [ROW]) for k, g in zip(ks, good)]) == 3
    assert forger.delete([ks[1]]) == 1
    assert forger.put([(ks[1], bytes([0x66]) * ROW, [ROW])]) == 1
    rows = np.full((3, ROW), 0x11, dtype=np.uint8)
    dests = [memoryview(rows[i]) for i in range(3)]
    got = keyed.get_into(ks, [ROW], dests)
    assert got == [True, False, True]
    assert keyed.stats().corrupt == 1
    assert wipe_unloaded(keyed.DIRECT_IO, dests, got) == 1
    assert rows[0].tobytes() == good[0] and rows[2].tobytes() == good[2] and not rows[1].any()
    keyed.close()
    forger.close()


def test_a_store_that_copies_verified_pages_only_is_left_alone():
    rows = np.full((2, 8), 7, dtype=np.uint8)
    dests = [[memoryview(rows[i][:4]), memoryview(rows[i][4:])] for i in range(2)]
    assert wipe_unloaded(False, dests, [False, False]) == 0 and (rows == 7).all()
    assert wipe_unloaded(True, dests, [False, True]) == 1
    assert not rows[0].any() and (rows[1] == 7).all()
