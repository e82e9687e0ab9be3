"""A hybrid model through vLLM 0.33's own scheduler with its hybrid KV cache manager on
(HiCacheConnector is ``SupportsHMA``): gpt-oss-120b's sliding-window and full-attention
groups at their real per-layer shapes. The stand-in model checks, before every forward,
the bytes every group's attention reads: the full group every computed token, the
sliding-window group the window before the first token it computes."""
from __future__ import annotations

import torch

from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

from tests.integrations.vllm_connector.harness import (BLOCK, Engine, Shape, connector_config, create_scheduler,
                                                       rows, tokens, vllm_tensors)
from tests.integrations.vllm_connector.test_hybrid_groups import gpt_oss_config
from tests.integrations.vllm_connector.test_scheduler_path import extra, finish_idle

from hicache.connector.hybrid import HybridConnectorScheduler
from hicache.core.shapes import model_shape

OSS = model_shape("gpt-oss-120b")
GROUP_SHAPE = Shape("gpt-oss-120b", OSS.layers // 2, OSS.kv_heads, OSS.head_dim, torch.bfloat16)


class HybridEngine(Engine):
    """``Engine`` over gpt-oss's two KV cache groups (vLLM's order: sliding window, full)."""

    def __init__(self, extra_config: dict, *, num_blocks: int = 64):
        self.shape = GROUP_SHAPE
        self.vllm_config = connector_config(extra_config, tokens_per_step=64)
        self.kv_config = gpt_oss_config(num_blocks)
        self.scheduler = create_scheduler(self.vllm_config, num_blocks=num_blocks, kv_cache_config=self.kv_config)
        self.connector = self.scheduler.connector
        self.groups = [list(g.layer_names) for g in self.kv_config.kv_cache_groups]
        self.layer_names = [n for names in self.groups for n in names]
        w = KVConnectorFactory.create_connector(self.vllm_config, KVConnectorRole.WORKER, self.kv_config)
        kv = {}
        for names in self.groups:
            kv.update(vllm_tensors(GROUP_SHAPE, num_blocks, names, "LBNHC"))
        w.register_kv_caches(kv)
        self.workers, self.kvs = [w], [kv]
        self._observe()

    def _blocks(self, rid: str):
        return self.scheduler.kv_cache_manager.get_block_ids(rid)

    def _group_span(self, g: int, end: int) -> int:
        """First position group ``g``'s attention reads for a query at ``end``."""
        return max(0, end - OSS.sliding_window + 1) if g == 0 else 0

    def _layers(self, g: int) -> range:
        n = len(self.groups[0])
        return range(g * n, (g + 1) * n)

    def check(self, req, blocks, end, skip=frozenset(), rank=0) -> int:
        """Positions ``[span, end)`` of each group hold the stand-in model's bytes."""
        checked = 0
        for g, gblocks in enumerate(blocks):
            lo = self._group_span(g, end)
            if end <= lo:
                continue
            b, off = self._positions(gblocks, lo, end)
            keep = torch.tensor([int(x) not in skip for x in b], dtype=torch.bool)
            assert not (b[keep] == 0).any(), f"{req.request_id}: group {g} reads a null block below {end}"
            s = self._prefix_seeds(req)[lo:end][keep]
            b, off = b[keep], off[keep]
            for layer in self._layers(g):
                for p, plane in enumerate(self.planes(layer, rank)):
                    got = plane[b, off].reshape(len(b), -1)
                    if not torch.equal(got, rows(s, layer, p, self.row_bytes)):
                        raise AssertionError(f"{req.request_id}: group {g} layer {layer} plane {p}: wrong KV "
                                             f"among positions {lo} .. {end}")
            checked += int(keep.sum())
        return checked

    def _compute(self, req, blocks, start, end, rank) -> None:
        s = self._prefix_seeds(req)[start:end]
        for g, gblocks in enumerate(blocks):
            b, off = self._positions(gblocks, start, end)
            for layer in self._layers(g):
                for p, plane in enumerate(self.planes(layer, rank)):
                    plane[b, off] = rows(s, layer, p, self.row_bytes).view(len(b), *plane.shape[2:])


def test_gpt_oss_hybrid_hits_load_every_group_byte_exact(tmp_path):
    eng = HybridEngine(extra(tmp_path))
    assert isinstance(eng.core, HybridConnectorScheduler)
    assert not eng.vllm_config.scheduler_config.disable_hybrid_kv_cache_manager
    p = tokens(50, 20 * BLOCK + 3)
    eng.add("r1", p)
    eng.run(integrity=True)
    assert eng.core.stats().saved_pages == 20 and len(eng.core.lanes[0].items) == 8  # every page; the window
    eng.reset_vllm_prefix_cache()
    eng.add("r2", p[:20 * BLOCK] + tokens(51, 7))
    eng.run(integrity=True)
    # vLLM found nothing of its own; the connector's hit is all 20 pages: 20 full pages and the
    # sliding window's 8 loaded, every byte attention reads then checked.
    assert eng.lookups[-1][1:3] == (0, 20 * BLOCK)
    s = eng.core.stats()
    assert s.loaded_pages == 20 and s.load_error_pages == 0
    eng.reset_vllm_prefix_cache()
    # 17 pages in common: boundary 17's window (pages 9 .. 16) was never saved (only 12 .. 19
    # were), nor any lower one's: the floor leaves no hit, and vLLM computes everything.
    eng.add("r3", p[:17 * BLOCK] + tokens(52, 40))
    eng.run(integrity=True)
    assert eng.lookups[-1][1:3] == (0, 0)
    assert eng.checked_tokens > 0
    finish_idle(eng)


def test_gpt_oss_restart_loads_the_window_from_l3(tmp_path):
    """The sliding-window group's items go to L3 under its own layout: a fresh engine over the
    same L3 hits all 20 pages, the window read back from L3 and checked byte for byte."""
    first = HybridEngine(extra(tmp_path))
    p = tokens(53, 20 * BLOCK + 3)
    first.add("r1", p)
    first.run(integrity=True)
    finish_idle(first)
    eng = HybridEngine(extra(tmp_path))
    eng.add("r2", p[:20 * BLOCK] + tokens(54, 7))
    eng.run(integrity=True)
    assert eng.lookups[-1][1:3] == (0, 20 * BLOCK)
    s = eng.core.stats()
    assert s.hit_tokens["L3"] == 20 * BLOCK and s.load_error_pages == 0
    assert len(eng.core.lanes[0].items) == 8 and eng.checked_tokens > 0  # the window landed on L2 too
    finish_idle(eng)
