"""Group items move on the one tier engine: an L1 -> L2 write-through held in flight and an
L3 fetch held inside a gated store never block ``HybridCache.admit``; once they complete (in
``poll``), the item is on L2 / L3 and a later admission resumes from it."""
import threading

import pytest

from hicache.core.config import HiCacheConfig
from hicache.core.groups import hybrid_layout
from hicache.core.hashing import page_hashes
from hicache.core.shapes import model_shape
from hicache.cache.hybrid import HybridCache
from hicache.transfer import engine

pytestmark = pytest.mark.usefixtures("one_torch_thread")
PROMPT = [(j * 7919) % 50_000 + 1 for j in range(10 * 16)]


def _cache(policy="timeout"):
    cfg = HiCacheConfig.load(env={}, overrides={"storage.url": "memory://", "pool.device_pages": "48",
                                                "pool.host_pages": "64", "pool.device": "cpu",
                                                "policy.write_policy": "write_through",
                                                "policy.prefetch_policy": policy})
    return HybridCache(cfg, layout=hybrid_layout(model_shape("gpt-oss-120b"), 16))


def _serve(hc, rid, tokens):
    req = hc.new_request(rid, tokens)
    adm = hc.admit(req)
    req.advance(req.computed_tokens)
    req.alloc(len(tokens) - req.computed_tokens)
    req.commit()
    req.finish()
    return adm


def _admit_in_thread(hc, rid, tokens):
    """Admit from another thread; joined within 60 s (a blocked admission never returns while the gate is shut)."""
    out = {}
    t = threading.Thread(target=lambda: out.update(adm=hc.admit(hc.new_request(rid, tokens))))
    t.start()
    t.join(60)
    assert not t.is_alive(), "admit blocked on a group item's transfer"
    return out["adm"]


def test_write_through_held_in_flight_never_blocks_admit(monkeypatch):
    hc = _cache()
    st = hc.stores[0]
    gate, real = threading.Event(), engine._copy_pages
    monkeypatch.setattr(engine, "_copy_pages",
                        lambda src, dst, *a, **kw: (dst is not st.host or gate.wait(60)) and real(src, dst, *a, **kw))
    _serve(hc, "a", PROMPT)  # records its end's window: 8 items, their L1 -> L2 copies held at the gate
    assert st.copies_in_flight() and len(st.l1) == 8 and not st.stored
    adm = _admit_in_thread(hc, "b", PROMPT + [7] * 5)
    assert (adm.hit, adm.resume) == (160, 160)  # resumes from the L1 copies while their backups wait
    assert st.copies_in_flight() and not st.stored
    hc.live["b"].abort()
    gate.set()
    hc.drain()
    hashes = page_hashes(PROMPT, 16)
    assert set(st.l2) == st.stored == set(hashes[2:10]) and not st.copies_in_flight()
    assert st.storage.exists([st.l3_key(h) for h in hashes[2:10]]) == [True] * 8
    hc.check_integrity()
    hc.close()


def test_l3_fetch_held_in_a_gated_store_never_blocks_admit():
    hc = _cache("timeout")  # the prefetch budget: 5 ms + 2 ms per 1K tokens
    st = hc.stores[0]
    _serve(hc, "a", PROMPT)
    hc.drain()
    st.evict_l1(100)
    st.evict_l2(100)  # the window is on L3 only
    gate, real = threading.Event(), st.storage.get
    st.storage.get = lambda *a, **kw: gate.wait(60) and real(*a, **kw)
    adm = _admit_in_thread(hc, "b", PROMPT + [7] * 5)
    assert (adm.hit, adm.resume) == (160, 0)  # the fetch did not land within the budget: a miss, floored
    hc.live["b"].abort()
    gate.set()
    hc.drain()  # the fetch lands on L2 in poll
    assert len(st.l2) == 8 and st.stats().lost == 0
    adm = _serve(hc, "c", PROMPT + [9] * 5)
    assert (adm.hit, adm.resume) == (160, 160) and st.stats().taken_l3 == 8  # brought from L3 by that fetch
    hc.drain()
    hc.check_integrity()
    hc.close()
