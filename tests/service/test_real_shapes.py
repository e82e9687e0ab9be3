"""The engine service's shared L2 segment with real pages (``hicache.core.shapes``): a
GQA model's 2 MiB page at page 16 and DeepSeek-V3's MLA page with its draft layer
at page 64 (4.4 MiB), written by one client and read byte-exact by another; a
client of another model is refused naming the fields."""
from __future__ import annotations

import random

import pytest

from hicache.client.link import ServiceClient
from hicache.core.errors import ContractMismatch
from hicache.core.hashing import page_hashes
from hicache.core.shapes import model_shape

from .conftest import served

CASES = [("llama-3.1-8b", 16, "page_first"), ("deepseek-v3", 64, "layer_first")]


@pytest.fixture(params=CASES, ids=[c[0] for c in CASES])
def real_service(request):
    name, ps, host_layout = request.param
    with served(model_shape(name).kv_layout(ps, host_layout=host_layout), host_pages=6, prefix="hcr") as svc:
        yield svc.layout, svc.socket


def test_real_pages_through_the_shared_segment(real_service):
    layout, sock = real_service
    ps = layout.page_size
    tokens = list(range(500, 500 + 3 * ps))
    hashes = page_hashes(tokens, ps)
    payloads = [random.Random(f"{layout.model_id}/{i}").randbytes(layout.page_bytes) for i in range(3)]
    with ServiceClient(sock, layout, pin=False) as a, ServiceClient(sock, layout, pin=False) as b:
        pages = a.reserve(3)
        for p, pl in zip(pages, payloads):
            a.pool.write_page(p, pl)
        a.commit(hashes, pages)
        assert b.lookup(hashes).num_pages == 3
        got = b.acquire(hashes)
        assert list(got) == list(pages)
        assert [b.pool.read_page(p) for p in got] == payloads  # b's own mapping of the segment
        b.release(hashes)
        s = b.stats()
        assert (s["committed_pages"], s["reserved_pages"], s["locked_pages"]) == (3, 0, 0)
        a.check_integrity()
        b.check_integrity()
    other = model_shape("qwen3-8b").kv_layout(ps, host_layout=layout.host_layout)
    with pytest.raises(ContractMismatch) as e:
        ServiceClient(sock, other, pin=False)
    assert {"model_id", "num_layers"} <= {d[0] for d in e.value.differences}
