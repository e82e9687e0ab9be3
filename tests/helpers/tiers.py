"""One place for the tiers tests' ``HiCache`` builder and request driver (toy shape:
2 layers, 1 KV head of 4, float32, page 4) and the value checks that go with it:
every token's rows hold ``page_value(token, plane)``, so any page that moved is
checked by value against what recomputing it would write."""
from __future__ import annotations

import threading

import torch

import hicache.transfer.engine as transfer_module

from hicache.core.config import HiCacheConfig
from hicache.cache.hicache import Admission, HiCache
from hicache.core.layout import KVLayout

PS = 4
TOK = list(range(100, 121))  # 5 pages + 1 token


LAYOUT = KVLayout(model_id="t", num_layers=2, num_kv_heads=1, head_dim=4, dtype="float32",
                  page_size=PS, host_layout="page_first")


def make(url: str = "", **over) -> HiCache:
    """A CPU ``HiCache`` of ``LAYOUT``: 16 L1 pages, 32 L2 pages, L3 at ``url`` ("" for
    none), prefetch ``wait_complete``; ``over``: more config overrides."""
    layout = LAYOUT
    o = {"storage.url": url, "pool.device": "cpu", "pool.device_pages": "16", "pool.host_pages": "32",
         "policy.prefetch_policy": "wait_complete"}
    o.update({k: str(v) for k, v in over.items()})
    return HiCache(HiCacheConfig.load(env={}, overrides=o), layout=layout)


def page_value(token: int, plane: int) -> float:
    """What 'computing' ``token`` writes into every element of its row of ``plane``."""
    return float(token * 10 + plane)


def serve(hc: HiCache, rid: str, tokens: list[int], finish: bool = True):
    """Admit, 'compute' the missing tokens by writing token-derived values, commit
    (and finish), poll. Returns the admission and the request."""
    req = hc.new_request(rid, tokens)
    adm: Admission = hc.admit(req)
    adm.wait()
    start = req.computed_tokens
    req.alloc(len(tokens) - start)
    slots = hc.device_pool.slot_ids(req.pages)[:len(tokens)]
    for i, buf in enumerate(hc.device_pool.buffers):
        for pos in range(start, len(tokens)):
            buf[slots[pos]] = page_value(tokens[pos], i)
    req.commit()
    if finish:
        req.finish()
    hc.poll()
    return adm, req


def check_l1_values(hc: HiCache, tokens: list[int]) -> int:
    """Every L1 hit row of ``tokens`` holds what recomputing it would write; returns the hit."""
    m = hc.cache.match(tokens)
    slots = hc.device_pool.slot_ids(m.device_pages)
    for i, buf in enumerate(hc.device_pool.buffers):
        for pos in range(m.device_tokens):
            assert torch.all(buf[slots[pos]] == page_value(tokens[pos], i)), (pos, i)
    return m.device_tokens


class CopyGate:
    """Holds every page copy of the transfer workers until ``open()`` (an L1 <-> L2
    copy still in flight, whatever the machine's speed)."""

    def __init__(self, monkeypatch):
        self.event = threading.Event()
        orig = transfer_module._copy_pages

        def held(*a, **k):
            self.event.wait()
            orig(*a, **k)
        monkeypatch.setattr(transfer_module, "_copy_pages", held)

    def open(self) -> None:
        self.event.set()
