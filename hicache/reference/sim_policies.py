"""``hicache replay --simulate --policies P``: every eviction policy at every capacity.

Two modes per capacity ``C`` tokens: GPU-only (L1 = ``C``, no L2: the index alone,
as an engine's own prefix cache, ``run_index``) and L1+L2 (L2 = ``C``, L1 = ``C / 8``, write_through); L1 is never
smaller than the largest request. Under write_through L2 holds a copy of every L1
page, so both modes hold ``C`` distinct tokens and Belady's MIN there bounds both
(``sim_report.distinct_capacity``; at the larger of the two where the floor on L1
lifts a mode above ``C``). Each row is a real ``HiCache`` run over the same
requests; a policy's rank is its place among the policies in that mode and capacity
(1 = most hit tokens, ties share a rank); the gap closed is ``(policy - lru) /
(Belady - lru)``.
"""
from __future__ import annotations

import heapq
import re
import sys
import time
from typing import Any, Callable, Iterable, Iterator, NamedTuple

import numpy as np

from hicache.reference.progress import point_text
from hicache.core.config import HiCacheConfig
from hicache.core.errors import ConfigError
from hicache.core.hashing import namespace_root, raw_page_hashes
from hicache.reference.simulate import SimPlan, SimRequest, run_hicache, sim_config


class PageStream(NamedTuple):
    """Per request: its full pages' ids, how many it may hit, its prompt tokens."""

    pages: list[np.ndarray]  # int64 page ids of each request's full pages
    caps: list[int]  # pages each request may hit at most
    tokens: list[int]  # prompt tokens of each request
    unique_pages: int  # distinct pages in the whole stream: the working set
    arrivals: tuple[float, ...] = ()  # each request's arrival (seconds from the trace's start)


# ---- Offline baselines of ``--simulate`` over the same page stream as the real runs.
#
# A request of ``n`` tokens may hit at most its first ``(n - 1) // page_size``
# pages (the last token is always computed) and, once served, holds its
# ``n // page_size`` full pages: the rules ``HiCache`` follows. Pages are named
# by their chained page hash (``hicache.core.hashing``), numbered densely here.
#
# - ``infinite``: every page any earlier request held is still cached.
# - ``belady``: one cache of ``capacity`` pages; when full, the page whose next
#   use is furthest in the future goes first (Belady's MIN: no eviction policy
#   hits more at this capacity). Ties go to the deeper page, so a page never
#   outlives its prefix. It sees one pool of the distinct pages the tiers can
#   hold together (``distinct_capacity``: ``max(L1, L2)`` when L2 holds a copy
#   of every L1 page, ``L1 + L2`` when a page may live on one tier).
def page_stream(requests: Iterable, page_size: int) -> PageStream:
    """Number the pages of ``requests`` (``SimRequest``s) by their chained hash."""
    ids: dict[bytes, int] = {}
    pages, caps, tokens, arrivals = [], [], [], []
    for r in requests:
        arrivals.append(r.arrival)
        n = len(r.key) // 4
        hs = raw_page_hashes(r.key, page_size, namespace_root(r.namespace))
        pages.append(np.fromiter((ids.setdefault(h, len(ids)) for h in hs), dtype=np.int64, count=len(hs)))
        caps.append(max(0, n - 1) // page_size)
        tokens.append(n)
    return PageStream(pages, caps, tokens, len(ids), tuple(arrivals))


def _prefix_in(ids: np.ndarray, cap: int, cached) -> int:
    k = 0
    while k < cap and int(ids[k]) in cached:
        k += 1
    return k


def infinite(stream: PageStream, page_size: int) -> int:
    """Hit tokens of an infinite cache."""
    seen: set[int] = set()
    hit = 0
    for ids, cap in zip(stream.pages, stream.caps):
        hit += _prefix_in(ids, cap, seen) * page_size
        seen.update(ids.tolist())
    return hit


def belady(stream: PageStream, page_size: int, capacity: int, per_request: list[int] | None = None) -> int:
    """Hit tokens of Belady's MIN over one pool of ``capacity`` pages; ``per_request``: when
    given, each request's hit tokens are appended to it."""
    if capacity <= 0:
        if per_request is not None:
            per_request += [0] * len(stream.pages)
        return 0
    never = len(stream.pages)
    nxt: list[np.ndarray] = [np.empty(0, dtype=np.int64)] * len(stream.pages)
    last: dict[int, int] = {}
    for i in range(len(stream.pages) - 1, -1, -1):  # next use of each page after request i
        ids = stream.pages[i].tolist()
        nxt[i] = np.fromiter((last.get(p, never) for p in ids), dtype=np.int64, count=len(ids))
        for p in ids:
            last[p] = i
    cached: dict[int, int] = {}  # page -> its next use
    heap: list[tuple[int, int, int]] = []  # (-next use, -depth, page); stale entries skipped
    hit = 0
    for i, (ids, cap) in enumerate(zip(stream.pages, stream.caps)):
        got = _prefix_in(ids, cap, cached) * page_size
        hit += got
        if per_request is not None:
            per_request.append(got)
        for depth, (p, u) in enumerate(zip(ids.tolist(), nxt[i].tolist())):
            cached[p] = u
            heapq.heappush(heap, (-u, -depth, p))
        while len(cached) > capacity:
            u, _, p = heapq.heappop(heap)
            if cached.get(p) == -u:
                del cached[p]
    return hit


Factory = Callable[[], Iterator[SimRequest]]
DEFAULT_CAPACITIES = "0.25M,0.5M,1M,2M,5M,10M,20M"
GAP_CAPACITIES = (500_000, 2_000_000, 10_000_000)  # where the default must close 1/3 of the LRU->Belady gap
MODES = ("GPU-only", "L1+L2")
L1_SHARE = 8  # L1+L2 mode: L1 is an eighth of L2 (one H200's 100 GiB next to ~1 TiB of host memory)


def parse_capacities(text: str) -> list[int]:
    """``"0.25M,2M,500K,4096"`` -> token counts. ``ConfigError`` names a bad item."""
    out = []
    for item in text.split(","):
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kKmMgG]?)\s*", item)
        if not m:
            raise ConfigError(f"--capacities item {item!r}: want a token count like 0.5M, 500K or 4096")
        out.append(int(float(m[1]) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[m[2].lower()]))
    return out


def _plan(base: SimPlan, mode: str, tokens: int, largest: int) -> SimPlan:
    pages = max(1, tokens // base.page_size)
    if mode == "GPU-only":
        return SimPlan(base.shape, base.page_size, max(pages, largest), 0, 0, "")
    return SimPlan(base.shape, base.page_size, max(pages // L1_SHARE, largest), pages, 0, "")


def run_index(policy: str, plan: SimPlan, requests) -> dict[str, Any]:
    """GPU-only: the index alone (a ``PrefixCache`` over an L1 allocator, what an engine's
    own prefix cache is), no payloads and no miss tracking. Hits as ``run_hicache`` counts them."""
    from hicache.core.layout import KVLayout
    from hicache.index.prefix_cache import PrefixCache
    from hicache.memory.allocator import PageAllocator
    ps = plan.page_size
    cache = PrefixCache(KVLayout("simulate/index", 1, num_kv_heads=1, head_dim=1, page_size=ps),
                        PageAllocator(plan.l1_pages), eviction=policy)
    hit = prompt = 0
    t0 = time.perf_counter()
    for r in requests:
        req = cache.new_request(r.rid, r.key, r.namespace)
        req.lock(req.match())
        hit += req.computed_tokens
        prompt += req.num_tokens
        req.alloc(req.num_tokens - req.computed_tokens)
        req.commit()
        req.finish()
    cache.check_integrity()
    return {"hit_tokens": hit, "hit_rate": hit / prompt if prompt else 0.0, "time_s": time.perf_counter() - t0}


def _refuse_tier_bytes(cfg: HiCacheConfig) -> None:
    """The sweep sizes L1 and L2 from its capacities: tier sizes set in bytes would be ignored."""
    s = cfg.simulate
    given = [f"simulate.{k}={getattr(s, k):,}" for k in ("l1_bytes", "l2_bytes") if k in s.model_fields_set]
    if given:
        raise ConfigError(f"--policies sizes L1 and L2 from --capacities (GPU-only: L1 = C; L1+L2: L2 = C, "
                          f"L1 = C/{L1_SHARE}), so {' and '.join(given)} would be ignored: drop it, or "
                          "run --simulate without --policies for one run at those sizes")


def _ranks(hits: dict[str, int]) -> dict[str, int]:
    order = sorted(hits.values(), reverse=True)
    return {p: 1 + order.index(h) for p, h in hits.items()}


def policy_sweep(cfg: HiCacheConfig, factory: Factory, policies: list[str], capacities: list[int],
                 modes=MODES, log=None) -> dict[str, Any]:
    """Hit rate of every policy in every mode at every capacity, Belady and the
    infinite cache beside them; one progress line per run on ``log`` (default stderr)."""
    log = log or (lambda s: print(s, file=sys.stderr, flush=True))
    if cfg.policy.write_policy.value != "write_through":
        raise ConfigError(f"--policies compares L1+L2 under write_through (L2 inclusive of L1); "
                          f"policy.write_policy is {cfg.policy.write_policy.value}")
    _refuse_tier_bytes(cfg)
    base = SimPlan.from_config(cfg.simulate)
    ps = base.page_size
    stream = page_stream(factory(), ps)
    prompt = sum(stream.tokens)
    largest = max((len(p) + 1 for p in stream.pages), default=1)
    runs: list[dict[str, Any]] = []
    bound: dict[int, float] = {}  # capacity -> Belady's hit rate there
    total, done, t0 = len(capacities) * (len(modes) * len(policies) + 1), 0, time.perf_counter()
    for c in capacities:
        distinct = max(max(p.l1_pages, p.l2_pages) for p in (_plan(base, m, c, largest) for m in modes))
        bound[c] = belady(stream, ps, distinct) / prompt if prompt else 0.0
        done += 1
        log(f"[{point_text(done, total, time.perf_counter() - t0, done)}] {c:,} tokens: Belady at {distinct:,} "
            f"pages {bound[c]:.1%}")
        for mode in modes:
            plan = _plan(base, mode, c, largest)
            for p in policies:
                if mode == "GPU-only":
                    row = run_index(p, plan, factory())
                else:
                    row = run_hicache(f"{mode} {p}", sim_config(cfg, plan, eviction=p, l3=False), plan, factory())
                runs.append({"mode": mode, "capacity_tokens": c, "policy": p, "l1_pages": plan.l1_pages,
                             "l2_pages": plan.l2_pages, "hit_tokens": row["hit_tokens"],
                             "hit_rate": row["hit_rate"], "time_s": row["time_s"]})
                done += 1
                log(f"[{point_text(done, total, time.perf_counter() - t0, done)}] {c:,} tokens {mode} {p}: "
                    f"{row['hit_rate']:.1%} ({row['time_s']:.1f} s)")
    for mode in modes:
        for c in capacities:
            rows = [r for r in runs if r["mode"] == mode and r["capacity_tokens"] == c]
            ranks = _ranks({r["policy"]: r["hit_tokens"] for r in rows})
            lru = next((r["hit_rate"] for r in rows if r["policy"] == "lru"), None)
            for r in rows:
                r["rank"] = ranks[r["policy"]]
                gap = bound[c] - lru if lru is not None else 0.0
                r["gap_closed"] = (r["hit_rate"] - lru) / gap if lru is not None and gap > 1e-12 else None
    return {"page_size": ps, "prompt_tokens": prompt, "working_set_pages": stream.unique_pages,
            "infinite_hit_rate": infinite(stream, ps) / prompt if prompt else 0.0, "policies": policies,
            "capacities": capacities, "modes": list(modes), "belady": bound, "runs": runs,
            "default": cfg.policy.device_eviction}


def _tok(n: int) -> str:
    return f"{n / 1e6:g}M" if n >= 1e6 else f"{n / 1e3:g}K" if n >= 1e3 else str(n)


def format_policy_sweep(sw: dict[str, Any], trace: str) -> str:
    pols, d = sw["policies"], sw["default"]
    lines = [f"eviction policies on {trace}: hit rate (rank among {len(pols)}) per capacity; working set "
             f"{sw['working_set_pages']:,} pages of {sw['page_size']} tokens, infinite cache "
             f"{sw['infinite_hit_rate']:.1%}; default {d}"]
    for mode in sw["modes"]:
        head = ["capacity", *pols, "Belady", f"{d} gap closed" if d in pols else ""]
        table = [head]
        for c in sw["capacities"]:
            rows = {r["policy"]: r for r in sw["runs"] if r["mode"] == mode and r["capacity_tokens"] == c}
            g = rows[d]["gap_closed"] if d in rows else None
            held = max(max(r["l1_pages"], r["l2_pages"]) for r in rows.values()) * sw["page_size"]
            label = _tok(c) if held <= c else f"{_tok(c)}->{_tok(held)}"  # lifted to hold the largest request
            table.append([label, *(f"{rows[p]['hit_rate']:.1%} ({rows[p]['rank']})" for p in pols),
                          f"{sw['belady'][c]:.1%}", "-" if g is None else f"{g:+.0%}"])
        widths = [max(len(r[i]) for r in table) for i in range(len(head))]
        lines += ["", f"{mode}" + (" (L1 = L2 / 8, at least the largest request; write_through)"
                                   if mode == "L1+L2" else " (L1 alone)")]
        lines += ["  ".join(x.rjust(w) for x, w in zip(r, widths)) for r in table]
    return "\n".join(lines)


def plot_policy_sweep(sw: dict[str, Any], path: str, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker
    fig, axes = plt.subplots(1, len(sw["modes"]), figsize=(6 * len(sw["modes"]) + 2.2, 4.8), sharey=True)
    caps = sw["capacities"]
    styles = ("-", "--", "-.", ":")  # with 10 colours and 10 markers: no two policies look alike
    for ax, mode in zip(axes if len(sw["modes"]) > 1 else [axes], sw["modes"]):
        for i, p in enumerate(sw["policies"]):
            ys = [next(r["hit_rate"] for r in sw["runs"] if r["mode"] == mode and r["capacity_tokens"] == c
                       and r["policy"] == p) for c in caps]
            ax.plot(caps, ys, marker="osD^v<>ph*"[i % 10], color=f"C{i % 10}", markersize=5,
                    linestyle=styles[i % len(styles)], linewidth=2.4 if p == sw["default"] else 1.2,
                    label=p + (" (default)" if p == sw["default"] else ""))
        ax.plot(caps, [sw["belady"][c] for c in caps], "k--", marker="x", label="Belady MIN (offline)")
        ax.axhline(sw["infinite_hit_rate"], color="gray", linestyle=":", label="infinite cache")
        ax.set_xscale("log")
        ax.set_xticks(caps, [_tok(c) for c in caps])
        ax.minorticks_off()
        ax.set_xlabel("capacity (tokens)")
        ax.set_title(mode, fontsize=10)
        ax.yaxis.set_major_formatter(matplotlib.ticker.PercentFormatter(1.0))
        ax.grid(alpha=0.3)
    (axes[0] if len(sw["modes"]) > 1 else axes).set_ylabel("hit rate (of prompt tokens)")
    (axes[-1] if len(sw["modes"]) > 1 else axes).legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1.0))
    fig.suptitle(title, fontsize=11)
    fig.text(0.5, 0.01, "The space between a policy and Belady is what knowing the future would save; "
             "the curves meet once the cache holds the working set.", ha="center", fontsize=8)
    fig.tight_layout(rect=(0, 0.04, 1, 0.95))  # (the legend right of the last panel, outside the data)
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---- ``--utilisation``: the waiting queue an engine's scheduler holds, seen by the cache.
#
# One prefill server, first come first served, at ``rate`` tokens/s: a request waits while
# earlier ones compute, and the cache knows every request that has arrived
# (``HiCache.new_request`` before ``admit``). Utilisation ``u`` sets the rate: LRU's
# recomputed tokens, served without a queue, over ``u`` times the trace's span. Three rows
# per capacity and utilisation: LRU alone (``policy.protect_waiting`` off), LRU with the
# waiting queue's pages protected (on), and Belady's MIN at the distinct pages the tiers
# hold (its TTFT through the same queue). TTFT = wait + prefill of the missed tokens.
UTILISATIONS = (0.5, 0.8, 0.95)
QUEUE_CAPACITIES = "0.5M,2M"
QUEUE_ROWS = ("lru", "lru+waiting", "Belady")


def fcfs_ttft(arrivals, work_tokens, rate: float) -> list[float]:
    """Each request's time to first token at one FCFS server of ``rate`` tokens/s."""
    t, out = 0.0, []
    for a, w in zip(arrivals, work_tokens):
        t = max(t, a) + w / rate
        out.append(t - a)
    return out


def _ttft_stats(ttft: list[float]) -> dict[str, float]:
    a = np.asarray(ttft, dtype=np.float64)
    return {"ttft_p50_s": float(np.percentile(a, 50)) if a.size else 0.0,
            "ttft_p90_s": float(np.percentile(a, 90)) if a.size else 0.0}


def queue_sweep(cfg: HiCacheConfig, factory: Factory, capacities: list[int],
                utilisations=UTILISATIONS, log=None) -> dict[str, Any]:
    """Hit rate and TTFT of LRU, LRU with the waiting queue protected, and Belady, per
    capacity (L1+L2 mode of ``policy_sweep``) and utilisation; one line per run on ``log``."""
    log = log or (lambda s: print(s, file=sys.stderr, flush=True))
    _refuse_tier_bytes(cfg)
    base = SimPlan.from_config(cfg.simulate)
    ps = base.page_size
    stream = page_stream(factory(), ps)
    span = (stream.arrivals[-1] - stream.arrivals[0]) if stream.arrivals else 0.0
    if span <= 0:
        raise ConfigError("--utilisation needs requests spread in time; every request of this trace arrives at once")
    largest = max((len(p) + 1 for p in stream.pages), default=1)
    prompt = sum(stream.tokens)
    cells = []
    for c in capacities:
        plan = _plan(base, "L1+L2", c, largest)
        runs = {name: _waiting(sim_config(cfg, plan, eviction="lru", l3=False), name != "lru")
                for name in QUEUE_ROWS[:2]}
        work = run_hicache("lru, no queue", runs["lru"], plan, factory())["recomputed_tokens"]
        per: list[int] = []
        belady(stream, ps, max(plan.l1_pages, plan.l2_pages), per)
        for u in utilisations:
            rate = work / (u * span)
            cell = {"capacity_tokens": c, "utilisation": u, "rate_tokens_per_s": rate}
            for name, rcfg in runs.items():
                row = run_hicache(name, rcfg, plan, factory(), rate)
                cell[name] = {"hit_rate": row["hit_rate"], **_ttft_stats(row["ttft_s"]), "time_s": row["time_s"]}
                log(f"{_tok(c)} tokens at {u:.0%}: {name} {row['hit_rate']:.2%} ({row['time_s']:.1f} s)")
            ttft = fcfs_ttft(stream.arrivals, [n - h for n, h in zip(stream.tokens, per)], rate)
            cell["Belady"] = {"hit_rate": sum(per) / prompt if prompt else 0.0, **_ttft_stats(ttft)}
            gap = cell["Belady"]["hit_rate"] - cell["lru"]["hit_rate"]
            cell["gap_closed"] = (cell["lru+waiting"]["hit_rate"] - cell["lru"]["hit_rate"]) / gap if gap > 1e-12 else None
            cells.append(cell)
    return {"page_size": ps, "prompt_tokens": prompt, "span_s": span, "requests": len(stream.tokens),
            "capacities": capacities, "utilisations": list(utilisations), "cells": cells}


def _waiting(cfg: HiCacheConfig, on: bool) -> HiCacheConfig:
    return cfg.model_copy(update={"policy": cfg.policy.model_copy(update={"protect_waiting": on})})


def format_queue_sweep(q: dict[str, Any], trace: str) -> str:
    lines = [f"waiting queue on {trace}: {q['requests']:,} requests over {q['span_s']:.0f} s, one FCFS prefill "
             "server; utilisation = LRU's recomputed tokens / (rate x span); TTFT = wait + prefill of the "
             "missed tokens (p50 / p90 s); L1+L2 (L1 = L2 / 8), write_through", ""]
    head = ["capacity", "util", "rate tok/s", *(f"{n} hit" for n in QUEUE_ROWS), *(f"{n} TTFT" for n in QUEUE_ROWS),
            "gap closed"]
    table = [head]
    for c in q["cells"]:
        g = c["gap_closed"]
        table.append([_tok(c["capacity_tokens"]), f"{c['utilisation']:.0%}", f"{c['rate_tokens_per_s']:,.0f}",
                      *(f"{c[n]['hit_rate']:.2%}" for n in QUEUE_ROWS),
                      *(f"{c[n]['ttft_p50_s']:.2f}/{c[n]['ttft_p90_s']:.2f}" for n in QUEUE_ROWS),
                      "-" if g is None else f"{g:+.0%}"])
    widths = [max(len(r[i]) for r in table) for i in range(len(head))]
    lines += ["  ".join(x.rjust(w) for x, w in zip(r, widths)) for r in table]
    return "\n".join(lines)
