"""HiCache end to end at every published model shape (``hicache.core.shapes``): pages of
the real bytes of all layers go L1 -> L2 -> L3 (file://), come back into a new
instance's L1 through L2, and every row is compared with what was written."""
from __future__ import annotations

import pytest
import torch

from hicache.core.config import HiCacheConfig
from hicache.cache.hicache import HiCache
from hicache.core.shapes import model_shapes

SHAPES = {m.name: m for m in model_shapes()}
CASES = [(n, 16) for n in SHAPES] + [(n, 64) for n, m in SHAPES.items() if m.is_mla]
PAGES = 3


# Many small tensor ops: one torch thread (tests/conftest.py says why).
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def make(name: str, page_size: int, url: str, host_layout: str) -> HiCache:
    layout = SHAPES[name].kv_layout(page_size, host_layout=host_layout)
    o = {"storage.url": url, "pool.device": "cpu", "pool.device_pages": "5", "pool.host_pages": "5",
         "policy.prefetch_policy": "wait_complete"}
    return HiCache(HiCacheConfig.load(env={}, overrides=o), layout=layout)


def rows_for(hc: HiCache, n: int, seed: int) -> list[torch.Tensor]:
    """Random rows, one tensor per plane, typed as the plane ([n, *row_shape])."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for s in hc.layout.planes:
        raw = torch.randint(0, 256, (n, s.row_bytes), dtype=torch.uint8, generator=gen)
        out.append(raw.view(s.dtype).view(n, *s.row_shape))
    return out


def serve(hc: HiCache, rid: str, tokens: list[int], rows: list[torch.Tensor]):
    """Admit; write the rows of the tokens not matched (the 'forward pass'); commit, finish."""
    req = hc.new_request(rid, tokens)
    adm = hc.admit(req)
    adm.wait()
    start = req.computed_tokens
    req.alloc(len(tokens) - start)
    slots = hc.device_pool.slot_ids(req.pages)[start:len(tokens)]
    for buf, r in zip(hc.device_pool.buffers, rows):
        buf[slots] = r[start:]
    req.commit()
    req.finish()
    hc.poll()
    return adm


def l1_rows_equal(hc: HiCache, tokens: list[int], rows: list[torch.Tensor]) -> int:
    m = hc.cache.match(tokens)
    slots = hc.device_pool.slot_ids(m.device_pages)[:m.device_tokens]
    for j, (buf, r) in enumerate(zip(hc.device_pool.buffers, rows)):
        got = buf[slots].view(torch.uint8)
        assert torch.equal(got, r[:m.device_tokens].view(torch.uint8)), f"plane {j} differs"
    return m.device_tokens


@pytest.mark.parametrize("name,page_size", CASES)
def test_real_pages_through_every_tier(name, page_size, tmp_path):
    url = f"file://{tmp_path}/l3"
    tokens = list(range(1000, 1000 + PAGES * page_size + 1))  # whole pages and one private token
    full = PAGES * page_size
    a = make(name, page_size, url, "page_first")
    rows = rows_for(a, len(tokens), seed=len(name) * 100 + page_size)
    serve(a, "a", tokens, rows)
    a.drain()
    assert a.stats().tiers.storage_put_pages == PAGES
    a.evict(100)  # L1 empty: the next hit comes from L2
    adm = serve(a, "b", tokens, rows)
    assert (adm.device_tokens, adm.host_tokens) == (0, full)
    assert l1_rows_equal(a, tokens, rows) == full
    a.check_integrity()
    a.close()

    b = make(name, page_size, url, "layer_first")  # a new process, the other host layout: same fingerprint
    assert b.layout.fingerprint() == a.layout.fingerprint()
    adm = serve(b, "c", tokens, rows)
    assert (adm.host_tokens, adm.storage_tokens) == (full, full)
    assert l1_rows_equal(b, tokens, rows) == full
    st = b.stats().storage
    assert (st.hits, st.corrupt, st.fingerprint_mismatch) == (PAGES, 0, 0)
    assert st.bytes_read == PAGES * b.layout.page_bytes
    b.check_integrity()
    b.close()
