"""``HybridCache`` in service mode (``storage.url = hicache+unix://``) against a real node
server: the full groups' pages live in the node's shared segment (L2), the SWA windows and
snapshots on the engine's own L1/L2 (the node keeps no group items). Served warm after its
prefix left L1, a request equals a cold run bit for bit; a second engine of the same node
hits the full pages the first left in the segment, resumes at 0 (it holds no group items)
and still equals the cold run."""
from __future__ import annotations

import pytest
import torch

from hicache.cache.hybrid import HybridCache, group_layout
from hicache.core.config import HiCacheConfig
from hicache.reference.hybrid_runner import HybridRunner
from hicache.reference.model_hybrid import HybridModel, HybridSpec
from hicache.reference.model_spec import ModelSpec

from .conftest import served

pytestmark = pytest.mark.usefixtures("one_torch_thread")

BASE = ModelSpec(vocab=97, hidden=32, num_layers=4, num_q_heads=4, mlp=48, num_kv_heads=2, head_dim=8, seed=3)
SPEC = HybridSpec(BASE, ("swa", "full", "linear", "swa", "full", "linear"), window=6, snapshot_every=2)
PS = 4
PROMPT = torch.randint(1, 97, (37,), generator=torch.Generator().manual_seed(1)).tolist()  # 9 pages + 1


def _cache(url: str) -> HybridCache:
    cfg = HiCacheConfig.load(env={}, overrides={
        "storage.url": url, "pool.device_pages": "64", "pool.host_pages": "128", "pool.device": "cpu",
        "policy.write_policy": "write_through", "policy.prefetch_policy": "wait_complete"})
    return HybridCache(cfg, layout=SPEC.kv_layout(PS, "page_first"))


def _same(a, b) -> bool:
    return torch.equal(a.last_logits, b.last_logits) and a.output == b.output


def test_hybrid_cache_in_service_mode_equals_a_cold_run():
    model = HybridModel(SPEC)
    ref = _cache("")
    cold = HybridRunner(ref, model, chunk_tokens=6).serve("cold", PROMPT)
    ref.close()
    lay = SPEC.kv_layout(PS, "page_first")
    with served(group_layout(lay, ("full",)), host_pages=64, prefix="hyb") as svc:
        url = f"hicache+unix://{svc.socket}"
        hc = _cache(url)
        assert hc.hc.shared is not None and all(st.storage is None for st in hc.stores.values())
        run = HybridRunner(hc, model, chunk_tokens=6)
        first = run.serve("a", PROMPT)
        assert (first.hit, first.resume) == (0, 0) and _same(first, cold)
        hc.drain()
        hc.evict(10_000)  # every full page and group item leaves L1: the segment and L2 keep them
        hc.check_integrity()
        warm = run.serve("b", PROMPT)
        assert (warm.hit, warm.resume) == (36, 32) and _same(warm, cold)
        hc.drain()
        hc.check_integrity()
        other = _cache(url)  # a second engine of the node: the full pages, none of the group items
        again = HybridRunner(other, model, chunk_tokens=6).serve("c", PROMPT)
        assert (again.hit, again.resume, again.replayed) == (36, 0, 36) and _same(again, cold)
        other.drain()
        other.check_integrity()
        other.close()
        hc.close()
