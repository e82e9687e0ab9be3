"""Layer groups' loads on the one transfer engine (``TransferController.add_group``): each
group's ``LoadPlan`` moves exactly its layers' planes of its pages (the full pages, the SWA
window) or the snapshot row, byte for byte against torch slices computed here, at the real
gpt-oss-120b and qwen3-next-80b-a3b shapes, both host layouts; on a GPU (marked) every load
is one CUDA-graph replay of its group's captured graph. Layers load in submission order on
the one lane: a load's layer ``k`` never waits for a later load."""
from __future__ import annotations

import zlib

import pytest
import torch

from hicache.cache.hybrid import group_layout
from hicache.core.groups import hybrid_layout
from hicache.core.shapes import model_shape
from hicache.memory.pools import DevicePool, HostPool
from hicache.transfer.engine import TransferController
from hicache.tiers.plans import LoadPlan
from tests.kernels.test_page_copy import page_bytes_of as region, raw

SENTINEL = 0xA5
HAS_CUDA = torch.cuda.is_available()
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu,
                                             pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")])]
# (shape, page size, boundary in pages, host layout): past gpt-oss's 128-token window at both
# page sizes, and at qwen3-next's second snapshot (snapshot_every 8).
REAL = [("gpt-oss-120b", 16, 20, "page_first"), ("gpt-oss-120b", 1, 150, "layer_first"),
        ("qwen3-next-80b-a3b", 16, 16, "layer_first")]


def _pools(layout, device: str, n_src: int, n_dst: int, gen: torch.Generator):
    """A random host pool and a poisoned device pool of ``layout``."""
    src, dst = HostPool(layout, n_src, pin=device == "cuda"), DevicePool(layout, n_dst, device=device)
    src.buffer.copy_(torch.randint(0, 256, src.buffer.shape, dtype=torch.uint8, generator=gen))
    for r in raw(dst):
        r.fill_(SENTINEL)
    return src, dst


def _case(name: str, ps: int, b: int, host_layout: str, device: str):
    """The engine over the layout's KV pools, each KV group registered on its layers, the state
    group on pools of its own; one plan per group for boundary ``b`` (full groups last)."""
    lay = hybrid_layout(model_shape(name), ps, snapshot_every=8, host_layout=host_layout)
    gen = torch.Generator().manual_seed(zlib.crc32(repr((name, ps, b)).encode()))
    host, dev = _pools(lay, device, b + 5, b + 3, gen)
    tc = TransferController(dev, host)
    hs, ds = torch.randperm(b + 5, generator=gen)[:b].tolist(), torch.randperm(b + 3, generator=gen)[:b].tolist()
    plans, pools = [], {}
    for gi, g in sorted(enumerate(lay.groups), key=lambda e: e[1].kind == "full"):
        if g.kind == "state":
            pools[gi] = _pools(group_layout(lay, ("state",), gi), device, 3, 2, gen)
            tc.add_group(gi, pools[gi][1], pools[gi][0])
            plans.append(LoadPlan(None, (), [2], [1], None, group=gi))
            continue
        pools[gi] = (host, dev)
        tc.add_group(gi, dev, host, layers=g.layers)
        lo = 0 if g.kind == "full" else max(0, b * ps - g.window + 1) // ps
        plans.append(LoadPlan(None, (), hs[lo:], ds[lo:], None, group=gi))
    return lay, tc, plans, pools


def _expect(lay, plans, pools) -> dict[int, list[torch.Tensor]]:
    """Each device pool's bytes after the plans: poison, then each group's planes of its pages."""
    out = {id(d): [r.cpu().clone() for r in raw(d)] for _, d in pools.values()}
    for p in plans:
        g, (s, d) = lay.groups[p.group], pools[p.group]
        planes = [0] if g.kind == "state" else [q.index for i in g.layers for q in lay.planes_of_layer(i)]
        for plane in planes:
            nb = d.layout.planes[plane].page_bytes
            for sp, dp in zip(p.host, p.device):
                out[id(d)][plane][dp * nb:(dp + 1) * nb] = region(s, plane, sp).cpu()
    return out


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name,ps,b,host_layout", REAL)
def test_group_loads_move_their_layers_window_and_snapshot_byte_exact(name, ps, b, host_layout, device):
    lay, tc, plans, pools = _case(name, ps, b, host_layout, device)
    want = _expect(lay, plans, pools)
    handles = [tc.load_handle(tc.submit(p)) for p in plans]
    for p, h in zip(plans, handles):
        g = lay.groups[p.group]
        assert h.num_layers == (1 if g.kind == "state" else len(g.layers))
        for k in range(h.num_layers):
            h.wait_layer(k)  # GPU: the current stream waits for layer k of this group's load
    if device == "cuda":
        torch.cuda.current_stream().synchronize()
        assert tc._graph is None and set(tc._group_graphs) == {p.group for p in plans}  # one replay per load
    for _, d in {id(d): (s, d) for s, d in pools.values()}.values():
        assert all(torch.equal(a.cpu(), w) for a, w in zip(raw(d), want[id(d)])), f"{d.layout.model_id} differs"
    done = tc.finished()
    assert [r.ok for r in done] == [True] * len(plans)
    assert tc.bytes_moved["h2d"] == sum(len(p.host) * tc._group_page_bytes[p.group] for p in plans)
    tc.check_integrity()
    tc.close()


def test_a_layer_group_is_registered_once_with_an_index_of_its_own():
    lay, tc, _, pools = _case("gpt-oss-120b", 16, 20, "page_first", "cpu")
    from hicache.core.errors import TransferError
    with pytest.raises(TransferError, match="layer group 0 is registered already"):
        tc.add_group(0, *pools[0][::-1])
    with pytest.raises(TransferError, match="not >= 0"):
        tc.add_group(-1, *pools[0][::-1])
    tc.close()
