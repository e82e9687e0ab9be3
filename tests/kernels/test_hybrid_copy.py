"""Hybrid copy plans (``hicache.transfer.hybrid_copy``) and the per-group layer-wise load back
(``hicache.transfer.hybrid_load``): the page-copy kernel (interpreted on CPU, compiled on a GPU)
moves exactly the full pages, the SWA window and the snapshot of a boundary, byte for
byte against a contiguous torch copy computed here, at the real gpt-oss-120b and
qwen3-next-80b-a3b shapes; a layer's wait never needs another group's copy."""
from __future__ import annotations

import threading
import time
import zlib

import pytest
import torch

from hicache.core.errors import InvalidArgument, TransferError
from hicache.core.groups import LayerGroup, hybrid_layout, resumable_floor, stored_bytes
from hicache.transfer.hybrid_copy import (NotResumable, needed, plan_load, run_plan, state_layer_offset, state_layout)
from hicache.transfer.hybrid_load import HybridLoader
from hicache.kernels.page_copy import PageCopier
from hicache.core.layout import KVLayout
from hicache.memory.pools import DevicePool, HostPool
from hicache.core.shapes import model_shape
from tests.kernels.test_page_copy import page_bytes_of as region, raw

SENTINEL = 0xA5
HAS_CUDA = torch.cuda.is_available()
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu,
                                             pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")])]
# (shape, page size, boundary in pages): past gpt-oss's 128-token window at both page sizes,
# and at qwen3-next's second snapshot (snapshot_every 8).
REAL = [("gpt-oss-120b", 16, 20), ("gpt-oss-120b", 1, 150), ("qwen3-next-80b-a3b", 16, 16)]
HOST_LAYOUT = {REAL[0]: "page_first"}  # the others layer_first (both host layouts, one kernel)


def toy(page_size: int = 4, **kw) -> KVLayout:
    groups = kw.pop("groups", (LayerGroup("swa", (0, 2), window=6), LayerGroup("full", (1, 3))))
    return KVLayout("toy", num_layers=4, num_kv_heads=2, head_dim=8, page_size=page_size, groups=groups, **kw)


def pools(layout: KVLayout, device: str, n_src: int, n_dst: int, gen: torch.Generator):
    """A random host pool and a poisoned device pool of ``layout``."""
    src, dst = HostPool(layout, n_src, pin=device == "cuda"), DevicePool(layout, n_dst, device=device)
    src.buffer.copy_(torch.randint(0, 256, src.buffer.shape, dtype=torch.uint8, generator=gen))
    for r in raw(dst):
        r.fill_(SENTINEL)
    return src, dst


def ids(layout: KVLayout, n: int, n_src: int, n_dst: int, n_state_src: int, n_state_dst: int,
        gen: torch.Generator):
    """Per group, per prefix page: random distinct ids on each side (snapshots only at the
    state group's snapshot boundaries). Full and SWA groups share the KV page ids."""
    kv_s, kv_d = torch.randperm(n_src, generator=gen)[:n].tolist(), torch.randperm(n_dst, generator=gen)[:n].tolist()
    st_s, st_d = torch.randperm(n_state_src, generator=gen).tolist(), torch.randperm(n_state_dst, generator=gen).tolist()
    src, dst = [], []
    for g in layout.groups:
        if g.kind != "state":
            src.append(list(kv_s))
            dst.append(list(kv_d))
            continue
        s: list[int | None] = [None] * n
        d: list[int | None] = [None] * n
        for k, b in enumerate(range(g.snapshot_every, n + 1, g.snapshot_every)):
            s[b - 1] = st_s[k % len(st_s)]
        d[n - 1] = st_d[0]
        src.append(s)
        dst.append(d)
    return src, dst


def expect(plan, kv_src, kv_dst, st_src, st_dst) -> list[torch.Tensor]:
    """The destinations' bytes after ``plan``: a poisoned copy written with contiguous torch slices."""
    out = {id(p): [r.cpu().clone() for r in raw(p)] for p in (kv_dst, st_dst) if p is not None}
    for c in plan.copies:
        s, d = (st_src, st_dst) if c.kind == "state" else (kv_src, kv_dst)
        for plane in c.planes:
            for sp, dp in zip(c.src, c.dst):
                if isinstance(d, DevicePool):
                    nb = d.layout.planes[plane].page_bytes
                    out[id(d)][plane][dp * nb:(dp + 1) * nb] = region(s, plane, sp).cpu()
    return [t for p in (kv_dst, st_dst) if p is not None for t in out[id(p)]]


def got(kv_dst, st_dst) -> list[torch.Tensor]:
    return [r.cpu() for p in (kv_dst, st_dst) if p is not None for r in raw(p)]


def real_case(name: str, ps: int, b: int, device: str, host_layout: str = "layer_first"):
    lay = hybrid_layout(model_shape(name), ps, host_layout=host_layout)
    gen = torch.Generator().manual_seed(zlib.crc32(repr((name, ps, b)).encode()))
    n_src, n_dst = b + 3, b + 5
    kv_src, kv_dst = pools(lay, device, n_src, n_dst, gen)
    st_src = st_dst = None
    if any(g.kind == "state" for g in lay.groups):
        st_src, st_dst = pools(state_layout(lay), device, 3, 2, gen)
    src, dst = ids(lay, b, n_src, n_dst, 3, 2, gen)
    return lay, kv_src, kv_dst, st_src, st_dst, src, dst


def three_kinds(host_layout: str) -> KVLayout:
    """SWA, full and state groups at once, a draft layer and an odd byte plane (narrow copies)."""
    from hicache.core.layout import BytePlane
    return toy(page_size=4, host_layout=host_layout, draft_layers=1, extra_planes=(BytePlane("idx", 3),),
               groups=(LayerGroup("swa", (0, 2), window=6), LayerGroup("full", (1, 3)),
                       LayerGroup("state", (0, 1, 2), state_bytes=40, snapshot_every=2)))


# ------------------------------------------------------------------ plans
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("name,ps,b", REAL)
def test_plan_moves_full_pages_window_and_snapshot_byte_exact(name, ps, b, backend, device):
    lay, kv_src, kv_dst, st_src, st_dst, src, dst = real_case(name, ps, b, device,
                                                              HOST_LAYOUT.get((name, ps, b), "layer_first"))
    plan = plan_load(lay, b, src, dst)
    want = expect(plan, kv_src, kv_dst, st_src, st_dst)
    run_plan(plan, kv_src, kv_dst, st_src, st_dst, backend=backend, copier=PageCopier())
    if device == "cuda":
        torch.cuda.synchronize()
    for a, w in zip(got(kv_dst, st_dst), want):
        assert torch.equal(a, w), "bytes differ from the contiguous torch copy (or bytes outside the plan moved)"
    for c, g in zip(plan.copies, lay.groups):  # what moved is what the group needs, nothing more
        assert len(c.src) == len(needed(g, b, ps))
        if g.kind == "swa":
            assert len(c.src) == -(-(g.window - 1) // ps) < b
    one_snapshot = sum(g.state_bytes * len(g.layers) for g in lay.groups if g.kind == "state")
    sb = stored_bytes(lay, b, [b])  # the bytes that keep boundary b resumable, snapshots aside
    assert plan.nbytes == sb.hybrid - one_snapshot * sb.snapshots + one_snapshot
    assert plan.every_layer_full == lay.page_bytes * b == sb.every_layer_full
    if any(g.kind == "swa" for g in lay.groups):  # the window is all an SWA group moves
        assert plan.nbytes < plan.every_layer_full
    else:  # full attention moves every page; the state one snapshot
        assert plan.nbytes == plan.every_layer_full + one_snapshot
    kv_dst.check_integrity()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("host_layout", ["layer_first", "page_first"])
@pytest.mark.parametrize("via", ["run_plan", "loader"])
def test_three_group_kinds_draft_and_byte_planes(via, host_layout, device):
    lay = three_kinds(host_layout)
    gen = torch.Generator().manual_seed(zlib.crc32(repr((via, host_layout)).encode()))
    b = 6
    kv_src, kv_dst = pools(lay, device, b + 2, b + 3, gen)
    st_src, st_dst = pools(state_layout(lay), device, 4, 3, gen)
    src, dst = ids(lay, b, b + 2, b + 3, 4, 3, gen)
    plan = plan_load(lay, b, src, dst)
    assert [len(c.src) for c in plan.copies] == [2, b, 1]  # window 6 at page 4: pages 4, 5; one snapshot
    want = expect(plan, kv_src, kv_dst, st_src, st_dst)
    if via == "run_plan":
        run_plan(plan, kv_src, kv_dst, st_src, st_dst, backend="triton", copier=PageCopier(), layerwise=True)
    else:
        loader = HybridLoader(kv_src, kv_dst, st_src, st_dst, copier=PageCopier())
        h = loader.load(plan)
        for i in range(lay.num_layers):
            h.wait_layer(i)
        h.wait_state()
        h.wait()
        loader.close()
    if device == "cuda":
        torch.cuda.synchronize()
    for a, w in zip(got(kv_dst, st_dst), want):
        assert torch.equal(a, w)


def test_snapshot_layers_land_at_their_offsets():
    lay = hybrid_layout(model_shape("qwen3-next-80b-a3b"), 16)
    sl = state_layout(lay)
    g = lay.groups[1]
    assert sl.kind == "rows" and sl.page_size == 1 and sl.planes[0].page_bytes == g.state_bytes * 36
    assert state_layer_offset(lay, 35) == 35 * g.state_bytes
    assert hybrid_layout(model_shape("qwen3-next-80b-a3b"), 16, snapshot_every=4).fingerprint() != lay.fingerprint()
    assert state_layout(hybrid_layout(model_shape("qwen3-next-80b-a3b"), 16, snapshot_every=4)).fingerprint() \
        != sl.fingerprint()
    with pytest.raises(InvalidArgument, match="36 state layers"):
        state_layer_offset(lay, 36)


def test_draft_planes_travel_with_the_full_group():
    lay = toy(draft_layers=1)
    b = 5
    src = [list(range(b)), list(range(b))]
    plan = plan_load(lay, b, src, [[10 + i for i in range(b)]] * 2)
    swa, full = plan.copies
    draft = {s.index for s in lay.planes if s.draft}
    assert full.layers[-1] == -1 and set(full.steps[-1]) == draft and not draft & set(swa.planes)
    assert swa.src == (3, 4) and full.src == tuple(range(b))  # window 6 at page 4: tokens 15..19 -> pages 3, 4
    assert plan.nbytes == sum(lay.planes[p].page_bytes for p in full.planes) * b + \
        sum(lay.planes[p].page_bytes for p in swa.planes) * 2


def test_draft_planes_need_a_full_group():
    lay = toy(draft_layers=1, groups=(LayerGroup("swa", (0, 1, 2, 3), window=6),))
    with pytest.raises(InvalidArgument, match="1 draft layers but no full group"):
        plan_load(lay, 2, [[0, 1]], [[0, 1]])


def test_pages_outside_the_window_may_be_missing_but_not_inside():
    lay = toy()
    b = 5
    full = list(range(b))
    freed = [None, None, None, 3, 4]  # only the window survives on the source
    plan = plan_load(lay, b, [freed, full], [full, full])
    assert plan.copies[0].src == (3, 4)
    assert resumable_floor(lay.groups, 4, [[x is not None for x in freed], [True] * b]).pages == b
    with pytest.raises(NotResumable, match=r"group 0 \(swa\).*page \[3\]"):
        plan_load(lay, b, [[0, 1, 2, None, 4], full], [full, full])
    with pytest.raises(InvalidArgument, match="each needed entry needs its own id"):
        plan_load(lay, b, [full, full], [full, [0, 1, 2, 2, 4]])
    with pytest.raises(InvalidArgument, match="2 rows for 2 layer groups|boundary 5 needs 5"):
        plan_load(lay, b, [full[:4], full], [full, full])
    with pytest.raises(InvalidArgument, match="3 rows for 2 layer groups"):
        plan_load(lay, b, [full] * 3, [full] * 2)


def test_resident_entries_do_not_move_and_boundary_zero_moves_nothing():
    lay = toy()
    full = list(range(5))
    plan = plan_load(lay, 5, [full, full], [full, full], resident=[[True] * 5, [True, True, False, False, False]])
    assert plan.copies[0].src == () and plan.copies[1].src == (2, 3, 4)
    assert plan_load(lay, 0, [[], []], [[], []]).nbytes == 0


def test_state_group_needs_the_snapshot_at_the_boundary():
    lay = toy(groups=(LayerGroup("full", (0, 1, 2, 3)), LayerGroup("state", (0, 1), state_bytes=48,
                                                                   snapshot_every=2)))
    full = list(range(4))
    with pytest.raises(NotResumable, match=r"group 1 \(state\).*snapshot at boundary \[4\]"):
        plan_load(lay, 4, [full, [None, 7, None, None]], [full, [None] * 3 + [0]])
    plan = plan_load(lay, 2, [full, [None, 7, None, None]], [full, [None, 0, None, None]])
    assert plan.copies[1].src == (7,) and plan.copies[1].dst == (0,) and plan.copies[1].nbytes == 96
    with pytest.raises(InvalidArgument, match="pass state_src and state_dst"):
        run_plan(plan, HostPool(lay, 4), DevicePool(lay, 4))


# ------------------------------------------------------------- per-group waits
class GatedCopier(PageCopier):
    """A copier whose copies of ``gated`` planes wait for ``gate`` (CPU): another group's
    copy that has not happened yet."""

    def __init__(self, gated: set[int], state_gated: bool = False):
        super().__init__()
        self.gate, self.gated, self.state_gated = threading.Event(), gated, state_gated

    def copy_pages(self, src, dst, *a, planes=None, **kw):
        if (src.layout.kind == "rows" and self.state_gated) or (self.gated & set(planes or ())):
            assert self.gate.wait(60), "gate never opened"
        return super().copy_pages(src, dst, *a, planes=planes, **kw)


def _returns(fn, timeout: float = 30.0) -> bool:
    t = threading.Thread(target=fn, daemon=True)
    t.start()
    t.join(timeout)
    return not t.is_alive()


@pytest.mark.parametrize("name,ps,b", REAL[:1] + REAL[2:])
def test_a_layer_waits_for_its_own_group_only(name, ps, b):
    lay, kv_src, kv_dst, st_src, st_dst, src, dst = real_case(name, ps, b, "cpu")
    plan = plan_load(lay, b, src, dst)
    other = next(gi for gi, g in enumerate(lay.groups) if g.kind != "full")
    full = next(gi for gi, g in enumerate(lay.groups) if g.kind == "full")
    cp = GatedCopier(set(plan.copies[other].planes) if lay.groups[other].kind == "swa" else set(),
                     state_gated=lay.groups[other].kind == "state")
    want = expect(plan, kv_src, kv_dst, st_src, st_dst)
    loader = HybridLoader(kv_src, kv_dst, st_src, st_dst, copier=cp)
    loader.check_integrity()
    h = loader.load(plan)
    assert [len(e) for e in h.events] == [len(c.steps) for c in plan.copies]  # an event per step, per group
    last_full = lay.groups[full].layers[-1]
    assert _returns(lambda: h.wait_layer(last_full)), "a full-attention layer waited for another group's copy"
    assert h.group_ready(full) and not h.group_ready(other)
    if lay.groups[other].kind == "swa":
        assert not h.layer_ready(lay.groups[other].layers[0])
    cp.gate.set()
    assert _returns(h.wait)
    assert h.done()
    for a, w in zip(got(kv_dst, st_dst), want):
        assert torch.equal(a, w)
    loader.check_integrity()
    loader.close()


def test_a_failed_group_raises_for_its_layers_only():
    lay = toy()
    gen = torch.Generator().manual_seed(3)
    kv_src, kv_dst = pools(lay, "cpu", 6, 6, gen)
    full = list(range(5))
    plan = plan_load(lay, 5, [full, full], [full, full])

    class Failing(PageCopier):
        def copy_pages(self, src, dst, *a, planes=None, **kw):
            if set(planes or ()) & set(plan.copies[0].planes):
                raise RuntimeError("swa copy broke")
            return super().copy_pages(src, dst, *a, planes=planes, **kw)

    loader = HybridLoader(kv_src, kv_dst, copier=Failing())
    h = loader.load(plan)
    h.wait_layer(3)  # full
    with pytest.raises(TransferError, match="group 0 \\(swa\\) failed.*swa copy broke"):
        h.wait_layer(0)
    loader.close()
    with pytest.raises(InvalidArgument, match="after close"):
        loader.load(plan)


# ----------------------------------------------------------------- on the GPU
@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("name,ps,b", REAL)
def test_gpu_streams_do_not_wait_for_another_group(name, ps, b):
    """On the H200: the non-full group's stream is held by a device-side wait on a pinned
    flag; every full-attention layer lands, and a stream that waited on it runs, while
    the other group has not moved a byte; then the flag opens and every byte is right.

    While the hold is on, nothing may load a kernel (CUDA's lazy loading synchronises the
    context, which would wait for the held stream): a first, unheld load warms everything
    up, and the held group's bytes are read back by plain copies, compared on the host."""
    from hicache.transfer.load_graph import _stream_wait_value_works, _wait_value64

    if not _stream_wait_value_works(torch.device("cuda")):
        pytest.fail("cuStreamWaitValue64 is unavailable: the hold cannot be placed")
    lay, kv_src, kv_dst, st_src, st_dst, src, dst = real_case(name, ps, b, "cuda")
    plan = plan_load(lay, b, src, dst)
    other = next(gi for gi, g in enumerate(lay.groups) if g.kind != "full")
    full = next(gi for gi, g in enumerate(lay.groups) if g.kind == "full")
    want = expect(plan, kv_src, kv_dst, st_src, st_dst)
    loader = HybridLoader(kv_src, kv_dst, st_src, st_dst, copier=PageCopier())
    loader.load(plan).wait()
    for a, w in zip(got(kv_dst, st_dst), want):
        assert torch.equal(a, w)
    for p in (kv_dst, st_dst):
        for r in raw(p) if p is not None else ():
            r.fill_(SENTINEL)
    torch.cuda.synchronize()
    oc = plan.copies[other]
    d = st_dst if oc.kind == "state" else kv_dst
    flag = torch.zeros(1, dtype=torch.int64).pin_memory()
    _wait_value64(loader.streams[other], flag.data_ptr(), 1)
    try:
        h = loader.load(plan)
        h.wait_layer(lay.groups[full].layers[-1])
        after = torch.cuda.Event()
        after.record()
        deadline = time.monotonic() + 20
        while not after.query() and time.monotonic() < deadline:
            time.sleep(0.001)
        assert after.query(), "the compute stream's wait on a full layer needed the held group's copy"
        assert h.group_ready(full) and not h.group_ready(other)
        for dp in oc.dst:
            assert bool((region(d, oc.planes[0], dp).cpu() == SENTINEL).all()), "the held group moved"
    finally:
        flag.fill_(1)
    h.wait()
    torch.cuda.synchronize()
    assert h.done()
    for a, w in zip(got(kv_dst, st_dst), want):
        assert torch.equal(a, w)
    loader.check_integrity()
    loader.close()
