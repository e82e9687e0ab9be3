"""Helpers for the reference-model tests: tiny models, pools, page tables."""
from __future__ import annotations

import functools

import pytest
import torch

from hicache.reference.model import ReferenceModel
from hicache.reference.model_spec import ModelSpec
from hicache.memory.pools import DevicePool


@functools.lru_cache(maxsize=None)
def tiny_model(kind: str, draft: bool = True, attention: str = "exact") -> ReferenceModel:
    """Models are read-only between calls, so tests share one per configuration."""
    return ReferenceModel(ModelSpec.tiny(kind), draft=draft, attention=attention)


class Bench:
    """A model, a layout and fresh pools whose page tables use scattered page ids."""

    def __init__(self, kind: str, page_size: int, draft: bool = True, num_pages: int = 24):
        self.model = tiny_model(kind, draft)
        self.spec = self.model.spec
        self.ps = page_size
        self.layout = self.spec.kv_layout(page_size, draft_layers=int(draft))
        self.num_pages = num_pages

    def pool(self) -> DevicePool:
        return DevicePool(self.layout, self.num_pages)

    def table(self, n_tokens: int, first: int = 0, reverse: bool = False) -> tuple[list[int], torch.Tensor]:
        """Pages ``first, first+1, ...`` (or counting down from the top when ``reverse``)
        for ``n_tokens`` tokens, and their slot ids."""
        n = -(-n_tokens // self.ps)
        pages = [self.num_pages - 1 - first - i for i in range(n)] if reverse else [first + i for i in range(n)]
        assert all(0 <= p < self.num_pages for p in pages), pages
        slots = (torch.tensor(pages)[:, None] * self.ps + torch.arange(self.ps)).reshape(-1)
        return pages, slots

    def tokens(self, n: int, seed: int = 0) -> list[int]:
        g = torch.Generator().manual_seed(1000 + seed)
        return torch.randint(0, self.spec.vocab, (n,), generator=g).tolist()


def copy_pages(src: DevicePool, src_pages: list[int], dst: DevicePool, dst_pages: list[int]) -> None:
    """Copy whole pages (every plane) between pools: a stand-in for a cache load."""
    for sp, dp in zip(src_pages, dst_pages, strict=True):
        dv = dst.page_view(dp)
        for key, t in src.page_view(sp).items():
            dv[key].copy_(t)


def rows(pool: DevicePool, slots: torch.Tensor, name: str, layer: int) -> torch.Tensor:
    return pool.plane(name, layer)[slots]


@pytest.fixture(params=["mha", "mla"])
def kind(request) -> str:
    return request.param


@pytest.fixture
def make_bench():
    return Bench


@pytest.fixture
def page_copy():
    return copy_pages


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny matmuls are ~10x faster on one thread when the CI box is busy; restored after."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
