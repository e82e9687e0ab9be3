"""store_rows: only VALID rows land, at their slot ids; kernel and torch agree byte for byte."""
from __future__ import annotations

import pytest
import torch

from hicache.core.errors import ProvenanceError
from hicache.kernels.page_copy import PageCopier, store_rows
from hicache.core.layout import BytePlane, KVLayout
from hicache.memory.pools import DevicePool
from hicache.core.types import Row

SENTINEL = 0xA5
HAS_CUDA = torch.cuda.is_available()
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu,
                                             pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")])]
LAYOUTS = {
    "mha": dict(num_layers=2, num_kv_heads=2, head_dim=8),
    "mla": dict(num_layers=2, kind="mla", kv_lora_rank=7, rope_dim=2),  # 18-byte rows: narrow path
    "bytes": dict(num_layers=1, num_kv_heads=1, head_dim=16, dtype="float8_e4m3fn",
                  extra_planes=(BytePlane("idx", 132), BytePlane("odd", 3)), draft_layers=1),
}


def raw(pool: DevicePool) -> list[torch.Tensor]:
    return [b.view(-1).view(torch.uint8) for b in pool.buffers]


def make_rows(pool: DevicePool, planes: list[int], n: int, gen: torch.Generator) -> list[torch.Tensor]:
    """Random rows per plane; MHA rows are a non-contiguous head slice (like K from fused QKV)."""
    out = []
    for j in planes:
        s = pool.layout.planes[j]
        if len(s.row_shape) == 2:
            wide = (n, s.row_shape[0] + 1, *s.row_shape[1:])
            big = torch.randint(0, 256, (n * s.row_bytes * 2,), dtype=torch.uint8, generator=gen)
            big = big[:n * (s.row_shape[0] + 1) * s.row_shape[1] * s.dtype.itemsize]
            t = big.view(s.dtype).view(wide)[:, 1:]
        else:
            t = torch.randint(0, 256, (n, s.row_bytes), dtype=torch.uint8, generator=gen).view(s.dtype)
        out.append(t.to(pool.device))
    return out


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("kind", sorted(LAYOUTS))
def test_store_writes_only_valid_rows(kind, page_size, device):
    layout = KVLayout("test-model", page_size=page_size, **LAYOUTS[kind])
    pool = DevicePool(layout, 5, device=device)
    gen = torch.Generator().manual_seed(page_size * 31 + len(kind))
    n_slots = 5 * page_size
    n = min(13, n_slots)
    slots = torch.randperm(n_slots, generator=gen)[:n]
    prov = torch.tensor([(Row.VALID, Row.CP_PAGE_TAIL, Row.VALID, Row.STATIC_PAD)[k % 4] for k in range(n)],
                        dtype=torch.uint8)
    planes = [s.index for s in layout.planes_of_layer(0)] + [len(layout.planes) - 1]
    planes = sorted(set(planes))
    rows = make_rows(pool, planes, n, gen)
    dev = torch.device(device)
    copier = PageCopier()

    for b in raw(pool):
        b.fill_(SENTINEL)
    got_n = copier.store_rows(pool, planes, rows, slots.to(dev), prov.to(dev), backend="triton", debug=True)
    assert got_n == int((prov == Row.VALID).sum())
    got = [b.cpu().clone() for b in raw(pool)]

    expected = [torch.full_like(g, SENTINEL) for g in got]
    for j, r in zip(planes, rows):
        rb = layout.planes[j].row_bytes
        flat = r.cpu().contiguous().view(torch.uint8).reshape(n, rb)
        for k in range(n):
            if prov[k] == Row.VALID:
                expected[j][slots[k] * rb:(slots[k] + 1) * rb] = flat[k]
    for j, (g, e) in enumerate(zip(got, expected)):
        assert torch.equal(g, e), f"plane {j}: wrong bytes (padding rows must write nothing)"

    for b in raw(pool):
        b.fill_(SENTINEL)
    assert copier.store_rows(pool, planes, rows, slots.to(dev), prov.to(dev), backend="torch") == got_n
    for g, b in zip(got, raw(pool)):
        assert torch.equal(g, b.cpu())
    pool.check_integrity()


def test_all_padding_writes_nothing_and_returns_zero():
    layout = KVLayout("m", num_layers=1, num_kv_heads=1, head_dim=8, page_size=4)
    pool = DevicePool(layout, 2)
    for b in raw(pool):
        b.fill_(SENTINEL)
    rows = [torch.ones(3, 1, 8, dtype=torch.bfloat16)]
    prov = torch.full((3,), Row.STATIC_PAD, dtype=torch.uint8)
    assert store_rows(pool, [0], rows, torch.tensor([0, 1, 2]), prov, backend="triton") == 0
    assert all(bool((b == SENTINEL).all()) for b in raw(pool))


def test_store_errors():
    layout = KVLayout("m", num_layers=1, num_kv_heads=1, head_dim=8, page_size=4)
    pool = DevicePool(layout, 2)
    rows = [torch.ones(3, 1, 8, dtype=torch.bfloat16)]
    slots = torch.tensor([0, 1, 2])
    with pytest.raises(ProvenanceError, match="rows=3"):
        store_rows(pool, [0], rows, slots, torch.zeros(2, dtype=torch.uint8))
    with pytest.raises(ValueError, match="need torch.bfloat16"):
        store_rows(pool, [0], [torch.ones(3, 1, 8)], slots, torch.zeros(3, dtype=torch.uint8))
    with pytest.raises(ValueError, match="plane indices"):
        store_rows(pool, [0, 1], rows, slots, torch.zeros(3, dtype=torch.uint8))
    with pytest.raises(IndexError, match="slot_ids"):
        store_rows(pool, [0], rows, torch.tensor([0, 1, 8]), torch.zeros(3, dtype=torch.uint8), debug=True)
    with pytest.raises(ValueError, match="repeats"):
        store_rows(pool, [0], rows, torch.tensor([1, 1, 2]), torch.zeros(3, dtype=torch.uint8), debug=True)
    # A repeated slot is fine when only one of the rows is VALID.
    prov = torch.tensor([Row.VALID, Row.STATIC_PAD, Row.VALID], dtype=torch.uint8)
    assert store_rows(pool, [0], rows, torch.tensor([1, 1, 2]), prov, debug=True) == 2
