"""``hicache replay TRACE --simulate``: the real control plane at full scale, no model.

Each request goes through the real ``HiCache`` (index, tier manager, policies,
transfer controller and a real L3 backend, ``simulate.l3_url``). Pages carry small
stand-in payloads (one layer, one head of dimension 1, uint8) and the transfers run
inline in the scheduler thread, so the run is deterministic; bytes are *accounted*
at the real page size of ``simulate.shape`` (``hicache.core.shapes``), and tier
capacities are given in those bytes. Requests are served one at a time in arrival
order (admit, compute the miss, commit, finish).

Baselines over the same page stream (``hicache.reference.sim_report``): the
infinite cache, Belady's offline optimum at the distinct pages the tiers hold,
the real ``HiCache`` as a GPU-only prefix cache (L1 alone, plain LRU: what vLLM
and SGLang do) and with each eviction policy over L1+L2.
"""
from __future__ import annotations

import time
import zlib
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, NamedTuple

import numpy as np

from hicache.core.config import HiCacheConfig, HostNeed, SimulateConfig, check_host_memory
from hicache.reference.hash_trace import detect_format, iter_hash_trace
from hicache.core.errors import ConfigError, OutOfPages
from hicache.cache.hicache import HiCache
from hicache.core.layout import KVLayout
from hicache.core.shapes import ModelShape, model_shape


class SimRequest(NamedTuple):
    rid: str
    arrival: float  # seconds from the start of the trace
    namespace: str
    key: bytes  # the prompt's token ids, uint32 LE (hicache.index.request.as_key)


@dataclass(frozen=True, slots=True)
class SimPlan:
    """What one simulation run is sized to: the model shape and pages per tier."""

    shape: ModelShape
    page_size: int
    l1_pages: int
    l2_pages: int  # 0: no L2
    l3_pages: int  # 0: no L3
    l3_url: str

    @property
    def page_bytes(self) -> int:
        """Bytes of one page of the real model (what each simulated page stands for)."""
        return self.shape.page_bytes(self.page_size)

    @classmethod
    def from_config(cls, s: SimulateConfig, **override: int) -> "SimPlan":
        """Pages per tier from the byte capacities; ``override``: l1_bytes/l2_bytes/l3_bytes.
        ``ConfigError`` when L1 cannot hold one page."""
        shape = model_shape(s.shape)
        pb = shape.page_bytes(s.page_size)
        b = {"l1_bytes": s.l1_bytes, "l2_bytes": s.l2_bytes, "l3_bytes": s.l3_bytes, **override}
        if b["l1_bytes"] < pb:
            raise ConfigError(f"simulate.l1_bytes={b['l1_bytes']} holds no page of {s.shape} at page_size "
                              f"{s.page_size} ({pb} bytes a page)")
        plan = cls(shape, s.page_size, b["l1_bytes"] // pb, b["l2_bytes"] // pb,
                   b["l3_bytes"] // pb if s.l3_url else 0, s.l3_url)
        stand_in = stand_in_layout(plan).page_bytes  # what each simulated L1 and L2 page holds in host memory
        check_host_memory(HostNeed("simulate.l1_bytes", b["l1_bytes"], plan.l1_pages * stand_in),
                          HostNeed("simulate.l2_bytes", b["l2_bytes"], plan.l2_pages * stand_in))
        return plan


def stand_in_layout(plan: SimPlan) -> KVLayout:
    """The payload layout pages really carry: 2 bytes a token (K and V of one uint8 head)."""
    return KVLayout(model_id=f"simulate/{plan.shape.hf}", num_layers=1, num_kv_heads=1, head_dim=1,
                    dtype="uint8", page_size=plan.page_size, host_layout="page_first")


# -------------------------------------------------------------------- requests
def trace_requests(path: str | None, s: SimulateConfig, scale: str = "small") -> Callable[[], Iterator[SimRequest]]:
    """A factory of request streams (each call re-reads the trace: nothing is kept)."""
    if path is not None and detect_format(path) == "hash_blocks":
        def hashed() -> Iterator[SimRequest]:
            l1 = SimPlan.from_config(s).l1_pages  # a longer request cannot run: refused before its tokens are built
            for r in iter_hash_trace(path, s.block_tokens, page_size=s.page_size, max_pages=l1,
                                     limit=f"the L1 of simulate.l1_bytes={s.l1_bytes:,} for {s.shape}"):
                yield SimRequest(r.rid, r.arrival, "", r.tokens(s.block_tokens, s.page_size).tobytes())
        return hashed
    from hicache.reference.workloads import builtin_trace, read_trace
    trace = read_trace(path) if path else builtin_trace(scale=scale)
    return lambda: token_requests(trace.requests, trace.vocab)


def token_requests(requests: Iterable, vocab: int) -> Iterator[SimRequest]:
    """Prompts of a hicache trace in arrival order; a follow-up's parent sequence is its
    prompt plus ``max_new_tokens`` stand-in outputs (deterministic from its rid)."""
    full: dict[str, np.ndarray] = {}
    for r in sorted(requests, key=lambda r: r.arrival):
        if r.parent is None:
            prompt = np.asarray(r.prompt, dtype=np.uint32)
        else:
            prompt = np.concatenate([full[r.parent], np.asarray(r.append, dtype=np.uint32)])
        rng = np.random.default_rng(zlib.crc32(r.rid.encode()))
        full[r.rid] = np.concatenate([prompt, rng.integers(0, vocab, r.max_new_tokens, dtype=np.uint32)])
        yield SimRequest(r.rid, r.arrival, r.namespace, prompt.astype("<u4").tobytes())


# ------------------------------------------------------------------ one run
class _Clock:
    """Seconds spent in each step of a request, summed over the run."""

    def __init__(self) -> None:
        self.parts = {"match+load (admit)": 0.0, "evict (alloc)": 0.0, "insert (commit+finish)": 0.0}


def sim_config(base: HiCacheConfig, plan: SimPlan, *, eviction: str | None = None,
               l3: bool = True, backup: bool = True) -> HiCacheConfig:
    """``base`` resized to ``plan`` (CPU pools of stand-in pages, L3 per ``l3``)."""
    pol = base.policy.model_copy(update={"device_eviction": eviction or base.policy.device_eviction,
                                         "host_eviction": eviction or base.policy.host_eviction})
    if not backup:
        pol = pol.model_copy(update={"write_policy": "write_through_selective", "write_through_threshold": 1 << 30})
    return base.model_copy(update={
        "pool": base.pool.model_copy(update={"device": "cpu", "device_pages": plan.l1_pages,
                                             "host_pages": max(1, plan.l2_pages)}),
        "storage": base.storage.model_copy(update={"url": plan.l3_url if l3 and plan.l3_pages else ""}),
        "policy": pol})


def _open_l3(cfg: HiCacheConfig, layout: KVLayout, plan: SimPlan):
    """The L3 backend, capped at ``plan.l3_pages`` stand-in objects where it can be (memory://)."""
    if not cfg.storage.url:
        return None
    from hicache.storage import open_storage
    opts: dict[str, Any] = {}
    if cfg.storage.url.startswith("memory:"):
        opts["max_bytes"] = plan.l3_pages * _object_bytes(layout)
    return open_storage(cfg.storage.url, fingerprint=layout.fingerprint(), layout=layout,
                        timeout_ms=cfg.storage.timeout_ms, max_retries=cfg.storage.max_retries, **opts)


def _object_bytes(layout: KVLayout) -> int:
    """Bytes of one stand-in page as memory:// stores it (header + payload): measured."""
    from hicache.storage import open_storage
    st = open_storage("memory://", fingerprint=layout.fingerprint(), layout=layout)
    try:
        sizes = [p.page_bytes for p in layout.planes]
        st.put([(bytes(16), memoryview(bytes(sum(sizes))), sizes)])
        return st._nbytes
    finally:
        st.close()


def run_hicache(name: str, cfg: HiCacheConfig, plan: SimPlan, requests: Iterable[SimRequest],
                rate: float | None = None) -> dict[str, Any]:
    """Serve ``requests`` through a real ``HiCache`` configured by ``cfg``; one report row.

    ``rate``: None serves each request at its arrival, one at a time (no queue). Else one
    prefill server computes ``rate`` tokens/s, first come first served: a request waits
    while earlier ones compute, and every request that has arrived by the time one is
    admitted, or computes, is known to the cache (``HiCache.new_request``: the waiting
    queue an engine's scheduler holds). The row then has ``ttft_s``, each request's wait
    plus its prefill (loads and decode not modelled)."""
    import torch
    torch.set_num_threads(1)  # stand-in pages are tiny: threads only contend
    layout = stand_in_layout(plan)
    hc = HiCache(cfg, layout=layout, storage=_open_l3(cfg, layout, plan), inline_transfers=True)
    run = _Served(hc, plan, rate)
    t_start = time.perf_counter()
    try:
        run.serve(requests)
        hc.check_integrity()
        stats = hc.stats()
    finally:
        hc.close()
    return run.row(name, cfg, stats, time.perf_counter() - t_start)


class _Served:
    """One replay's serving loop and its counts (``run_hicache``)."""

    def __init__(self, hc: HiCache, plan: SimPlan, rate: float | None):
        self.hc, self.plan, self.rate = hc, plan, rate
        self.clock = _Clock().parts
        self.l1 = self.l2 = self.l3 = self.prompt = self.n = 0
        self.first = self.last = 0.0
        self.ttft: list[float] = []

    def serve(self, requests: Iterable[SimRequest]) -> None:
        it = iter(requests)
        pending: deque = deque()  # (SimRequest, handle): arrived, not admitted
        nxt = next(it, None)
        t = 0.0
        while nxt is not None or pending:
            if not pending:  # the server is idle: the next arrival starts at once
                t = max(t, nxt.arrival)
                pending.append((nxt, self.hc.new_request(nxt.rid, nxt.key, nxt.namespace)))
                nxt = next(it, None)
            if self.rate is not None:
                nxt = self._arrive(it, nxt, pending, t)
            r, req = pending.popleft()
            t = self._one(r, req, t, lambda end: self._arrive(it, nxt, pending, end))
            if self.rate is not None:
                nxt = self._next
        self.hc.drain()

    def _arrive(self, it, nxt, pending: deque, until: float):
        """Note every request arrived by ``until`` (waiting); the next one not yet arrived."""
        hc, added = self.hc, False
        while nxt is not None and nxt.arrival <= until:
            pending.append((nxt, hc.new_request(nxt.rid, nxt.key, nxt.namespace)))
            nxt, added = next(it, None), True
        if added:
            hc.poll()  # the waiting requests' L3 pages start toward L2
        self._next = nxt
        return nxt

    def _one(self, r: SimRequest, req, start: float, arrive) -> float:
        """Admit, compute and finish ``req`` from ``start``; returns when it is done."""
        hc, perf, clock = self.hc, time.perf_counter, self.clock
        t0 = perf()
        adm = hc.admit(req)
        t1 = perf()
        try:
            req.alloc(req.num_tokens - adm.hit_tokens)
        except OutOfPages:
            raise ConfigError(f"request {r.rid} needs {-(-req.num_tokens // self.plan.page_size)} pages of L1, "
                              f"more than its {self.plan.l1_pages}; raise simulate.l1_bytes") from None
        t2 = perf()
        end = start
        if self.rate is not None:
            end = start + (req.num_tokens - adm.hit_tokens) / self.rate
            arrive(end)  # those arriving while it computes wait for it
            self.ttft.append(end - r.arrival)
        req.commit()
        req.finish()
        hc.drain()  # backups, then the stores they start: done before the next admission
        t3 = perf()
        clock["match+load (admit)"] += t1 - t0
        clock["evict (alloc)"] += t2 - t1
        clock["insert (commit+finish)"] += t3 - t2
        self.l1 += adm.device_tokens
        self.l2 += adm.host_tokens - adm.storage_tokens
        self.l3 += adm.storage_tokens
        self.prompt += req.num_tokens
        self.first, self.last = (r.arrival if self.n == 0 else self.first), r.arrival
        self.n += 1
        return end

    def row(self, name: str, cfg: HiCacheConfig, stats, wall: float) -> dict[str, Any]:
        plan, tb = self.plan, self.plan.shape.token_bytes
        l1, l2, l3, prompt = self.l1, self.l2, self.l3, self.prompt
        idx = stats.index
        stored = stats.tiers.storage_put_pages
        out = {"name": name, "requests": self.n, "prompt_tokens": prompt, "hit_tokens": l1 + l2 + l3,
               "hit_rate": (l1 + l2 + l3) / prompt if prompt else 0.0,
               "l1_hit_tokens": l1, "l2_hit_tokens": l2, "l3_hit_tokens": l3,
               "l1_hit_bytes": l1 * tb, "l2_hit_bytes": l2 * tb, "l3_hit_bytes": l3 * tb,
               "recomputed_tokens": prompt - l1 - l2 - l3,
               "l1_used_bytes": idx.device_pages_cached * plan.page_bytes,
               "l2_used_bytes": idx.host_pages_cached * plan.page_bytes if cfg.pool.host_pages > 1 else 0,
               "l3_stored_bytes": stored * plan.page_bytes,
               "misses": stats.misses.as_dict(), "time_s": wall,
               "time_parts_s": dict(self.clock), "duration_s": self.last - self.first,
               "evicted_pages": {"L1": idx.device_evicted_pages, "L2": idx.host_evicted_pages}}
        if self.rate is not None:
            out["ttft_s"] = self.ttft
        return out
