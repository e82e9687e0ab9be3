"""Shared builders for the index tests (tiny shapes), exposed as fixtures."""
from __future__ import annotations

import pytest

from hicache.memory.allocator import PageAllocator
from hicache.index.prefix_cache import PrefixCache, Request
from hicache.core.layout import KVLayout

PS = 4  # tokens per page in every index test


def layout(cp_size: int = 1, cp_rank: int = 0, page_size: int = PS) -> KVLayout:
    return KVLayout("tiny", 1, num_kv_heads=1, head_dim=2, page_size=page_size,
                    cp_size=cp_size, cp_rank=cp_rank)


def make_cache(pages: int = 32, host_pages: int | None = None, *, cp_size: int = 1, cp_rank: int = 0,
               **kw) -> PrefixCache:
    host = PageAllocator(host_pages, "L2") if host_pages else None
    return PrefixCache(layout(cp_size, cp_rank), PageAllocator(pages, "L1"), host, **kw)


def run(cache: PrefixCache, rid: str, tokens: list[int], namespace: str = "") -> Request:
    """Admit, compute every token, finish; returns the finished handle."""
    req = cache.new_request(rid, tokens, namespace)
    req.lock(req.match())
    req.alloc(req.num_tokens - req.allocated_tokens)
    req.commit()
    req.finish()
    cache.check_integrity()
    return req


@pytest.fixture
def mk():
    return make_cache


@pytest.fixture
def run_req():
    return run
