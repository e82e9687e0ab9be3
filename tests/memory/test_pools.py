import itertools

import pytest
import torch

from hicache.core.errors import PoolError
from hicache.core.layout import BytePlane, KVLayout
from hicache.memory.pools import HOST_ALIGN, DevicePool, HostPool

KINDS = {
    "mha": dict(kind="mha", num_kv_heads=2, head_dim=4),
    "mla": dict(kind="mla", kv_lora_rank=6, rope_dim=2),
}
PLANE_SETS = {
    "plain": {},
    "bytes": {"extra_planes": (BytePlane("idx", 3),)},
    "draft": {"draft_layers": 1},
    "bytes+draft": {"extra_planes": (BytePlane("idx", 5),), "draft_layers": 2},
}
CASES = list(itertools.product(["layer_first", "page_first"], KINDS, PLANE_SETS, ["bfloat16", "float8_e4m3fn"]))


def make(host_layout, kind, planes, dtype, page_size=3):
    return KVLayout(model_id="t", num_layers=2, dtype=dtype, page_size=page_size, host_layout=host_layout,
                    **KINDS[kind], **PLANE_SETS[planes])


def fill(t: torch.Tensor, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    t.view(torch.uint8).copy_(torch.randint(0, 256, t.view(torch.uint8).shape, generator=g, dtype=torch.uint8))


@pytest.mark.parametrize("host_layout,kind,planes,dtype", CASES)
def test_host_views_address_disjoint_regions(host_layout, kind, planes, dtype):
    lay = make(host_layout, kind, planes, dtype)
    host = HostPool(lay, 5, pin=False)
    host.check_integrity()
    # Write a distinct byte per (plane, page) through page views; every byte must land once.
    for p in range(5):
        for i, v in enumerate(host.page_view(p).values()):
            v.view(torch.uint8).fill_((p * 31 + i * 7 + 1) % 251)
    for p in range(5):
        for i, v in enumerate(host.page_view(p).values()):
            assert torch.all(v.view(torch.uint8) == (p * 31 + i * 7 + 1) % 251)
    # Offsets are aligned for wide loads.
    assert all(o % HOST_ALIGN == 0 for o in host.plane_offset)
    assert all(s % HOST_ALIGN == 0 or host_layout == "layer_first" for s in host.page_stride)


@pytest.mark.parametrize("host_layout,kind,planes,dtype", CASES)
def test_page_round_trip_and_layer_view(host_layout, kind, planes, dtype):
    lay = make(host_layout, kind, planes, dtype)
    dev = DevicePool(lay, 4)
    host = HostPool(lay, 6, pin=False)
    for b in dev.buffers:
        fill(b, 7)
    # device page 2 -> host page 5 through views, then compare typed views.
    for (key, src), dst in zip(dev.page_view(2).items(), host.page_view(5).values()):
        dst.copy_(src)
    for key, v in host.page_view(5).items():
        assert torch.equal(v.view(torch.uint8), dev.page_view(2)[key].view(torch.uint8)), key
    payload = host.read_page(5)
    assert len(payload) == lay.page_bytes
    host.write_page(1, payload)
    assert host.read_page(1) == payload
    for layer in range(lay.num_layers):
        lv = host.layer_view(layer)
        for name, t in lv.items():
            assert t.shape == (6, lay.page_size, *next(
                s.row_shape for s in lay.planes_of_layer(layer) if s.name == name))
            spec = next(s for s in lay.planes_of_layer(layer) if s.name == name)
            assert torch.equal(t[5].view(torch.uint8), host.plane_page(spec.index, 5).view(torch.uint8))
    for layer in range(lay.draft_layers):
        assert set(host.layer_view(layer, draft=True)) == {s.name for s in lay.planes_of_layer(layer, True)}


def test_canonical_payload_identical_across_host_layouts():
    a = make("layer_first", "mha", "bytes+draft", "bfloat16")
    b = a.replace(host_layout="page_first")
    ha, hb = HostPool(a, 3, pin=False), HostPool(b, 3, pin=False)
    payload = bytes(range(256)) * (a.page_bytes // 256) + bytes(a.page_bytes % 256)
    ha.write_page(2, payload)
    hb.write_page(0, payload)
    assert ha.read_page(2) == hb.read_page(0) == payload
    for key in ha.page_view(2):
        assert torch.equal(ha.page_view(2)[key].view(torch.uint8), hb.page_view(0)[key].view(torch.uint8))


@pytest.mark.parametrize("host_layout", ["layer_first", "page_first"])
def test_write_page_takes_a_read_only_view_of_an_l3_object(host_layout):
    """What an L3 read hands over (a read-only memoryview into a larger object) is
    written as is, with no copy of its own first; neighbouring pages stay untouched."""
    lay = make(host_layout, "mla", "bytes", "bfloat16")
    pool = HostPool(lay, 3, pin=False)
    fill(pool.buffer, 3)
    before = [pool.read_page(p) for p in range(3)]
    obj = bytearray(b"H" * 17 + bytes((i * 7) % 256 for i in range(lay.page_bytes)))
    view = memoryview(obj).toreadonly()[17:]
    pool.write_page(1, view)
    assert pool.read_page(1) == bytes(view)
    assert pool.read_page(0) == before[0] and pool.read_page(2) == before[2]
    with pytest.raises(PoolError, match="holds"):
        pool.write_page(1, view[1:])


def test_registered_buffers_validated():
    lay = make("page_first", "mha", "plain", "bfloat16")
    own = {(s.name, s.layer): torch.zeros(4 * lay.page_size, *s.row_shape, dtype=s.dtype) for s in lay.planes}
    dev = DevicePool(lay, 4, buffers=own)
    assert dev.plane("k", 1) is own[("k", 1)]
    bad = dict(own)
    bad[("v", 0)] = torch.zeros(4 * lay.page_size, 2, 5, dtype=torch.bfloat16)
    with pytest.raises(PoolError, match=r"plane \('v', 0\): got shape"):
        DevicePool(lay, 4, buffers=bad)
    missing = dict(own)
    del missing[("k", 1)]
    with pytest.raises(PoolError, match="lack plane"):
        DevicePool(lay, 4, buffers=missing)


def test_slot_ids():
    lay = make("page_first", "mha", "plain", "bfloat16")
    dev = DevicePool(lay, 4)
    assert dev.slot_ids([2, 0]).tolist() == [6, 7, 8, 0, 1, 2]


def test_host_buffer_too_small():
    lay = make("page_first", "mha", "plain", "bfloat16")
    with pytest.raises(PoolError, match="bytes"):
        HostPool(lay, 4, buffer=torch.zeros(10, dtype=torch.uint8))
