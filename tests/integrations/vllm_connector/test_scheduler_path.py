"""HiCacheConnector through vLLM's own scheduler: stores, floored hits beyond vLLM's
own prefix cache, byte-exact loads from L2 and L3 (``harness.Engine`` checks every
computed token's bytes in every forward)."""
from __future__ import annotations

import pytest

from tests.integrations.vllm_connector.harness import BLOCK, TOY, Engine, tokens


def _extra(tmp_path=None, load="async", host_pages=64):
    url = "" if tmp_path is None else f"file://{tmp_path}/l3"
    return {"load": load, "pool": {"host_pages": host_pages}, "storage": {"url": url}}


@pytest.mark.parametrize("load", ["async", "layerwise"])
def test_store_then_floored_hit_loads_exact(load):
    eng = Engine(_extra(load=load))
    p = tokens(1, 5 * BLOCK + 3)
    eng.add("r1", p)
    eng.run()
    s = eng.core.stats()
    # r1 computed its 83 prompt tokens and 1 of its 2 generated: 5 full pages reach L2.
    assert s.saved_pages == 5 and s.save_dropped_pages == 0
    eng.reset_vllm_prefix_cache()
    q = p[:4 * BLOCK + 5] + tokens(2, 20)  # shares 4 whole pages and 5 tokens of the fifth
    eng.add("r2", q)
    eng.run()
    rid, local, hit, is_async = eng.lookups[-1]
    assert (rid, local, hit, is_async) == ("r2", 0, 4 * BLOCK, load == "async")
    s = eng.core.stats()
    assert s.loaded_pages == 4 and s.load_error_pages == 0 and s.hit_tokens["L2"] == 4 * BLOCK
    assert eng.checked_tokens > 4 * BLOCK
    eng.check_integrity()
    eng.close()
