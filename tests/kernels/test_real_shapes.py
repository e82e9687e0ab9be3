"""The page-copy and row-store kernels at every published model shape
(``hicache.core.shapes``), compared byte for byte with a plain torch copy.

On CPU the Triton kernel runs through Triton's interpreter, which is slow: the
matrix there uses 2 layers (plus the draft layer where the model has one) and
a handful of pages, with each plane's real row and page bytes; one test per
model copies full pages of every layer. The ``gpu`` tests run the same matrix
on the H200 at the full layer count, pinned host pools, and page sizes 16 and 64.
"""
from __future__ import annotations

import zlib

import pytest
import torch

from hicache.kernels.page_copy import PageCopier
from hicache.core.layout import KVLayout
from hicache.memory.pools import DevicePool
from hicache.core.types import Row
from hicache.core.shapes import model_shapes
from tests.kernels.test_page_copy import make_pools

SENTINEL = 0xA5
HAS_CUDA = torch.cuda.is_available()
GPU = [pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")]
SHAPES = {m.name: m for m in model_shapes()}
# Page 16 for every model (vLLM's block, SGLang's common page), 64 where FlashMLA needs it.
CPU_CASES = [(n, 16) for n in SHAPES] + [(n, 64) for n, m in SHAPES.items() if m.is_mla]
GPU_CASES = [(n, ps) for n in SHAPES for ps in (16, 64)]
# gather: device pool -> host pool; scatter: host -> device; both host layouts; and device -> device.
DIRECTIONS = [("d2h", "layer_first"), ("d2h", "page_first"), ("h2d", "layer_first"), ("h2d", "page_first"),
              ("d2d", "layer_first")]


# Many small tensor ops: one torch thread (tests/conftest.py says why).
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def raw(pool) -> list[torch.Tensor]:
    if isinstance(pool, DevicePool):
        return [b.view(-1).view(torch.uint8) for b in pool.buffers]
    return [pool.buffer]


def region(pool, bufs: list[torch.Tensor], plane: int, page: int) -> torch.Tensor:
    """Bytes of (plane, page) inside ``bufs`` (the pool's raw buffers or a copy of them),
    addressed as pools.py documents."""
    nb = pool.layout.planes[plane].page_bytes
    if isinstance(pool, DevicePool):
        return bufs[plane][page * nb:(page + 1) * nb]
    start = pool.plane_offset[plane] + page * pool.page_stride[plane]
    return bufs[0][start:start + nb]


def fill(pool, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for r in raw(pool):
        step = 1 << 24
        for at in range(0, r.numel(), step):
            m = min(step, r.numel() - at)
            r[at:at + m].copy_(torch.randint(0, 256, (m,), dtype=torch.uint8, generator=gen))


def expected_after(src, dst, src_pages: list[int], dst_pages: list[int], planes: list[int]) -> list[torch.Tensor]:
    """The destination's bytes after the copy, made by a plain torch copy of each region
    into a snapshot of the (poisoned) destination."""
    want = [r.clone() for r in raw(dst)]
    src_raw = raw(src)
    for j in planes:
        for s, d in zip(src_pages, dst_pages):
            region(dst, want, j, d).copy_(region(src, src_raw, j, s))
    return want


def check_copy(direction: str, layout: KVLayout, device: str, n_src: int, n_dst: int, n: int,
               planes: list[int] | None, seed_key: str) -> None:
    """Triton copy of ``n`` scattered pages == a plain torch copy of the same regions, every
    other byte untouched; the library's torch path writes the same bytes."""
    seed = zlib.crc32(seed_key.encode())
    gen = torch.Generator().manual_seed(seed)
    src, dst = make_pools(direction, layout, device, n_src, n_dst)
    fill(src, seed)
    sp = torch.randperm(n_src, generator=gen)[:n].tolist()
    dp = torch.randperm(n_dst, generator=gen)[:n].tolist()
    sel = list(range(len(layout.planes))) if planes is None else planes
    for r in raw(dst):
        r.fill_(SENTINEL)
    want = expected_after(src, dst, sp, dp, sel)
    copier = PageCopier()
    kdev = torch.device(device)
    copier.copy_pages(src, dst, torch.tensor(sp, device=kdev), torch.tensor(dp, device=kdev), planes=planes,
                      backend="triton", debug=True)
    if device == "cuda":
        torch.cuda.synchronize()
    for j, (got, w) in enumerate(zip(raw(dst), want)):
        assert torch.equal(got, w), f"{seed_key}: buffer {j} differs from a plain torch copy"
    for r in raw(dst):
        r.fill_(SENTINEL)
    copier.copy_pages(src, dst, sp, dp, planes=planes, backend="torch")
    for got, w in zip(raw(dst), want):
        assert torch.equal(got, w), f"{seed_key}: the torch path differs"
    copier.check_integrity()
    src.check_integrity()
    dst.check_integrity()


def layer_planes(layout: KVLayout, layer: int, draft: bool = False) -> list[int]:
    return [p.index for p in layout.planes_of_layer(layer, draft)]


# ---------------------------------------------------------------- CPU (interpreter)

@pytest.mark.parametrize("direction,host_layout", DIRECTIONS)
@pytest.mark.parametrize("name,page_size", CPU_CASES)
def test_copy_real_rows_interpreted(name, page_size, direction, host_layout):
    """Every plane, 3 scattered pages out of pools of 5 and 6, 2 layers (+ draft)."""
    layout = SHAPES[name].kv_layout(page_size, layers=2, host_layout=host_layout)
    check_copy(direction, layout, "cpu", 5, 6, 3, None, f"{name}/{page_size}/{direction}/{host_layout}")


@pytest.mark.parametrize("name,page_size", CPU_CASES)
def test_copy_one_layer_interpreted(name, page_size):
    """A layer-wise load: layer 1's planes only (the draft layer's where the model has one)."""
    m = SHAPES[name]
    layout = m.kv_layout(page_size, layers=2, host_layout="page_first")
    planes = layer_planes(layout, 0, draft=True) if m.draft_layers else layer_planes(layout, 1)
    check_copy("h2d", layout, "cpu", 4, 4, 2, planes, f"{name}/{page_size}/layer")


@pytest.mark.parametrize("name", list(SHAPES))
def test_copy_full_layer_count_interpreted(name):
    """Every layer of the model: one whole page (2 MiB for Llama-3.1-8B) host -> device."""
    layout = SHAPES[name].kv_layout(16, host_layout="page_first")
    check_copy("h2d", layout, "cpu", 2, 3, 1, None, f"{name}/full")


@pytest.mark.parametrize("name,page_size", CPU_CASES)
def test_store_rows_real_rows_interpreted(name, page_size):
    """New rows of layer 0 (and the last plane) land at their slots; padding rows write nothing."""
    layout = SHAPES[name].kv_layout(page_size, layers=2)
    check_store(layout, "cpu", name)


def check_store(layout: KVLayout, device: str, key: str) -> None:
    pool = DevicePool(layout, 3, device=device)
    gen = torch.Generator().manual_seed(zlib.crc32(key.encode()))
    n_slots = 3 * layout.page_size
    n = min(21, n_slots)
    slots = torch.randperm(n_slots, generator=gen)[:n]
    prov = torch.tensor([(Row.VALID, Row.VALID, Row.CP_PAGE_TAIL, Row.STATIC_PAD)[k % 4] for k in range(n)],
                        dtype=torch.uint8)
    planes = sorted(set(layer_planes(layout, 0) + [len(layout.planes) - 1]))
    rows = [torch.randint(0, 256, (n, layout.planes[j].row_bytes), dtype=torch.uint8, generator=gen)
            .view(layout.planes[j].dtype).view(n, *layout.planes[j].row_shape) for j in planes]
    dev = torch.device(device)
    for b in raw(pool):
        b.fill_(SENTINEL)
    want = [b.cpu().clone() for b in raw(pool)]
    for j, r in zip(planes, rows):
        rb = layout.planes[j].row_bytes
        flat = r.reshape(n, -1).view(torch.uint8)
        for k in range(n):
            if prov[k] == Row.VALID:
                want[j][slots[k] * rb:(slots[k] + 1) * rb] = flat[k]
    copier = PageCopier()
    got_n = copier.store_rows(pool, planes, [r.to(dev) for r in rows], slots.to(dev), prov.to(dev),
                              backend="triton", debug=True)
    assert got_n == int((prov == Row.VALID).sum())
    for j, (b, w) in enumerate(zip(raw(pool), want)):
        assert torch.equal(b.cpu(), w), f"{key}: plane {j} differs from the expected rows"
    for b in raw(pool):
        b.fill_(SENTINEL)
    assert copier.store_rows(pool, planes, [r.to(dev) for r in rows], slots.to(dev), prov.to(dev),
                             backend="torch") == got_n
    for b, w in zip(raw(pool), want):
        assert torch.equal(b.cpu(), w), f"{key}: the torch path differs"
    pool.check_integrity()


# ----------------------------------------------------------------------- GPU (H200)

@pytest.mark.parametrize("direction,host_layout", DIRECTIONS)
@pytest.mark.parametrize("name,page_size", GPU_CASES)
@pytest.mark.parametrize("device", [pytest.param("cuda", marks=GPU)])
def test_copy_real_shapes_gpu(name, page_size, direction, host_layout, device):
    """Every layer, 6 scattered pages out of pools of 9 and 11; host pools pinned."""
    layout = SHAPES[name].kv_layout(page_size, host_layout=host_layout)
    check_copy(direction, layout, device, 9, 11, 6, None, f"gpu/{name}/{page_size}/{direction}/{host_layout}")


@pytest.mark.parametrize("direction,host_layout", DIRECTIONS)
@pytest.mark.parametrize("name,page_size", GPU_CASES)
@pytest.mark.parametrize("device", [pytest.param("cuda", marks=GPU)])
def test_copy_layer_by_layer_gpu(name, page_size, direction, host_layout, device):
    """Layer-wise: the last target layer's planes, then the draft layer's where there is one."""
    m = SHAPES[name]
    layout = m.kv_layout(page_size, host_layout=host_layout)
    check_copy(direction, layout, device, 9, 11, 6, layer_planes(layout, layout.num_layers - 1),
               f"gpu/{name}/{page_size}/{direction}/{host_layout}/last")
    if m.draft_layers:
        check_copy(direction, layout, device, 9, 11, 6, layer_planes(layout, 0, draft=True),
                   f"gpu/{name}/{page_size}/{direction}/{host_layout}/draft")


@pytest.mark.parametrize("name,page_size", GPU_CASES)
@pytest.mark.parametrize("device", [pytest.param("cuda", marks=GPU)])
def test_store_rows_real_shapes_gpu(name, page_size, device):
    check_store(SHAPES[name].kv_layout(page_size), device, f"gpu/{name}/{page_size}")
