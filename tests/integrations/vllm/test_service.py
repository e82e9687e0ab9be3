"""HiCacheTier through the node-local service (``hicache+unix://``): two vLLM
instances on one node share pages through a real ``hicache serve`` started with
the tier's layout."""
from __future__ import annotations

import numpy as np
from vllm.v1.kv_offload.base import LookupResult, ReqContext

from ..service_proc import start_serve, stop_serve
from .test_tier import _fill
from .tiers import resolve
from .tiers import ROW, finish, job, keys, primary, tier


def test_two_instances_share_pages_through_the_service():
    arr, view = primary()
    probe = tier("memory://", view)
    layout = probe.layout  # what the service must be started with (the tier logs it too)
    probe.shutdown()
    serve = start_serve(layout)
    try:
        writer = tier(serve.url, view, probe_l3=False)
        want = _fill(arr, [0, 1, 2], seed=5)
        writer.submit_store(job(1, keys(1, 2, 3), [0, 1, 2], promotion=False))
        res = finish(writer)[1]
        assert res.success and res.transfer_bytes == 3 * ROW
        writer.check_integrity()
        writer.shutdown()

        arr2, view2 = primary()
        reader = tier(serve.url, view2)  # another instance: knows nothing, asks the service
        ctx = ReqContext("later")
        assert [resolve(reader, k, ctx) for k in keys(1, 2, 3, 9)] == [LookupResult.HIT] * 3 + [LookupResult.MISS]
        reader.submit_load(job(2, keys(3, 1, 2), [7, 5, 6], promotion=True))
        assert finish(reader)[2].success
        assert np.array_equal(arr2[[5, 6, 7]], want) and not arr2[[0, 1, 2, 3, 4]].any()
        reader.on_request_finished(ctx)
        reader.check_integrity()
        reader.shutdown()
    finally:
        stop_serve(serve)
