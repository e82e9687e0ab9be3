"""The sdpa (fast) path: rows validated once on the host, no host sync inside the
layer loop, and ``before_layer`` for a load back overlapped with compute."""
from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from hicache.core.config import HiCacheConfig
from hicache.reference.model import ReferenceModel
from hicache.reference.model_kv import check_rows, write_kv, write_rows
from hicache.reference.model_spec import ModelSpec
from hicache.core.errors import PoolError, ProvenanceError
from hicache.cache.hicache import HiCache
from hicache.memory.pools import DevicePool
from hicache.core.types import Row

V, P, T = int(Row.VALID), int(Row.STATIC_PAD), int(Row.CP_PAGE_TAIL)
# aten ops that make the host wait for a GPU (read a value back or size a result by data)
_SYNCING = ("_local_scalar_dense", "nonzero", "masked_select", "unique", "_unique", "item",
            "is_nonzero", "equal", "repeat_interleave")


class _SyncRecorder(TorchDispatchMode):
    """Records every syncing aten op while ``on``."""

    def __init__(self):
        super().__init__()
        self.on, self.seen = False, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.on and func.__name__.split(".")[0] in _SYNCING:
            self.seen.append(func.__name__)
        return func(*args, **(kwargs or {}))


def _rows(pool: DevicePool, n: int, draft: bool = False, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {s.name[6:] if draft else s.name: torch.randn((n, *s.row_shape), generator=g)
            for s in pool.layout.planes_of_layer(0, draft)}


@pytest.mark.parametrize("draft", [False, True])
def test_write_rows_writes_what_write_kv_writes(kind, draft):
    spec = ModelSpec.tiny(kind)
    lay = spec.kv_layout(4, draft_layers=1)
    prov = torch.tensor([V, P, V, T, V], dtype=torch.int8)
    slots = torch.tensor([9, -1, 5, 77, 0])
    a, b = DevicePool(lay, 4), DevicePool(lay, 4)
    rows = _rows(a, 5, draft)
    batch = check_rows(b, slots, prov)
    assert batch.num_rows == 5 and batch.valid == 3
    assert batch.dst.tolist() == [9, 5, 0] and batch.keep.tolist() == [0, 2, 4]
    assert write_kv(a, 0, rows, slots, prov, draft=draft) == 3
    assert write_rows(b, 0, rows, batch, draft=draft) == 3
    for x, y in zip(a.buffers, b.buffers):
        assert torch.equal(x, y)
    assert sum(int(t.any(dim=tuple(range(1, t.dim()))).sum()) for t in b.buffers) == 3 * len(rows)
    every = check_rows(b, torch.tensor([3, 2]), torch.tensor([V, V], dtype=torch.int8))
    assert every.keep is None and every.dst.tolist() == [3, 2]


def test_check_rows_errors_name_the_values():
    pool = DevicePool(ModelSpec.tiny().kv_layout(4), 4)
    ok = torch.tensor([V, V, P], dtype=torch.int8)
    with pytest.raises(ProvenanceError, match="one code per row"):
        check_rows(pool, torch.tensor([0, 1, 2]), ok[:2])
    with pytest.raises(ProvenanceError, match="unknown provenance code in \\[0, 7\\]"):
        check_rows(pool, torch.tensor([0, 1, 2]), torch.tensor([V, 7, V], dtype=torch.int8))
    with pytest.raises(ProvenanceError, match="slot ids in \\[0, 16\\), got \\[0, 16\\]"):
        check_rows(pool, torch.tensor([0, 16, -1]), ok)
    with pytest.raises(ProvenanceError, match="share a slot"):
        check_rows(pool, torch.tensor([3, 3, -1]), ok)
    with pytest.raises(ProvenanceError, match="1-D"):
        check_rows(pool, torch.zeros((3, 1), dtype=torch.int64), ok)
    with pytest.raises(ValueError, match="pass CPU tensors"):
        check_rows(pool, torch.tensor([0, 1, 2], device="meta"), ok)
    batch = check_rows(pool, torch.tensor([0, 1, -1]), ok)
    rows = _rows(pool, 3)
    with pytest.raises(ProvenanceError, match="planes \\['q'\\]"):
        write_rows(pool, 0, {"q": rows["k"]}, batch)
    with pytest.raises(ProvenanceError, match="expected \\(3, 2, 8\\)"):
        write_rows(pool, 0, {n: r[:2] for n, r in rows.items()}, batch)
    with pytest.raises(ProvenanceError, match="planes"):
        write_rows(pool, 5, rows, batch)
    assert not any(t.any() for t in pool.buffers)  # nothing written by a refused call


def test_sdpa_forward_refuses_bad_input_before_writing():
    m = ReferenceModel(ModelSpec.tiny(), attention="sdpa")
    pool = DevicePool(m.spec.kv_layout(4, draft_layers=1), 4)
    slots = pool.slot_ids([0, 1, 2, 3])
    with pytest.raises(PoolError, match="slot_ids\\[:6\\]: slot ids span \\[-1, 6\\], the pool has slots \\[0, 16\\)"):
        m.forward_chunk(pool, [1, 2], 4, torch.cat((torch.tensor([-1, 2, 3, 4]), slots[5:])), draft=False)
    with pytest.raises(PoolError, match="span \\[0, 99\\]"):
        m.forward_chunk(pool, [1, 2, 3], 0, torch.tensor([0, 1, 99]), draft=False)
    with pytest.raises(ProvenanceError, match="share a slot"):
        m.forward_chunk(pool, [1, 2, 3], 0, torch.tensor([0, 1, 1]), draft=False)
    with pytest.raises(ValueError, match="got \\[1, 128\\]"):
        m.forward_chunk(pool, [1, 128], 0, slots, draft=False)
    with pytest.raises(ValueError, match="got \\[-3, 2\\]"):
        m.forward_chunk(pool, [1, 2], 0, slots, draft=True, next_token=-3)
    with pytest.raises(ValueError, match="draft=False"):
        m.forward_chunk(pool, [1, 2], 0, slots, draft=True, before_layer=lambda i: None)
    assert not any(t.any() for t in pool.buffers)


@pytest.mark.parametrize("attention", ["sdpa", "exact"])
def test_before_layer_runs_before_each_layer_touches_the_pool(kind, attention):
    m = ReferenceModel(ModelSpec.tiny(kind, num_layers=3), attention=attention, draft=False)
    pool = DevicePool(m.spec.kv_layout(4), 4)
    slots = pool.slot_ids([2, 0, 3])
    calls = []

    def hook(i: int) -> None:  # layer i has not written this pass's rows yet, every layer before it has
        calls.append(i)
        t = 0 if attention == "sdpa" else (len(calls) - 1) // 3  # exact: one pass per page tile
        rows = slots[:6] if attention == "sdpa" else slots[4 * t:min(4 * t + 4, 6)]
        written = [bool(pool.buffers[s.index][rows].any()) for s in pool.layout.planes]
        per_layer = len(pool.layout.planes_of_layer(0))
        assert written == [j // per_layer < i for j in range(len(written))], (i, written)

    out = m.forward_chunk(pool, [5, 6, 7, 8, 9, 10], 0, slots, draft=False, before_layer=hook)
    # sdpa: one chunk, one call per layer; exact: one call per layer of each page tile
    assert calls == ([0, 1, 2] if attention == "sdpa" else [0, 1, 2, 0, 1, 2])
    plain = m.forward_chunk(DevicePool(pool.layout, 4), [5, 6, 7, 8, 9, 10], 0, slots, draft=False)
    assert torch.equal(out.logits_last, plain.logits_last)


@pytest.mark.parametrize("start", [0, 7])
def test_sdpa_layer_loop_has_no_syncing_op(kind, start):
    m = ReferenceModel(ModelSpec.tiny(kind, num_layers=3), attention="sdpa", draft=False)
    pool = DevicePool(m.spec.kv_layout(4), 8)
    slots = pool.slot_ids([7, 1, 4, 2, 6])
    toks = list(range(3, 23))
    rec = _SyncRecorder()
    calls = []

    def hook(i: int) -> None:
        calls.append(i)
        rec.on = True  # validation is done: from here on nothing may read the device back

    if start:
        m.forward_chunk(pool, toks[:start], 0, slots, draft=False)
    with rec:
        out = m.forward_chunk(pool, toks[start:], start, slots, draft=False, before_layer=hook)
    assert calls == [0, 1, 2] and rec.seen == []
    # the recorder itself sees these ops, so it can fail
    with rec:
        int(out.logits_last.argmax())
    assert rec.seen == ["_local_scalar_dense.default"]


@pytest.mark.parametrize("attention", ["sdpa", "exact"])
def test_l2_hit_with_layerwise_wait_equals_waiting_for_all(attention):
    spec = ModelSpec.tiny(num_layers=3, dtype="float32")
    model = ReferenceModel(spec, attention=attention, draft=False)
    cfg = HiCacheConfig.load(env={}, overrides={
        "storage.url": "", "pool.device": "cpu", "pool.device_pages": "32", "pool.host_pages": "64"})
    hc = HiCache(cfg, layout=spec.kv_layout(4, "page_first"))
    prompt = torch.randint(1, spec.vocab, (23,), generator=torch.Generator().manual_seed(5)).tolist()

    def serve(rid: str, layerwise: bool):
        req = hc.new_request(rid, prompt)
        adm = hc.admit(req)
        start = req.computed_tokens
        req.alloc(len(prompt) - start)
        if not layerwise:
            adm.wait()
        slots = hc.device_pool.slot_ids(req.pages)
        out = model.forward_chunk(hc.device_pool, prompt[start:], start, slots, draft=False,
                                  before_layer=adm.wait_layer if layerwise else None)
        req.commit()
        req.finish()
        hc.drain()
        hc.evict(10**6)  # the next serve hits L2 only
        hc.check_integrity()
        return start, adm.host_tokens, out.logits_last

    _, _, cold = serve("cold", False)
    s1, h1, serial = serve("serial", False)
    s2, h2, layerwise = serve("layerwise", True)
    assert (s1, h1) == (s2, h2) == (20, 20)
    assert torch.equal(serial, layerwise)
    if attention == "exact":
        assert torch.equal(serial, cold)
    else:
        torch.testing.assert_close(serial, cold, atol=1e-4, rtol=1e-4)
    hc.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run on the device machine)")
def test_gpu_sdpa_forward_never_syncs_and_overlaps_a_load():
    # 128 MiB of KV (~2.5 ms over PCIe): the forward runs while later layers still copy, so
    # memory the copies read (their page-id tensors) must not be reused by the forward
    spec = ModelSpec.tiny(num_layers=8, hidden=1024, num_q_heads=16, num_kv_heads=8, head_dim=128, mlp=2048,
                          dtype="bfloat16", max_seq_len=4096)
    model = ReferenceModel(spec, device="cuda", attention="sdpa", draft=False)
    cfg = HiCacheConfig.load(env={}, overrides={
        "storage.url": "", "pool.device": "cuda:0", "pool.device_pages": "600", "pool.host_pages": "1200"})
    hc = HiCache(cfg, layout=spec.kv_layout(16, "page_first"))
    prompt = torch.randint(1, spec.vocab, (4000,), generator=torch.Generator().manual_seed(1)).tolist()
    outs = []
    for rid, layerwise in (("cold", False), ("serial", False), ("layerwise", True)):
        req = hc.new_request(rid, prompt)
        adm = hc.admit(req)
        start = req.computed_tokens
        req.alloc(len(prompt) - start)
        if not layerwise:
            adm.wait()
        slots = hc.device_pool.slot_ids(req.pages)  # host tensor: the forward uploads it itself
        torch.cuda.set_sync_debug_mode("error")
        try:
            out = model.forward_chunk(hc.device_pool, prompt[start:], start, slots, draft=False,
                                      before_layer=adm.wait_layer if layerwise else None)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        outs.append((start, out.logits_last.float().cpu()))
        req.commit()
        req.finish()
        hc.drain()
        hc.evict(10**6)
        hc.check_integrity()
    (s0, cold), (s1, serial), (s2, layerwise) = outs
    assert (s0, s1, s2) == (0, 3984, 3984)
    assert torch.equal(serial, layerwise)
    torch.testing.assert_close(serial, cold, atol=0.1, rtol=0.05)
    hc.close()


def test_fast_path_building_blocks_match_the_reference_ones():
    """The launch-saving pieces of the sdpa path compute the same values."""
    import torch.nn.functional as F  # noqa: F401
    from hicache.reference import model_layers as ml
    from hicache.reference.model import ReferenceModel
    from hicache.reference.model_spec import ModelSpec
    spec = ModelSpec.tiny("mha")
    m = ReferenceModel(spec, draft=False, attention="sdpa")
    lw = m.weights.layers[0]
    g = torch.Generator().manual_seed(0)
    a = torch.randn(5, spec.hidden, generator=g)
    pos = torch.arange(7, 12)
    cos, sin = m.weights.rope_cos[pos], m.weights.rope_sin[pos]
    q0, kv0 = ml.project(spec, lw, a, cos, sin)
    q1, kv1 = ml.project_fast(spec, lw, a, cos, sin)
    assert torch.equal(q0, q1) and torch.equal(kv0["k"], kv1["k"]) and torch.equal(kv0["v"], kv1["v"])
    x = torch.randn(5, spec.hidden, generator=g)
    torch.testing.assert_close(ml.rms_norm_fused(x, lw.attn_norm.float(), spec.norm_eps),
                               ml.rms_norm(x, lw.attn_norm, spec.norm_eps), rtol=1e-5, atol=1e-6)
    allowed = ml.causal_allowed(pos, 12)
    assert allowed.tolist() == [[j <= p for j in range(12)] for p in pos.tolist()]
