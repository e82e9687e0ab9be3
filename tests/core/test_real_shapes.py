"""Every published model shape (``hicache/data/real_models.json``) through the layout,
its fingerprint and the pools, at the page sizes its engines use (1, 16, 64).

Expected sizes are computed here from the table's raw facts with the published
formulas (MHA/GQA: 2 x kv_heads x head_dim x dtype bytes per token per layer,
K and V as two planes; MLA: (kv_lora_rank + qk_rope_head_dim) x dtype), not
from ``ModelShape``'s own properties, so the layout is checked against the
table and not against itself."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib import resources

import pytest
import torch

from hicache.core.layout import HOST_ALIGN, KVLayout
from hicache.memory.pools import DevicePool, HostPool
from hicache.core.shapes import model_shape, model_shapes

RAW = {m["name"]: m for m in json.loads(
    resources.files("hicache.data").joinpath("real_models.json").read_text())["models"]}
NAMES = list(RAW)
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
PAGE_SIZES = [1, 16, 64]  # SGLang pages 1 / 16, vLLM block 16, FlashMLA 64


# Many small tensor ops: one torch thread (tests/conftest.py says why).
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def expected(name: str) -> dict[str, int]:
    """The table's facts turned into per-rank plane sizes with the published formulas."""
    m = RAW[name]
    size = DTYPE_BYTES[m["dtype"]]
    layers = m["layers"] // m.get("full_attention_every", 1)  # hybrid: only full-attention layers keep KV
    layers += m.get("draft_layers", 0)
    if m["kind"] == "mla":
        return dict(planes_per_layer=1, plane_row=(m["kv_lora_rank"] + m["qk_rope_head_dim"]) * size,
                    layers=layers, layer_token=(m["kv_lora_rank"] + m["qk_rope_head_dim"]) * size)
    heads = max(1, m["kv_heads"] // m.get("tp", 1))
    return dict(planes_per_layer=2, plane_row=heads * m["head_dim"] * size, layers=layers,
                layer_token=2 * heads * m["head_dim"] * size)


def test_table_lists_the_expected_models():
    assert NAMES == [m.name for m in model_shapes()]
    assert {"opt-125m", "llama-3.1-8b", "llama-3.1-70b-tp8", "deepseek-v3", "qwen3-next-80b-a3b"} <= set(NAMES)
    assert len(set(m.hf for m in model_shapes())) == len(NAMES)


@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.parametrize("name", NAMES)
def test_every_shape_builds_with_the_published_plane_sizes(name, page_size):
    e = expected(name)
    lay = model_shape(name).kv_layout(page_size)
    assert len(lay.planes) == e["planes_per_layer"] * e["layers"]
    for p in lay.planes:
        assert p.row_bytes == e["plane_row"], (p.name, p.layer)
        assert p.page_bytes == e["plane_row"] * page_size
        assert p.dtype == getattr(torch, RAW[name]["dtype"])
        assert p.row_bytes == p.dtype.itemsize * int(torch.tensor(p.row_shape).prod())
    assert lay.token_bytes == e["layer_token"] * e["layers"]
    assert lay.page_bytes == e["layer_token"] * e["layers"] * page_size == model_shape(name).page_bytes(page_size)
    for layer in range(lay.num_layers):
        assert sum(p.row_bytes for p in lay.planes_of_layer(layer)) == e["layer_token"]


# Published per-block sizes that users quote (issue 24 names the first two).
KNOWN_PAGE_BYTES = [
    ("opt-125m", 16, 576 << 10),  # 12 layers x 2 x 12 heads x 64 x fp16 x 16 tokens
    ("llama-3.1-8b", 16, 2 << 20),  # 32 x 2 x 8 x 128 x bf16 x 16: the "2 MiB block"
    ("llama-3.1-70b-tp8", 16, 640 << 10),  # one KV head per rank: 80 x 2 x 128 x 2 x 16
    ("deepseek-v3", 64, 62 * 576 * 2 * 64),  # 61 layers + the NextN layer, 576-wide latent
    ("qwen3-next-80b-a3b", 16, 12 * 2 * 2 * 256 * 2 * 16),  # only 12 of 48 layers keep KV
]


@pytest.mark.parametrize("name,page_size,nbytes", KNOWN_PAGE_BYTES)
def test_known_page_sizes(name, page_size, nbytes):
    assert model_shape(name).kv_layout(page_size).page_bytes == nbytes


@pytest.mark.parametrize("name", NAMES)
def test_fewer_layers_keep_the_real_per_layer_sizes(name):
    full, few = model_shape(name).kv_layout(16), model_shape(name).kv_layout(16, layers=2)
    assert few.num_layers == 2 and few.draft_layers == full.draft_layers
    assert [p.page_bytes for p in few.planes_of_layer(1)] == [p.page_bytes for p in full.planes_of_layer(1)]
    per_layer = sum(p.page_bytes for p in full.planes_of_layer(0))
    assert full.page_bytes - few.page_bytes == per_layer * (full.num_layers - 2)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("host_layout", ["layer_first", "page_first"])
def test_host_addressing_at_real_sizes(name, host_layout):
    lay = model_shape(name).kv_layout(16, host_layout=host_layout)
    offs, strides, total = lay.host_addressing(5)
    assert all(o % HOST_ALIGN == 0 for o in offs)
    regions = sorted((o + page * st, o + page * st + p.page_bytes)
                     for o, st, p in zip(offs, strides, lay.planes) for page in range(5))
    assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(regions, regions[1:])), "regions overlap"
    assert regions[-1][1] <= total
    # Every real plane is a whole number of 16 bytes, so no alignment gaps: the pool is the payload.
    assert total == 5 * lay.page_bytes


# ------------------------------------------------------------------- fingerprints

def all_layouts() -> dict[tuple[str, int], KVLayout]:
    return {(n, ps): model_shape(n).kv_layout(ps) for n in NAMES for ps in PAGE_SIZES}


def test_fingerprints_are_distinct_across_shapes_and_page_sizes():
    fps = {k: lay.fingerprint() for k, lay in all_layouts().items()}
    assert len(set(fps.values())) == len(fps)
    assert all(len(f) == 32 and int(f, 16) >= 0 for f in fps.values())


# Computed once (2026-11-30) from ``contract_fields()`` with CONTRACT_VERSION 1. They pin the
# encoding itself: every L3 object carries its layout's fingerprint, so a change here makes
# every page already stored foreign (a counted miss). If a change is intended (a new contract
# field, a new CONTRACT_VERSION), say so in the commit and update these values.
GOLDEN = {
    ("llama-3.1-8b", 16): "55cd2cb041a16407033fa7c0676fbcee",
    ("deepseek-v3", 64): "c6225f366ec22e34bb8f28555ab93322",
    ("opt-125m", 16): "9c1c987d21840b6e80f079f9d4604049",
    ("llama-3.1-70b-tp8", 16): "616c7a2ac17fc5b48871015ae0f2d471",
}


@pytest.mark.parametrize("key", sorted(GOLDEN))
def test_golden_fingerprints(key):
    assert model_shape(key[0]).kv_layout(key[1]).fingerprint() == GOLDEN[key]


def test_fingerprints_stable_across_processes_and_hash_seeds():
    here = {f"{n}/{ps}": lay.fingerprint() for (n, ps), lay in all_layouts().items()}
    code = ("import json; from hicache.core.shapes import model_shapes;"
            "print(json.dumps({f'{m.name}/{ps}': m.kv_layout(ps).fingerprint()"
            " for m in model_shapes() for ps in (1, 16, 64)}))")
    for seed in ("0", "4242"):
        out = subprocess.check_output([sys.executable, "-c", code], text=True,
                                      env={**os.environ, "PYTHONHASHSEED": seed})
        assert json.loads(out) == here


@pytest.mark.parametrize("name", NAMES)
def test_tp_dtype_and_page_change_the_fingerprint(name):
    m = model_shape(name)
    base = m.kv_layout(16)
    other_dtype = "float16" if m.dtype == "bfloat16" else "bfloat16"
    changed = {
        "page_size": m.kv_layout(64),
        "dtype": base.replace(dtype=other_dtype),
        "fp8": base.replace(dtype="float8_e4m3fn"),
        "tp_size": base.replace(tp_size=base.tp_size * 2),
        "tp_rank": base.replace(tp_size=max(2, base.tp_size), tp_rank=1),
        "layers": m.kv_layout(16, layers=2),
    }
    fps = {k: lay.fingerprint() for k, lay in changed.items()}
    assert base.fingerprint() not in fps.values()
    assert len(set(fps.values())) == len(fps)
    # The same page bytes in another host layout or CP split keep the fingerprint.
    assert m.kv_layout(16, host_layout="page_first").fingerprint() == base.fingerprint()
    assert base.replace(cp_size=2, cp_rank=1).fingerprint() == base.fingerprint()
    assert KVLayout.from_dict(base.to_dict()) == base


def test_tp8_row_is_rank_zero_of_eight():
    lay = model_shape("llama-3.1-70b-tp8").kv_layout(16)
    assert (lay.tp_size, lay.tp_rank, lay.num_kv_heads) == (8, 0, 1)
    ranks = {model_shape("llama-3.1-70b-tp8").kv_layout(16, tp_rank=r).fingerprint() for r in range(8)}
    assert len(ranks) == 8  # each rank holds another KV head: never one L3 object


def test_deepseek_v3_with_its_draft_layer():
    m = model_shape("deepseek-v3")
    lay = m.kv_layout(64)
    assert (lay.kind, lay.num_layers, lay.draft_layers) == ("mla", 61, 1)
    draft = lay.planes_of_layer(0, draft=True)
    assert [(p.name, p.row_bytes, p.page_bytes) for p in draft] == [("draft_latent", 1152, 1152 * 64)]
    assert lay.planes[-1] == draft[0] and not any(p.draft for p in lay.planes[:-1])
    target_only = m.kv_layout(64, draft=False)
    assert target_only.page_bytes == lay.page_bytes - 1152 * 64
    assert target_only.fingerprint() != lay.fingerprint()
    assert [d[0] for d in lay.diff(target_only)] == ["draft_layers"]


# ------------------------------------------------------------------------- pools

def raw_bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()


@pytest.mark.parametrize("name", NAMES)
def test_host_pools_round_trip_real_pages_across_layouts(name):
    """A full-layer page at page 16 written through one host layout reads back the same
    canonical bytes through the other, and every plane view addresses its own bytes."""
    m = model_shape(name)
    a = HostPool(m.kv_layout(16, host_layout="layer_first"), 3, pin=False)
    b = HostPool(m.kv_layout(16, host_layout="page_first"), 2, pin=False)
    lay = a.layout
    gen = torch.Generator().manual_seed(len(name))
    payload = torch.randint(0, 256, (lay.page_bytes,), dtype=torch.uint8, generator=gen).numpy().tobytes()
    a.write_page(2, payload)
    b.write_page(1, payload)
    assert a.read_page(2) == b.read_page(1) == payload
    at = 0
    for p in lay.planes:  # canonical order: plane j's bytes sit at its running offset
        want = payload[at:at + p.page_bytes]
        assert raw_bytes(a.plane_page(p.index, 2)) == want, p.index
        assert raw_bytes(b.plane_page(p.index, 1)) == want, p.index
        at += p.page_bytes
    assert at == len(payload)
    layers = [(0, False), (lay.num_layers - 1, False)] + [(i, True) for i in range(lay.draft_layers)]
    for pool, page in ((a, 2), (b, 1)):  # per-layer views (what a layer-wise load reads) over every page
        for layer, draft in layers:
            views = pool.layer_view(layer, draft)
            specs = lay.planes_of_layer(layer, draft)
            assert list(views) == [s.name for s in specs]
            for s in specs:
                assert tuple(views[s.name].shape) == (pool.num_pages, 16, *s.row_shape)
                assert raw_bytes(views[s.name][page]) == raw_bytes(pool.plane_page(s.index, page))
    a.check_integrity()
    b.check_integrity()


@pytest.mark.parametrize("name", NAMES)
def test_device_pool_views_at_real_rows(name):
    lay = model_shape(name).kv_layout(16, layers=2)
    dev = DevicePool(lay, 3)
    for s in lay.planes:
        buf = dev.buffers[s.index]
        assert tuple(buf.shape) == (3 * 16, *s.row_shape) and buf.dtype == s.dtype
    assert dev.slot_ids([2]).tolist() == list(range(32, 48))
    dev.check_integrity()
    # An engine's own KV tensors at the real row shapes register as the L1 pool.
    own = {(s.name, s.layer): torch.zeros(3 * 16, *s.row_shape, dtype=s.dtype) for s in lay.planes}
    reg = DevicePool(lay, 3, buffers=own)
    assert all(reg.plane(s.name, s.layer) is own[(s.name, s.layer)] for s in lay.planes)
    reg.check_integrity()
