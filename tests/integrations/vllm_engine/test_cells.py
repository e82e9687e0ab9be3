"""``adopt_paged_kv`` against the KV tensors vLLM's CPU attention backend writes.

vLLM's own ``cpu_attn_reshape_and_cache`` (the op its CPU_ATTN backend calls in
every forward) writes known K and V rows into a ``[B, H, N, 2D]`` block tensor;
the pool hicache adopts over it must read back exactly those K and V, and a
page copied to L2 must hold them in the canonical (token, head, dim) order.
"""
from __future__ import annotations

import pytest
import torch

from hicache.core.layout import KVLayout
from hicache.memory.paged_kv import adopt_paged_kv
from hicache.memory.pools import HostPool
from kernels.page_copy import copy_pages


def _write(kv: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor, isa: str) -> None:
    from vllm import _custom_ops as ops
    b, h, n, _ = kv.shape
    kc, vc = kv.view(b, h, 2 * n, -1).chunk(2, dim=2)  # exactly as CPUAttentionBackendImpl.forward
    ops.cpu_attn_reshape_and_cache(key, value, kc, vc, slots, isa)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,head_dim,block,isa", [(2, 64, 32, "vec"), (8, 128, 32, "vec"), (12, 64, 32, "vec"),
                                                      (4, 80, 16, "vec16")])
def test_cpu_attn_planes_hold_k_and_v(dtype, heads, head_dim, block, isa):
    g = torch.Generator().manual_seed(heads * head_dim)
    blocks, tokens = 6, 3 * block + 5
    layout = KVLayout(model_id="m", num_layers=1, num_kv_heads=heads, head_dim=head_dim, page_size=block,
                      dtype=str(dtype).removeprefix("torch."), engine_cells="cpu_attn")
    kv = torch.zeros(blocks, heads, block, 2 * head_dim, dtype=dtype)
    key = torch.randn(tokens, heads, head_dim, generator=g).to(dtype)
    value = torch.randn(tokens, heads, head_dim, generator=g).to(dtype)
    slots = torch.arange(tokens) + 2 * block  # blocks 2, 3, 4 full, 5 partial
    _write(kv, key, value, slots, isa)
    pool = adopt_paged_kv(layout, [kv])
    k, v = pool.plane("k", 0), pool.plane("v", 0)
    for t in range(tokens):
        b, n = divmod(int(slots[t]), block)
        assert torch.equal(k[b, n], key[t]) and torch.equal(v[b, n], value[t]), t
    # Through L2: canonical rows (token-major, then head, then dim), and back into other blocks.
    host = HostPool(layout, 4, pin=False)
    copy_pages(pool, host, [2, 3], [0, 1])
    rows = host.buffer[: 2 * host.layout.planes[0].page_bytes].view(dtype).view(2 * block, heads, head_dim)
    assert torch.equal(rows, key[: 2 * block])
    copy_pages(host, pool, [0, 1], [0, 1])
    assert torch.equal(kv[0], kv[2]) and torch.equal(kv[1], kv[3])  # the engine's own bytes, round trip


def test_the_flash_order_is_wrong_for_cpu_attn():
    """Negative control: read as FlashAttention's (head, token) cells, 1 row in 64 is right."""
    layout = KVLayout(model_id="m", num_layers=1, num_kv_heads=2, head_dim=64, page_size=32, dtype="float32")
    kv = torch.zeros(2, 2, 32, 128)
    key, value = torch.randn(32, 2, 64), torch.randn(32, 2, 64)
    _write(kv, key, value, torch.arange(32), "vec")
    k = adopt_paged_kv(layout, [kv]).plane("k", 0)
    right = sum(torch.equal(k[0, n, h], key[n, h]) for n in range(32) for h in range(2))
    assert right < 64, right


def test_the_fingerprint_names_the_cell_order():
    a = KVLayout(model_id="m", num_layers=1, num_kv_heads=2, head_dim=64, page_size=32, dtype="float32")
    b = a.replace(engine_cells="cpu_attn")
    assert a.fingerprint() != b.fingerprint()
    assert [f for f, _, _ in a.diff(b)] == ["engine_cells"]
