"""copy_pages: Triton kernel (interpreted on CPU, compiled on a GPU) vs the torch path
vs an expectation computed here from the pools' documented addressing."""
from __future__ import annotations

import zlib

import pytest
import torch

from hicache.core.errors import ContractMismatch
from hicache.kernels.page_copy import PageCopier, copy_pages
from hicache.core.layout import BytePlane, KVLayout
from hicache.memory.pools import DevicePool, HostPool

SENTINEL = 0xA5
HAS_CUDA = torch.cuda.is_available()
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu,
                                             pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")])]

# Every kind x plane set: MHA bf16; MLA with an 18-byte row (narrow at page
# size 1); fp8 MHA with byte planes of 132 and 3 bytes per token and a draft layer.
LAYOUTS = {
    "mha": dict(num_layers=3, num_kv_heads=2, head_dim=8),
    "mla": dict(num_layers=2, kind="mla", kv_lora_rank=7, rope_dim=2),
    "fp8_bytes_draft": dict(num_layers=2, num_kv_heads=1, head_dim=16, dtype="float8_e4m3fn",
                            extra_planes=(BytePlane("idx", 132), BytePlane("odd", 3)), draft_layers=1),
}


def make_layout(kind: str, page_size: int, host_layout: str) -> KVLayout:
    return KVLayout("test-model", page_size=page_size, host_layout=host_layout, **LAYOUTS[kind])


def page_bytes_of(pool, plane: int, page: int) -> torch.Tensor:
    """Raw bytes of (plane, page), addressed exactly as pools.py documents."""
    nb = pool.layout.planes[plane].page_bytes
    if isinstance(pool, DevicePool):
        return pool.buffers[plane].view(-1).view(torch.uint8)[page * nb:(page + 1) * nb]
    start = pool.plane_offset[plane] + page * pool.page_stride[plane]
    return pool.buffer[start:start + nb]


def raw(pool) -> list[torch.Tensor]:
    if isinstance(pool, DevicePool):
        return [b.view(-1).view(torch.uint8) for b in pool.buffers]
    return [pool.buffer]


def fill_random(pool, gen: torch.Generator) -> None:
    for r in raw(pool):
        r.copy_(torch.randint(0, 256, r.shape, dtype=torch.uint8, generator=gen))


def poison(pool) -> None:
    for r in raw(pool):
        r.fill_(SENTINEL)


def snapshot(pool) -> list[torch.Tensor]:
    return [r.cpu().clone() for r in raw(pool)]


def make_pools(direction: str, layout: KVLayout, device: str, n_src: int, n_dst: int):
    def dev(n):
        return DevicePool(layout, n, device=device)

    def host(n):
        return HostPool(layout, n, pin=device == "cuda")

    return {"d2h": (dev(n_src), host(n_dst)), "h2d": (host(n_src), dev(n_dst)),
            "d2d": (dev(n_src), dev(n_dst))}[direction]


def plane_set(layout: KVLayout, which: str) -> list[int] | None:
    if which == "all":
        return None
    if which == "layer1":
        return [s.index for s in layout.planes_of_layer(1)]
    draft = [s.index for s in layout.planes_of_layer(0, draft=True)]
    return draft or [s.index for s in layout.planes_of_layer(0)][::-1]  # reversed order also works


CASES = [(d, hl) for d in ("d2h", "h2d") for hl in ("layer_first", "page_first")] + [("d2d", "layer_first")]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("which", ["all", "layer1", "draft"])
@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("kind", sorted(LAYOUTS))
@pytest.mark.parametrize("direction,host_layout", CASES)
def test_copy_matches_reference_and_leaves_other_pages(direction, host_layout, kind, page_size,
                                                       which, device):
    layout = make_layout(kind, page_size, host_layout)
    gen = torch.Generator().manual_seed(zlib.crc32(repr((direction, host_layout, kind, page_size, which)).encode()))
    n_src, n_dst, n = 9, 11, 5  # odd counts; n pairs out of a larger pool
    src, dst = make_pools(direction, layout, device, n_src, n_dst)
    fill_random(src, gen)
    src_pages = torch.randperm(n_src, generator=gen)[:n]
    dst_pages = torch.randperm(n_dst, generator=gen)[:n]
    planes = plane_set(layout, which)
    sel = range(len(layout.planes)) if planes is None else planes
    kdev = torch.device(device)
    copier = PageCopier()

    poison(dst)
    copier.copy_pages(src, dst, src_pages.to(kdev), dst_pages.to(kdev), planes=planes,
                      backend="triton", num_blocks=3, debug=True)
    if device == "cuda":
        torch.cuda.synchronize()
    got = snapshot(dst)
    # Expected: exactly the selected (plane, dst page) regions changed, with source bytes.
    for j in range(len(layout.planes)):
        for s_p, d_p in zip(src_pages.tolist(), dst_pages.tolist()):
            region = page_bytes_of(dst, j, d_p)
            if j in sel:
                assert torch.equal(region.cpu(), page_bytes_of(src, j, s_p).cpu()), (j, s_p, d_p)
                region.fill_(SENTINEL)
    for r in raw(dst):  # every byte not expected to change is still the sentinel
        assert bool((r == SENTINEL).all()), "bytes outside the copied pages changed"

    poison(dst)
    copier.copy_pages(src, dst, src_pages.tolist(), dst_pages.tolist(), planes=planes, backend="torch")
    for a, b in zip(got, snapshot(dst)):
        assert torch.equal(a, b), "triton and torch paths wrote different bytes"
    copier.check_integrity()
    src.check_integrity()
    dst.check_integrity()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("num_blocks", [1, 2, 7, None])
def test_grid_size_does_not_change_bytes(device, num_blocks):
    layout = make_layout("fp8_bytes_draft", 16, "page_first")
    gen = torch.Generator().manual_seed(7)
    src, dst = make_pools("d2h", layout, device, 13, 13)
    fill_random(src, gen)
    poison(dst)
    perm = torch.randperm(13, generator=gen).to(device)
    copy_pages(src, dst, perm, perm.flip(0).contiguous(), num_blocks=num_blocks, backend="triton")
    for p, q in zip(perm.tolist(), perm.flip(0).tolist()):
        for j in range(len(layout.planes)):
            assert torch.equal(page_bytes_of(dst, j, q).cpu(), page_bytes_of(src, j, p).cpu())


def reversed_pairs(device: str, seed: int):
    """13 random host pages (wide and narrow planes, a draft layer) to a poisoned device pool:
    pair k moves page perm[k] to page perm[12 - k]."""
    layout = make_layout("fp8_bytes_draft", 16, "page_first")
    gen = torch.Generator().manual_seed(seed)
    src, dst = make_pools("h2d", layout, device, 13, 13)
    fill_random(src, gen)
    poison(dst)
    perm = torch.randperm(13, generator=gen)
    return layout, src, dst, perm, perm.to(device), perm.flip(0).contiguous().to(device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("count", [0, 1, 9, 13])
def test_count_from_device_memory_moves_only_the_leading_pairs(device, count):
    """``count=``: the kernel reads the number of pairs at run time (CUDA-graph replays
    of fixed-size index buffers); pairs past it are not touched."""
    layout, src, dst, perm, s_idx, d_idx = reversed_pairs(device, seed=11)
    copy_pages(src, dst, s_idx, d_idx, backend="triton",
               count=torch.tensor([count], dtype=torch.int64, device=device))
    for k, (p, q) in enumerate(zip(perm.tolist(), perm.flip(0).tolist())):
        for j in range(len(layout.planes)):
            got = page_bytes_of(dst, j, q).cpu()
            if k < count:
                assert torch.equal(got, page_bytes_of(src, j, p).cpu()), (k, j)
            else:
                assert bool((got == SENTINEL).all()), (k, j)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("blocks", [1, 3])
def test_signal_sets_the_flag_to_the_epoch_once_the_whole_copy_is_done(device, blocks):
    """``signal=``: after the copy every program has counted itself, the last one wrote the
    epoch to the flag (pinned host memory on a GPU) and reset the counter for the next launch;
    a launch with nothing to copy (count 0) still signals; values are those of a plain copy."""
    layout, src, dst, perm, s_idx, d_idx = reversed_pairs(device, seed=12)
    counter = torch.zeros(1, dtype=torch.int64, device=device)
    flag = torch.zeros(1, dtype=torch.int64)
    flag = flag.pin_memory() if device == "cuda" else flag
    for epoch, count in ((1, 9), (2, 0), (3, 13)):
        ep = torch.tensor([epoch], dtype=torch.int64, device=device)
        copy_pages(src, dst, s_idx, d_idx, backend="triton", num_blocks=blocks,
                   count=torch.tensor([count], dtype=torch.int64, device=device), signal=(counter, flag, ep))
        if device == "cuda":
            torch.cuda.synchronize()
        assert int(flag) == epoch and int(counter) == 0, (epoch, int(flag), int(counter))
    for p, q in zip(perm.tolist(), perm.flip(0).tolist()):
        for j in range(len(layout.planes)):
            assert torch.equal(page_bytes_of(dst, j, q).cpu(), page_bytes_of(src, j, p).cpu()), (p, j)


def test_signal_is_checked():
    layout = make_layout("mha", 4, "layer_first")
    d, h = DevicePool(layout, 4), HostPool(layout, 4)
    one = torch.zeros(1, dtype=torch.int64)
    with pytest.raises(ValueError, match="needs the kernel backend"):
        copy_pages(d, h, [0], [0], backend="torch", signal=(one, one, one))
    with pytest.raises(ValueError, match="epoch is .* not one int64"):
        copy_pages(d, h, [0], [0], backend="triton", signal=(one, one, one.int()))
    with pytest.raises(ValueError, match="counter, flag, epoch"):
        copy_pages(d, h, [0], [0], backend="triton", signal=(one, one))


def test_count_must_be_one_int64_on_the_launch_device():
    layout = make_layout("mha", 4, "layer_first")
    d, h = DevicePool(layout, 4), HostPool(layout, 4)
    for bad in (torch.tensor([1, 2]), torch.tensor([1], dtype=torch.int32)):
        with pytest.raises(ValueError, match="count: a one-element int64"):
            copy_pages(d, h, [0], [0], backend="triton", count=bad)
    with pytest.raises(ValueError, match="torch backend"):
        copy_pages(d, h, [0], [0], backend="torch", count=torch.tensor([1]))


def test_plan_is_cached_per_pair_and_planes():
    layout = make_layout("mha", 16, "layer_first")
    d, h = DevicePool(layout, 4), HostPool(layout, 4)
    c = PageCopier()
    assert c.plan(d, h) is c.plan(d, h)
    assert c.plan(d, h, [0, 1]) is c.plan(d, h, (0, 1))
    assert c.plan(d, h) is not c.plan(h, d)
    p = c.plan(d, h, [2, 3])
    assert (p.t_wide, p.t_narrow, p.bytes_per_pair) == (2, 0, 2 * 16 * 2 * 8 * 2)
    c.check_integrity()


def test_auto_backend_on_cpu_is_torch_and_exact():
    layout = make_layout("mla", 1, "page_first")
    d, h = DevicePool(layout, 3), HostPool(layout, 3)
    fill_random(d, torch.Generator().manual_seed(1))
    poison(h)
    copy_pages(d, h, [2, 0], [0, 2])
    for j in range(len(layout.planes)):
        assert torch.equal(page_bytes_of(h, j, 0), page_bytes_of(d, j, 2))
        assert torch.equal(page_bytes_of(h, j, 2), page_bytes_of(d, j, 0))
        assert bool((page_bytes_of(h, j, 1) == SENTINEL).all())


def test_empty_copy_is_a_no_op():
    layout = make_layout("mha", 1, "layer_first")
    d, h = DevicePool(layout, 2), HostPool(layout, 2)
    poison(h)
    copy_pages(d, h, [], [], backend="triton")
    assert bool((h.buffer == SENTINEL).all())


def test_argument_errors_name_the_problem():
    layout = make_layout("mha", 4, "layer_first")
    d, h = DevicePool(layout, 4), HostPool(layout, 4)
    with pytest.raises(ValueError, match="dst_pages 1"):
        copy_pages(d, h, [0, 1], [0])
    with pytest.raises(TypeError, match="int64"):
        copy_pages(d, h, torch.tensor([0], dtype=torch.int32), [0])
    with pytest.raises(ValueError, match="planes"):
        copy_pages(d, h, [0], [0], planes=[99])
    with pytest.raises(ValueError, match="host->host"):
        copy_pages(h, HostPool(layout, 4), [0], [0], backend="triton")
    with pytest.raises(IndexError, match=r"\[0, 4\)"):
        copy_pages(d, h, [0], [4], debug=True)
    with pytest.raises(ValueError, match="repeats"):
        copy_pages(d, h, [0, 1], [2, 2], debug=True)
    with pytest.raises(ValueError, match="backend"):
        copy_pages(d, h, [0], [0], backend="cuda")
    with pytest.raises(ContractMismatch, match="head_dim"):
        copy_pages(d, HostPool(layout.replace(head_dim=16), 4), [0], [0])


def test_host_to_host_torch_path():
    a = make_layout("mha", 4, "layer_first")
    h1, h2 = HostPool(a, 3), HostPool(a.replace(host_layout="page_first"), 3)
    fill_random(h1, torch.Generator().manual_seed(3))
    poison(h2)
    copy_pages(h1, h2, [1], [2])
    for j in range(len(a.planes)):
        assert torch.equal(page_bytes_of(h2, j, 2), page_bytes_of(h1, j, 1))
