"""SGLang TP ranks sharing pages through the node-local service (hicache+unix://)."""
from __future__ import annotations

import torch
from sglang.srt.managers.cache_controller import PrefetchOperation

from hicache.integrations.sglang_keys import sglang_layout

from ..service_proc import start_serve, stop_serve
from .conftest import PAGE, controller, host_pool, storage_config
from .test_backend import keys_for, pages_of


def test_mla_tp_ranks_share_pages_through_the_service(model, controllers):
    layout = sglang_layout(host_pool("mla", "page_first"),
                           storage_config("mla", "page_first", "memory://", model=model, tp_rank=0, tp_size=2))
    serve = start_serve(layout)
    try:
        url = serve.url
        c0 = controller("mla", "page_first", url, model, tp_rank=0, tp_size=2)
        c1 = controller("mla", "page_first", url, model, tp_rank=1, tp_size=2)
        controllers.extend([c0, c1])
        keys = keys_for(3, seed=11)
        src = c0.mem_pool_host.alloc(3 * PAGE)
        assert c0._page_set_zero_copy(keys, src)
        dst = c1.mem_pool_host.alloc(3 * PAGE)
        assert c1.storage_backend.batch_exists(keys) == 3
        assert c1._page_get_zero_copy(PrefetchOperation("r", []), keys, dst) == 3
        assert all(torch.equal(a, b) for a, b in zip(pages_of(c1.mem_pool_host, dst),
                                                      pages_of(c0.mem_pool_host, src)))
        c1.storage_backend.check_integrity()
    finally:
        for c in controllers:
            c.detach_storage_backend()
        controllers.clear()
        stop_serve(serve)
