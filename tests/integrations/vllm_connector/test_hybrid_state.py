"""Qwen3-Next through vLLM 0.33's own scheduler with its hybrid KV cache manager and
Mamba ``align`` prefix caching: a full-attention group (12 layers) and a Gated DeltaNet
state group (36 layers) at the model's per-rank shapes on TP 4.

vLLM keeps a linear-attention layer's state, not its KV: one block per layer holds the
state after exactly the tokens up to a block boundary, and it hands the connector each
such block as the forward that writes it is scheduled (``boundary_state_offloads``).
The stand-in model follows vLLM's align-mode worker: a forward over tokens ``[c, e)``
reads the state after ``c`` tokens from block ``ceil(c / B) - 1`` of the request's
state-group blocks and writes the state after ``e`` tokens into block ``ceil(e / B) - 1``;
a state is bytes that are a function of the whole token prefix and the layer. Every
forward checks, byte for byte, the state it reads (whatever put it there: vLLM's own
prefix cache, a connector load, the previous step) and every full-attention row the
scheduler counts as computed."""
from __future__ import annotations

import pathlib

import pytest
import torch

from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, MambaSpec

from tests.integrations.vllm_connector.harness import (BLOCK, Engine, Shape, connector_config, create_scheduler,
                                                       rows, tokens, vllm_tensors)
from tests.integrations.vllm_connector.test_scheduler_path import extra, finish_idle

from hicache.connector.hybrid import HybridConnectorScheduler
from hicache.core.groups import QWEN3_NEXT_LINEAR as LIN, gdn_state_bytes
from hicache.core.hashing import page_hashes
from hicache.core.shapes import model_shape

NEXT = model_shape("qwen3-next-80b-a3b")
TP = 4
FULL = Shape("qwen3-next-80b-a3b", NEXT.layers // NEXT.full_attention_every, max(1, NEXT.kv_heads // TP),
             NEXT.head_dim, torch.bfloat16)
STATE_PLANE = 9  # the stand-in's pattern index for state bytes (K and V rows use 0 and 1)


def next_config(num_blocks: int) -> KVCacheConfig:
    """Qwen3-Next's two KV cache groups on one of 4 TP ranks (vLLM's order: full, then linear)."""
    conv_dim = (2 * LIN["num_k_heads"] * LIN["k_dim"] + LIN["num_v_heads"] * LIN["v_dim"]) // TP
    shapes = ((LIN["conv_kernel"] - 1, conv_dim), (LIN["num_v_heads"] // TP, LIN["k_dim"], LIN["v_dim"]))
    state = MambaSpec(block_size=BLOCK, shapes=shapes, dtypes=(torch.bfloat16, torch.bfloat16),
                      mamba_cache_mode="align")
    assert state.page_size_bytes * TP == gdn_state_bytes(**LIN, dtype_bytes=2)  # the state hicache models
    every = NEXT.full_attention_every
    full = [f"model.layers.{i}.self_attn" for i in range(every - 1, NEXT.layers, every)]
    linear = [f"model.layers.{i}.linear_attn" for i in range(NEXT.layers) if i % every != every - 1]
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=FULL.heads, head_size=FULL.dim, dtype=FULL.dtype)
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec(full, spec), KVCacheGroupSpec(linear, state)])


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class NextEngine(Engine):
    """``Engine`` over Qwen3-Next's full-attention and state groups (see the module docstring)."""

    def __init__(self, extra_config: dict, *, num_blocks: int = 40):
        self.shape = FULL
        self.vllm_config = connector_config(extra_config, tokens_per_step=64)
        self.vllm_config.cache_config.mamba_cache_mode = "align"
        self.vllm_config.cache_config.enable_prefix_caching = True
        self.kv_config = next_config(num_blocks)
        self.scheduler = create_scheduler(self.vllm_config, num_blocks=num_blocks, kv_cache_config=self.kv_config)
        assert self.scheduler.need_mamba_block_aligned_split  # vLLM splits prefills at block boundaries
        self.connector = self.scheduler.connector
        full, linear = (list(g.layer_names) for g in self.kv_config.kv_cache_groups)
        self.layer_names, self.state_names = full, linear
        self.state_bytes = self.kv_config.kv_cache_groups[1].kv_cache_spec.page_size_bytes
        w = KVConnectorFactory.create_connector(self.vllm_config, KVConnectorRole.WORKER, self.kv_config)
        kv = vllm_tensors(FULL, num_blocks, full, "LBNHC")
        # vLLM 0.33 hands a state layer's cache to the connector as its raw [B, 1, 1, C] int8 pages
        # (MambaBase.bind_kv_cache slices conv and SSM states out of each page).
        kv.update({n: torch.zeros(num_blocks, 1, 1, self.state_bytes, dtype=torch.int8) for n in linear})
        w.register_kv_caches(kv)
        self.workers, self.kvs = [w], [kv]
        self._observe()
        self.checked_states = 0
        self._read: dict[str, tuple[int, bool]] = {}  # rid -> (state block read this step, held the right bytes)

    def _blocks(self, rid: str):
        return self.scheduler.kv_cache_manager.get_block_ids(rid)

    def state(self, req, end: int, layer: int) -> torch.Tensor:
        """The state bytes of ``layer`` after ``end`` tokens of ``req``."""
        return rows(self._prefix_seeds(req)[end - 1:end], layer, STATE_PLANE, self.state_bytes)[0]

    def state_page(self, layer: int, block: int) -> torch.Tensor:
        return self.kvs[0][self.state_names[layer]][block, 0, 0].view(torch.uint8)

    def _compute(self, req, blocks, start, end, rank) -> None:
        full, states = blocks
        if start > 0:  # the state this forward starts from
            b = int(states[cdiv(start, BLOCK) - 1])
            ok = b != 0 and all(torch.equal(self.state_page(i, b), self.state(req, start, i))
                                for i in range(len(self.state_names)))
            self._read[req.request_id] = (b, ok)
        super()._compute(req, full, start, end, rank)
        b = int(states[cdiv(end, BLOCK) - 1])
        assert b != 0, f"{req.request_id}: vLLM gave no state block for the state after {end} tokens"
        for i in range(len(self.state_names)):
            self.state_page(i, b).copy_(self.state(req, end, i))

    def check(self, req, blocks, end, skip=frozenset(), rank=0) -> int:
        checked = super().check(req, blocks[0], end, skip, rank)
        b, ok = self._read.pop(req.request_id, (None, True))
        if b is not None and b not in skip:
            assert ok, f"{req.request_id}: the state after {end} tokens read from block {b} holds wrong bytes"
            self.checked_states += 1
        return checked


def state_lane(eng: NextEngine):
    return eng.core.lanes[1]


@pytest.fixture
def eng(tmp_path):
    e = NextEngine(extra(tmp_path, host_pages=16))
    yield e
    e.close()


@pytest.mark.parametrize("load", ["async", "layerwise"])
def test_qwen3_next_states_saved_at_boundaries_and_loaded_byte_exact(tmp_path, load):
    """``load: layerwise`` too: a hybrid model always loads between steps (vLLM takes a hybrid
    model's load errors per request, which only a request waiting for its load can have)."""
    eng = NextEngine(extra(tmp_path, load=load, host_pages=16))
    assert isinstance(eng.core, HybridConnectorScheduler)
    assert not eng.vllm_config.scheduler_config.disable_hybrid_kv_cache_manager
    p = tokens(60, 12 * BLOCK + 3)
    eng.add("r1", p)
    eng.run(integrity=True)
    # vLLM splits the prefill at 64-token chunks (4 blocks): it offers the state after
    # every chunk, and the connector keeps each (after pages 4, 8 and 12) beside the 12 full pages.
    assert eng.core.stats().saved_pages == 12 and len(state_lane(eng).items) == 3
    eng.reset_vllm_prefix_cache()
    eng.add("r2", p[:12 * BLOCK] + tokens(61, 7))
    eng.run(integrity=True)
    # vLLM found nothing of its own; the connector's hit is all 12 pages: the full group's
    # pages and the state after them, and the forward read exactly that state.
    assert eng.lookups[-1][1:4] == (0, 12 * BLOCK, True)
    s = eng.core.stats()
    assert s.loaded_pages == 12 and s.load_error_pages == 0
    assert eng.checked_states > 0
    eng.reset_vllm_prefix_cache()
    # 10 pages in common: no state was kept after page 10, so the hit floors to 8, where one was.
    before = eng.checked_states
    eng.add("r3", p[:10 * BLOCK] + tokens(62, 40))
    eng.run(integrity=True)
    assert eng.lookups[-1][1:3] == (0, 8 * BLOCK)
    assert eng.checked_states > before
    finish_idle(eng)


def test_a_wrong_state_in_l2_is_seen_by_the_stand_in(eng):
    """Negative control: the stand-in's state check fails when the loaded state is off by one byte."""
    p = tokens(63, 8 * BLOCK + 1)
    eng.add("r1", p)
    eng.run()
    lane = state_lane(eng)
    pool = eng.workers[0].worker.workers[1].host_pool
    for host in lane.items.values():
        pool.plane_page(0, host).view(-1)[5] ^= 1  # layer 0's state, one bit
    eng.reset_vllm_prefix_cache()
    eng.add("r2", p[:8 * BLOCK] + tokens(64, 5))
    with pytest.raises(AssertionError, match="state after 128 tokens .* wrong bytes"):
        eng.run()


def test_offers_the_connector_cannot_use_are_left(eng):
    """Offers of another group, off a page boundary or of vLLM's null block queue nothing."""
    core = eng.core
    key_tokens = tokens(65, 4 * BLOCK)
    assert core.boundary_states("x", key_tokens, [(0, 3, 2 * BLOCK), (1, 4, BLOCK + 3), (1, 0, 2 * BLOCK)]) == 0
    assert core.boundary_states("x", key_tokens, [(1, 5, 2 * BLOCK)]) == 1
    assert core.boundary_states("x", key_tokens, [(1, 6, 2 * BLOCK)]) == 0  # that state's save is queued
    plan = core.take_plan()
    assert [(s.blocks, s.group, s.running, s.after_forward) for s in plan.saves] == [((5,), 1, True, True)]


def test_a_restarted_engine_hits_the_states_and_pages_in_l3(tmp_path):
    """Each group keeps its items on L3 too (under its own layout's fingerprint): a fresh engine
    over the same L3 (empty L2, empty vLLM cache) loads the full group's pages and the state."""
    first = NextEngine(extra(tmp_path, host_pages=16))
    p = tokens(66, 12 * BLOCK + 3)
    first.add("r1", p)
    first.run(integrity=True)
    finish_idle(first)
    eng = NextEngine(extra(tmp_path, host_pages=16))
    assert not state_lane(eng).items
    eng.add("r2", p[:12 * BLOCK] + tokens(67, 9))
    eng.run(integrity=True)
    assert eng.lookups[-1][1:3] == (0, 12 * BLOCK)
    s = eng.core.stats()
    assert s.hit_tokens["L3"] == 12 * BLOCK and s.load_error_pages == 0
    assert eng.checked_states > 0  # the forward read the state L3 brought, byte for byte
    assert len(state_lane(eng).items) >= 1  # the state that landed is kept on L2
    # 10 pages in common: the floor goes to the state after page 8, which L3 holds
    eng.reset_vllm_prefix_cache()
    eng.add("r3", p[:10 * BLOCK] + tokens(68, 30))
    eng.run(integrity=True)
    assert eng.lookups[-1][1:3] == (0, 8 * BLOCK)
    finish_idle(eng)


@pytest.mark.parametrize("group", ["full", "state"])
def test_a_damaged_l3_object_fails_the_request_which_vllm_recomputes(tmp_path, group):
    """A hybrid model's load error is told per request (vLLM refuses block-level errors with
    several KV cache groups): a restarted engine whose L3 copy of one group's object is damaged
    loads, finds it bad, and vLLM recomputes the whole request; every byte read still checks."""
    first = NextEngine(extra(tmp_path, host_pages=16))
    p = tokens(69, 12 * BLOCK + 3)
    first.add("r1", p)
    first.run(integrity=True)
    finish_idle(first)
    page = 11 if group == "state" else 5  # the state after page 12 is keyed by page 11's hash
    name = page_hashes(p[:(page + 1) * BLOCK], BLOCK)[page].hex()
    objs = sorted(pathlib.Path(tmp_path).rglob(name), key=lambda f: f.stat().st_size)
    # page 11: the full group's page and the state after page 12, each in its own layout's folder
    assert len(objs) == (2 if group == "state" else 1)
    bad = objs[-1]  # a state (274 KiB) outweighs a page of 12 layers (192 KiB)
    raw = bytearray(bad.read_bytes())
    raw[-7] ^= 0x10
    bad.write_bytes(bytes(raw))
    eng = NextEngine(extra(tmp_path, host_pages=16))
    eng.add("r2", p[:12 * BLOCK] + tokens(70, 9))
    eng.run(integrity=True)
    asked = [n for rid, _, n, _ in eng.lookups if rid == "r2"]
    assert asked[0] == 12 * BLOCK  # offered whole, then found bad (and the bad object dropped: asked again)
    assert eng.core.stats().load_error_pages > 0 or group == "state"
    assert "r2" in eng.transfer_params and eng.checked_tokens > 0  # finished, recomputed, checked
    finish_idle(eng)
