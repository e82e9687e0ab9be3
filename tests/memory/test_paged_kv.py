"""adopt_paged_kv: vLLM 0.33's per-layer KV tensors (every KVCacheLayout, real shapes at block 16)
as hicache's L1 without a copy; byte-exact round trips through L2 (both host layouts) with the
torch path and the Triton kernel (interpreted on CPU); wrong tensors raise LayoutError."""
from __future__ import annotations

import pytest
import torch

from hicache.core.errors import LayoutError
from hicache.core.shapes import model_shape
from hicache.kernels import store_rows
from hicache.memory.paged_kv import VLLM_LAYOUTS, adopt_paged_kv, vllm_kv_caches
from tests.memory.paged_cases import BLOCK, cases, check_round_trip, round_trip

CASES = {c.name: c for c in cases()}
PAGE_FIRST = {c.name: c for c in cases("page_first")}


# Every stride order for one MHA and one MLA model; the others at what their backends pick
# (FlashAttention/Triton: LBNHC, FlashInfer SM100 / CPU: LBHNC or BLHNC, DeepSeek-V4 packing: BLHNC).
SWEEP = ([(n, k) for n in ("llama-3.1-8b", "deepseek-v3") for k in sorted(VLLM_LAYOUTS)]
         + [("qwen3-32b", "LBNHC"), ("qwen3-32b", "LBHNC"), ("gpt-oss-120b", "LBNHC"), ("gpt-oss-120b", "BLHNC"),
            ("llama-3.1-8b-fp8", "LBNHC"), ("llama-3.1-8b-fp8", "LBHNC"), ("deepseek-v3-fp8-ds-mla", "BLHNC"),
            ("deepseek-v3-fp8-ds-mla", "LBNHC")])


@pytest.mark.parametrize("name,kv_layout", SWEEP)
def test_round_trip_torch(name, kv_layout):
    """layer_first L2, the torch path: every layer of the model, scattered blocks and pages."""
    check_round_trip(round_trip(CASES[name], kv_layout, "cpu", backend="torch"))


@pytest.mark.parametrize("name", sorted(CASES))
def test_round_trip_page_first(name):
    """page_first L2 (one region per page), vLLM's default (NHD) interior."""
    check_round_trip(round_trip(PAGE_FIRST[name], "LBNHC", "cpu", backend="torch"))


@pytest.mark.parametrize("case", [("llama-3.1-8b", "LBNHC", "layer_first"), ("gpt-oss-120b", "LBHNC", "page_first"),
                                  ("deepseek-v3-fp8-ds-mla", "BLHNC", "layer_first"),
                                  ("llama-3.1-8b-fp8", "BLNHC", "page_first")])
def test_round_trip_triton_interpreted(case):
    """The Triton kernel under its interpreter walks the strided plans: every layer, fewer blocks."""
    name, kv_layout, host_layout = case
    c = (CASES if host_layout == "layer_first" else PAGE_FIRST)[name]
    check_round_trip(round_trip(c, kv_layout, "cpu", backend="triton", num_blocks=6, host_pages=4))


@pytest.mark.parametrize("kv_layout", ["LBNHC", "LBHNC"])
def test_one_kv_head_per_rank(kv_layout):
    """llama-3.1-70b at TP 8: one KV head per rank keeps k/v rows [1, head_dim] (no squeeze)."""
    from tests.memory.paged_cases import Case
    lay = model_shape("llama-3.1-70b-tp8").kv_layout(BLOCK, layers=4)
    check_round_trip(round_trip(Case("llama-3.1-70b-tp8", lay, 1), kv_layout, "cpu", backend="torch"))


def test_adopted_pool_views_without_copy():
    lay = model_shape("llama-3.1-8b").kv_layout(BLOCK, layers=2)
    kv = vllm_kv_caches(lay, 5, "LBNHC")
    pool = adopt_paged_kv(lay, kv)
    pool.check_integrity()
    t = kv["model.layers.1.self_attn.attn"]
    t[3, 2, 7, 0] = 1.5  # block 3, head 2, token 7, K element 0
    t[3, 2, 7, 128] = -2.0  # ... V element 0
    row = 3 * BLOCK + 7  # NHD interiors merge blocks and tokens into slot-addressable rows
    assert pool.plane("k", 1)[row, 2, 0].item() == 1.5 and pool.plane("v", 1)[row, 2, 0].item() == -2.0
    assert pool.num_pages == 5 and pool.strided
    hnd = adopt_paged_kv(lay, vllm_kv_caches(lay, 5, "LBHNC"))  # head-major: a page view [B, N, H, D]
    assert tuple(hnd.plane("k", 0).shape) == (5, BLOCK, 8, 128)


def test_store_rows_refuses_adopted_pool():
    lay = model_shape("llama-3.2-1b").kv_layout(BLOCK, layers=1)
    pool = adopt_paged_kv(lay, vllm_kv_caches(lay, 2))
    rows = [torch.zeros(1, 8, 64, dtype=torch.bfloat16)] * 2
    with pytest.raises(ValueError, match="engine writes itself"):
        store_rows(pool, [0, 1], rows, torch.zeros(1, dtype=torch.int64), torch.zeros(1, dtype=torch.int8))


def _err(lay, kv) -> str:
    with pytest.raises(LayoutError) as e:
        adopt_paged_kv(lay, kv)
    return str(e.value)


def test_wrong_tensors_name_shape_and_expected():
    lay = model_shape("llama-3.1-8b").kv_layout(BLOCK, layers=2)
    kv = vllm_kv_caches(lay, 4)
    qwen = model_shape("llama-3.2-1b").kv_layout(BLOCK, layers=2)  # 64-dim heads: a smaller cell
    msg = _err(lay, vllm_kv_caches(qwen, 4))
    assert "(4, 8, 16, 128)" in msg and "[num_blocks, 8, 16, 256]" in msg, msg
    msg = _err(lay, {k: v.view(torch.float16) for k, v in kv.items()})
    assert "torch.float16" in msg and "bfloat16" in msg, msg
    msg = _err(lay, list(kv.values())[:1])
    assert "1 KV tensors" in msg and "2 layers" in msg, msg
    mixed = dict(kv)
    mixed["model.layers.1.self_attn.attn"] = vllm_kv_caches(lay, 3)["model.layers.1.self_attn.attn"]
    assert "disagree on blocks [3, 4]" in _err(lay, mixed)


def test_legacy_shapes_adopt_the_same_bytes():
    """[2, B, N, H, D] (K/V split) and MLA [B, N, C] adopt as the same canonical planes."""
    lay = model_shape("llama-3.2-1b").kv_layout(BLOCK, layers=1)
    kv5 = torch.randn(2, 3, BLOCK, 8, 64).to(torch.bfloat16)
    pool = adopt_paged_kv(lay, [kv5])
    assert torch.equal(pool.plane("k", 0), kv5[0].flatten(0, 1)) and torch.equal(pool.plane("v", 0), kv5[1].flatten(0, 1))
    mla = model_shape("deepseek-v3").kv_layout(BLOCK, layers=1, draft=False)
    kv3 = torch.randn(3, BLOCK, 576).to(torch.bfloat16)
    assert torch.equal(adopt_paged_kv(mla, [kv3]).plane("latent", 0), kv3.flatten(0, 1))
