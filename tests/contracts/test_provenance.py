"""Row provenance end to end: batches of several requests mixing VALID rows, CP
page-tail padding and static padding; only VALID rows reach any indexed page on L1,
L2 or L3, and a count that provenance does not explain raises."""
from __future__ import annotations

import pytest
import torch

from hicache.transfer.cp_assemble import RequestRows, rank_batch, store_batch
from hicache.core.errors import ProvenanceError
from hicache.kernels.page_copy import store_rows
from hicache.core.layout import KVLayout
from hicache.core.types import Row, check_provenance

from .helpers import SENTINEL, indexed_pages, make_hc

BASE = KVLayout(model_id="prov", num_layers=2, num_kv_heads=2, head_dim=2, dtype="float32", page_size=4,
                draft_layers=1)
LENGTHS = (10, 13, 7)  # three requests in one batch: none ends on a page boundary


def tokens(q: int, n: int) -> list[int]:
    return [1000 * (q + 1) + p for p in range(n)]


def value(tok, plane: int) -> torch.Tensor:
    """The one valid value of every element of a token's row on a plane."""
    return torch.as_tensor(tok, dtype=torch.float32) + plane / 8


def write_batch(hc, rank: int, naive: bool = False):
    """Admit the three requests on this rank, store their rows as one padded batch, commit."""
    order = hc.cache.row_order
    reqs = []
    for q, n in enumerate(LENGTHS):
        r = hc.new_request(f"q{q}", tokens(q, n))
        hc.admit(r)
        r.alloc(n)
        reqs.append(r)
    rr = [RequestRows(0, n, r.pages) for n, r in zip(LENGTHS, reqs)]
    batch = rank_batch(order, rank, rr, static_rows=48)
    # static padding aimed at an indexed page: a store that ignored provenance would hit it
    slots = batch.slot_ids.clone()
    pad = batch.provenance == Row.STATIC_PAD
    target = hc.device_pool.slot_ids(reqs[0].pages[:1])
    slots[pad] = target.repeat(-(-int(pad.sum()) // len(target)))[:int(pad.sum())]
    batch = batch._replace(slot_ids=slots)
    tok = torch.tensor([tokens(int(q), 4096)[int(p)] if q >= 0 else 0
                        for q, p in zip(batch.request, batch.positions)], dtype=torch.float32)
    valid = batch.provenance == Row.VALID
    rows = []
    for s in hc.layout.planes:
        t = value(tok, s.index).reshape(-1, *([1] * len(s.row_shape))).expand(-1, *s.row_shape).clone()
        t[~valid] = SENTINEL
        rows.append(t)
    planes = [s.index for s in hc.layout.planes]
    if naive:  # the old store: every row with a slot lands
        keep = batch.slot_ids >= 0
        for i, t in zip(planes, rows):
            hc.device_pool.buffers[i][batch.slot_ids[keep]] = t[keep]
    else:
        assert store_batch(hc.device_pool, planes, rows, batch, order, rank, rr) == batch.num_valid
    for n, r in zip(LENGTHS, reqs):
        r.commit(draft_tokens=n)
        r.finish()
    hc.drain()
    return batch


def scan(hc):
    """Every indexed page on every tier: (tiers seen, pages whose rows are wrong)."""
    tiers, bad = set(), []
    for tier, toks, planes in indexed_pages(hc):
        tiers.add(tier)
        for i, rows in planes.items():
            want = value(torch.tensor(toks), i).reshape(-1, *([1] * (rows.dim() - 1))).expand_as(rows)
            if not torch.equal(rows, want) or bool((rows == SENTINEL).any()):
                bad.append((tier, toks[0], i))
    return tiers, bad


@pytest.mark.parametrize("cp_size", [1, 2])
@pytest.mark.parametrize("host_layout", ["page_first", "layer_first"])
def test_only_valid_rows_reach_indexed_pages_on_every_tier(cp_size, host_layout):
    ranks = [make_hc(BASE.replace(cp_rank=r, cp_size=cp_size, host_layout=host_layout),
                     "memory://" if cp_size == 1 else "") for r in range(cp_size)]
    kinds = set()
    for r, hc in enumerate(ranks):
        batch = write_batch(hc, r)
        kinds |= set(batch.provenance.tolist())
        tiers, bad = scan(hc)
        assert bad == []
        assert tiers == ({"L1", "L2", "L3"} if cp_size == 1 else {"L1", "L2"})
        hc.check_integrity()
        hc.close()
    assert kinds == {Row.VALID, Row.CP_PAGE_TAIL, Row.STATIC_PAD}  # every kind of row was in play


def test_store_ignoring_provenance_is_caught_by_the_scan():
    hc = make_hc(BASE, "memory://")
    write_batch(hc, 0, naive=True)
    tiers, bad = scan(hc)
    assert {t for t, _, _ in bad} == {"L1", "L2", "L3"}  # the poison travelled to every tier
    hc.close()


def test_unexplained_length_mismatch_raises():
    hc = make_hc(BASE.replace(cp_size=2))
    order = hc.cache.row_order
    r = hc.new_request("q", tokens(0, 10))
    hc.admit(r)
    r.alloc(10)
    rr = [RequestRows(0, 10, r.pages)]
    batch = rank_batch(order, 0, rr, static_rows=16)
    planes = [s.index for s in hc.layout.planes]
    rows = [torch.zeros(16, *s.row_shape) for s in hc.layout.planes]
    lost = batch.provenance.clone()
    lost[int((lost == Row.VALID).nonzero()[-1])] = Row.CP_PAGE_TAIL  # a real row relabelled padding
    with pytest.raises(ProvenanceError, match="5 VALID rows but the request accounts for 6"):
        store_batch(hc.device_pool, planes, rows, batch._replace(provenance=lost), order, 0, rr)
    with pytest.raises(ProvenanceError, match="provenance has shape"):
        store_rows(hc.device_pool, planes, rows, batch.slot_ids, batch.provenance[:-1])
    with pytest.raises(ProvenanceError, match="unknown provenance code"):
        check_provenance(2, torch.tensor([0, 7], dtype=torch.int8))
    with pytest.raises(ValueError, match="static batch of 4 rows is smaller than the 8 rows"):
        rank_batch(order, 0, rr, static_rows=4)
    assert int(hc.device_pool.buffers[0].abs().sum()) == 0  # nothing was written by the failed calls
    r.abort()
    hc.check_integrity()
    hc.close()


def test_model_write_kv_drops_padding_aimed_at_cached_slots():
    """The reference model's store path (``write_kv``): padding rows never land, even
    when their slot ids point into an indexed page."""
    from hicache.reference.model_kv import write_kv

    hc = make_hc(BASE)
    r = hc.new_request("q", tokens(0, 8))
    hc.admit(r)
    r.alloc(8)
    slots = hc.device_pool.slot_ids(r.pages)
    prov = torch.tensor([Row.VALID] * 5 + [Row.CP_PAGE_TAIL] * 3 + [Row.STATIC_PAD] * 4, dtype=torch.int8)
    ids = torch.cat([slots[:5], slots[5:8], slots[:4]])  # the padding aims at rows 5-7 and 0-3
    vals = torch.tensor([1.0, 2, 3, 4, 5] + [SENTINEL] * 7)
    rows = {name: vals.view(-1, 1, 1).expand(12, 2, 2).clone() for name in ("k", "v")}
    assert write_kv(hc.device_pool, 0, rows, ids, prov) == 5
    k0 = hc.device_pool.plane("k", 0)[slots][:, 0, 0]
    assert k0.tolist() == [1.0, 2, 3, 4, 5, 0, 0, 0]
    with pytest.raises(ProvenanceError, match="provenance has shape"):
        write_kv(hc.device_pool, 0, rows, ids, prov[:-1])
    r.abort()
    hc.close()
