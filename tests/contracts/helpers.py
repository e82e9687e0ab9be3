"""Shared helpers of the contract tests: tiny layouts, per-rank caches, tier scans."""
from __future__ import annotations

import torch

from hicache.core.config import HiCacheConfig
from hicache.cache.hicache import HiCache
from hicache.core.layout import KVLayout

SENTINEL = -999.5  # poison of every padding row; never a valid value


def make_hc(layout: KVLayout, url: str = "", device_pages: int = 48, host_pages: int = 96) -> HiCache:
    cfg = HiCacheConfig.load(env={}, overrides={
        "storage.url": url, "pool.device_pages": str(device_pages), "pool.host_pages": str(host_pages),
        "policy.prefetch_policy": "wait_complete", "pool.device": "cpu"})
    return HiCache(cfg, layout=layout)


def indexed_pages(hc: HiCache):
    """``(tier, tokens of the page, {plane index: rows})`` for every page the index
    holds on L1, L2 and (cp_size 1) L3 on this rank."""
    lay, ps = hc.layout, hc.layout.page_size
    sizes = [s.page_bytes for s in lay.planes]
    for n in hc.cache.nodes():
        toks = n.tokens
        owned = [j for j in range(n.num_pages) if hc.cache.owns(n.start_page + j)]
        hashes = hc.cache.tree.hashes(n) if n.in_storage else None
        for k, j in enumerate(owned):
            page_toks = toks[j * ps:(j + 1) * ps]
            if n.device_pages is not None:
                p = n.device_pages[k]
                yield "L1", page_toks, {s.index: hc.device_pool.buffers[s.index][p * ps:(p + 1) * ps]
                                        for s in lay.planes}
            if n.host_pages is not None:
                yield "L2", page_toks, {s.index: v for s, v in zip(lay.planes, hc.host_pool.page_view(
                    n.host_pages[k]).values())}
            if hashes is not None and hc.storage is not None:
                (payload,) = hc.storage.get([hashes[j]], sizes)
                assert payload is not None, f"L3 lost page {j} of {n!r}"
                raw, at, planes = bytes(payload), 0, {}
                for s in lay.planes:
                    planes[s.index] = torch.frombuffer(bytearray(raw[at:at + s.page_bytes]), dtype=s.dtype
                                                       ).view(ps, *s.row_shape)
                    at += s.page_bytes
                yield "L3", page_toks, planes
