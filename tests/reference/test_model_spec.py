"""ModelSpec, weights, KV I/O and the sdpa fast path."""
from __future__ import annotations

import pytest
import torch

from hicache.reference.model import ReferenceModel
from hicache.reference.model_kv import gather_context, write_kv
from hicache.reference.model_spec import ModelSpec
from hicache.core.errors import LayoutError, PoolError, ProvenanceError
from hicache.memory.pools import DevicePool
from hicache.core.types import Row


def test_kv_layout_mha_and_mla():
    mha = ModelSpec.tiny("mha").kv_layout(4, "page_first", draft_layers=1)
    assert [(p.name, p.layer, p.row_shape) for p in mha.planes] == [
        ("k", 0, (2, 8)), ("v", 0, (2, 8)), ("k", 1, (2, 8)), ("v", 1, (2, 8)),
        ("draft_k", 0, (2, 8)), ("draft_v", 0, (2, 8))]
    assert (mha.page_size, mha.host_layout, mha.dtype) == (4, "page_first", "float32")
    mla = ModelSpec.tiny("mla").kv_layout(16)
    assert [(p.name, p.layer, p.row_shape) for p in mla.planes] == [("latent", 0, (16,)), ("latent", 1, (16,))]
    with pytest.raises(LayoutError, match="draft_layers=2"):
        ModelSpec.tiny().kv_layout(4, draft_layers=2)


def test_model_id_names_the_weights():
    a = ModelSpec.tiny()
    assert a.model_id == ModelSpec.tiny().model_id
    assert a.model_id != a.replace(seed=1).model_id != a.replace(vocab=129).model_id
    assert a.kv_layout(4).fingerprint() != a.replace(seed=1).kv_layout(4).fingerprint()
    assert a.kv_layout(4, model_id="x").model_id == "x"


@pytest.mark.parametrize("bad,match", [
    (dict(num_q_heads=3), "multiple of num_kv_heads=2"),
    (dict(head_dim=7), "even head_dim"),
    (dict(kv_lora_rank=4), "MLA fields"),
    (dict(dtype="float8_e4m3fn"), "computes in one of"),
    (dict(kind="gqa"), "'mha' or 'mla'"),
])
def test_spec_errors_name_the_field(bad, match):
    with pytest.raises(LayoutError, match=match):
        ModelSpec.tiny().replace(**bad)


@pytest.mark.parametrize("spec", [ModelSpec.tiny("mla", num_layers=3), ModelSpec.tiny(num_kv_heads=1, head_dim=32)])
def test_for_layout_matches_shapes(spec):
    lay = spec.kv_layout(8, model_id="from-config")
    mine = ModelSpec.for_layout(lay)
    assert mine.kv_layout(8).diff(lay) == [("model_id", mine.model_id, "from-config")]
    assert mine.kv_layout(8, model_id="from-config") == lay


def test_weights_are_seeded():
    a, b = ReferenceModel(ModelSpec.tiny()), ReferenceModel(ModelSpec.tiny())
    c = ReferenceModel(ModelSpec.tiny(seed=1))
    assert torch.equal(a.weights.layers[1].w_down, b.weights.layers[1].w_down)
    assert torch.equal(a.weights.draft.fc, b.weights.draft.fc)
    assert not torch.equal(a.weights.layers[1].w_down, c.weights.layers[1].w_down)


def test_llama3_8b_shape_on_meta():
    spec = ModelSpec.llama3_8b()
    assert spec.num_params() == 8_030_261_248  # Llama-3-8B's published parameter count
    m = ReferenceModel(spec, device="meta", attention="sdpa", draft=False)
    assert m.weights.layers[31].w_gate_up.shape == (2 * 14336, 4096)
    lay = spec.kv_layout(16, draft_layers=1)
    assert lay.token_bytes == 33 * 2 * 8 * 128 * 2  # 32 target + 1 draft layer, K and V, bf16


def test_write_kv_only_valid_rows(kind):
    spec = ModelSpec.tiny(kind)
    pool = DevicePool(spec.kv_layout(4, draft_layers=1), 4)
    names = ["k", "v"] if kind == "mha" else ["latent"]
    rows = {n: torch.arange(4 * pool.plane(n, 0)[0].numel(), dtype=torch.float32).view(4, *pool.plane(n, 0).shape[1:]) + 1
            for n in names}
    prov = torch.tensor([Row.VALID, Row.STATIC_PAD, Row.VALID, Row.CP_PAGE_TAIL], dtype=torch.int8)
    slots = torch.tensor([9, -1, 5, 3])
    assert write_kv(pool, 0, rows, slots, prov, draft=True) == 2
    for n in names:
        buf = pool.plane("draft_" + n, 0)
        assert torch.equal(buf[9], rows[n][0]) and torch.equal(buf[5], rows[n][2])
        assert int((buf != 0).any(dim=tuple(range(1, buf.dim()))).sum()) == 2  # nothing else written
        assert not pool.plane(n, 0).any()  # target planes untouched
        ctx = gather_context(pool, 0, torch.tensor([5, 9]), 4, torch.float32, draft=True)[n]
        assert torch.equal(ctx[:2], torch.stack([rows[n][2], rows[n][0]])) and not ctx[2:].any()
    with pytest.raises(ProvenanceError, match="one code per row"):
        write_kv(pool, 0, rows, slots, prov[:3])
    with pytest.raises(ProvenanceError, match="slot ids in \\[0, 16\\)"):
        write_kv(pool, 0, rows, torch.tensor([0, 1, -1, 2]), prov)
    with pytest.raises(ProvenanceError, match="planes \\['q'\\]"):
        write_kv(pool, 0, {"q": rows[names[0]]}, slots, prov)
    with pytest.raises(ProvenanceError, match="no draft layer 1"):
        write_kv(pool, 1, rows, slots, prov, draft=True)


def test_pool_and_slot_errors():
    m = ReferenceModel(ModelSpec.tiny())
    pool = DevicePool(m.spec.kv_layout(4), 4)  # no draft planes
    slots = pool.slot_ids([0, 1])
    with pytest.raises(PoolError, match="draft_layers=1"):
        m.forward_chunk(pool, [1, 2, 3], 0, slots)
    with pytest.raises(PoolError, match="4 slots"):
        m.forward_chunk(pool, [1, 2, 3, 4], 0, slots[:3], draft=False)
    other = DevicePool(ModelSpec.tiny("mla").kv_layout(4), 4)
    with pytest.raises(PoolError, match="kind: pool='mla' model='mha'"):
        m.forward_chunk(other, [1], 0, slots, draft=False)
    with pytest.raises(ValueError, match="vocab=128"):
        m.forward_chunk(pool, [1, 128], 0, slots, draft=False)
    with pytest.raises(ValueError, match="'exact'"):
        ReferenceModel(ModelSpec.tiny(), attention="flash")


def test_sdpa_path_matches_exact_within_tolerance(kind):
    exact = ReferenceModel(ModelSpec.tiny(kind))
    fast = ReferenceModel(ModelSpec.tiny(kind), attention="sdpa")
    lay = exact.spec.kv_layout(4, draft_layers=1)
    toks = torch.randint(0, exact.spec.vocab, (19,), generator=torch.Generator().manual_seed(3)).tolist()
    outs = []
    for m in (exact, fast):
        pool = DevicePool(lay, 8)
        slots = pool.slot_ids(list(range(8)))
        a = m.forward_chunk(pool, toks[:9], 0, slots, all_logits=True)
        b = m.forward_chunk(pool, toks[9:], 9, slots, all_logits=True, pending_hidden=a.hidden_last)
        d = m.speculate(pool, b.hidden_last, 7, 18, slots, 2)
        outs.append((torch.cat([a.logits, b.logits]), d.logits, pool.plane(lay.planes[-1].name, 0).clone()))
    for x, y in zip(*outs):
        torch.testing.assert_close(x, y, atol=1e-4, rtol=1e-4)


@pytest.mark.gpu
def test_llama3_8b_shape_prefills_on_gpu():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    spec = ModelSpec.llama3_8b(num_layers=4)  # full width, fewer layers: keeps the test short
    m = ReferenceModel(spec, device="cuda", attention="sdpa", draft=False)
    pool = DevicePool(spec.kv_layout(16), 8192 // 16 + 1, device="cuda")
    slots = pool.slot_ids(list(range(8192 // 16))).cuda()
    toks = torch.randint(0, spec.vocab, (8192,), device="cuda")
    out = m.forward_chunk(pool, toks, 0, slots, draft=False)
    assert out.logits_last.shape == (spec.vocab,) and bool(out.logits_last.isfinite().all())
    dec = m.decode_step(pool, int(out.logits_last.argmax()), 8192, pool.slot_ids(list(range(513))).cuda(), draft=False)
    assert bool(dec.logits_last.isfinite().all())
