"""``hicache replay [TRACE]``: what hicache buys on a trace.

Runs the trace through the reference model with the configured tiers
(default: embedded, file-backed L3), then replays the very same token streams
without computing (``Engine(model=None)``) under an L1-only radix cache and an
infinite cache, and prints one table. Optional JSON and PNG outputs.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import socket
import time
from typing import Any

import torch

from hicache.core.config import HiCacheConfig
from hicache.reference.engine import Engine, EngineRun, iter_progress
from hicache.reference.model_spec import ModelSpec
from hicache.reference.progress import logs_above_bars
from hicache.core.errors import ConfigError
from hicache.cache.hicache import HiCache
from hicache.core.redact import redact_url


SERVICE_SETTLE_S = 30.0  # how long replay --service waits for the service's L3 write-behind


def model_spec_for(cfg: HiCacheConfig, vocab: int) -> ModelSpec:
    """A small reference model whose KV pages match ``cfg.model`` (its model id
    carries a digest of the weights' spec, so L3 objects never mix models)."""
    return ModelSpec.for_layout(cfg.layout(), vocab=vocab, max_seq_len=16384)


def _resolver():
    def resolve(item, results) -> list[int] | None:
        parent = getattr(item, "parent", None)
        if not parent:
            return list(item.prompt)
        r = results.get(parent)
        if r is None:
            return None
        return list(r.full) + list(item.append)
    return resolve


def _summarise(name: str, run: EngineRun, hc: HiCache | None, prompt_total: int) -> dict[str, Any]:
    rs = list(run.results.values())
    d = sum(r.device_hit for r in rs)
    h = sum(r.host_hit for r in rs)
    s = sum(r.storage_hit for r in rs)
    out = {"name": name, "requests": len(rs), "prompt_tokens": prompt_total,
           "hit_tokens": d + h, "hit_rate": (d + h) / prompt_total if prompt_total else 0.0,
           "l1_hit_tokens": d, "l2_hit_tokens": h - s, "l3_hit_tokens": s,
           "recomputed_tokens": sum(r.computed for r in rs), "time_s": run.wall_s}
    if hc is not None:
        st = hc.cache.stats()
        out["exact_hit_tokens"] = st.device_hit_exact_tokens + st.host_hit_exact_tokens
        out["bytes_moved"] = dict(hc.transfers.bytes_moved)
        l3 = _l3_report(hc)
        if l3 is not None:
            # What the backend stored and returned, not what was handed to it:
            # writes to an unreachable L3 are dropped and must not count.
            out["bytes_moved"].update(l3_put=l3["bytes_written"], l3_get=l3["bytes_read"])
            out["l3"] = l3
    return out


def _l3_report(hc: HiCache) -> dict[str, Any] | None:
    """The L3 backend's own counters for this run (taken after the run drained)."""
    if hc.storage is None:
        return None
    st = hc.storage.stats()
    return {"pages_stored": st.put_ok, "pages_dropped": st.put_dropped, "bytes_written": st.bytes_written,
            "pages_read": st.hits, "bytes_read": st.bytes_read, "errors": st.errors,
            "reconnects": st.reconnects, "down_at_end": hc.storage.down}


def _service_l3(hc: HiCache) -> dict[str, int] | None:
    """Service mode: the service's L3 write-behind and fetch counters now, in pages
    (empty: the service has no L3; None: embedded, or the service is unreachable)."""
    sh = hc.shared
    if sh is None:
        return None
    st = sh.call(sh.client.stats)
    return None if st is None else dict(st["l3"])


def _segment_pages(hc: HiCache):
    """Service mode: a sampler of the pages the service's segment holds (every engine's
    committed pages; this process's private L2 is empty); None when embedded."""
    sh = hc.shared
    if sh is None:
        return None

    def committed() -> int:
        st = sh.call(sh.client.stats)
        return 0 if st is None else int(st["committed_pages"])
    return committed


def _settled(w: dict[str, int]) -> bool:
    return w.get("queued", 0) == w.get("written", 0) + w.get("stale", 0) + w.get("failed", 0)


def _service_l3_report(hc: HiCache, before: dict[str, int] | None, settle_s: float) -> dict[str, Any] | None:
    """What the service's L3 did during the run. The service writes committed pages
    behind, so first wait up to ``settle_s`` for its writer to settle what was
    queued. Counts every engine of the node, not only this one."""
    if before is None:
        return None
    deadline = time.monotonic() + settle_s
    while True:
        now = _service_l3(hc)
        if now is None:
            return None
        if _settled(now) or time.monotonic() >= deadline:
            break
        time.sleep(0.1)
    d = {k: now.get(k, 0) - before.get(k, 0) for k in ("written", "dropped", "failed", "fetched")}
    page_bytes = hc.layout.page_bytes
    return {"pages_stored": d["written"], "pages_dropped": d["dropped"] + d["failed"],
            "bytes_written": d["written"] * page_bytes, "pages_read": d["fetched"],
            "bytes_read": d["fetched"] * page_bytes, "errors": d["failed"], "reconnects": 0,
            "down_at_end": False, "service": True, "configured": bool(now),
            "write_behind_settled": _settled(now)}


def replay(cfg: HiCacheConfig, trace_path: str | None, *, progress: bool = True,
           baselines: bool = True, scale: str = "small", layout_model_id: str | None = None) -> dict[str, Any]:
    """``layout_model_id`` (default: the reference model's digest name) names
    the KV layout's model, e.g. the one a shared service was configured with."""
    from hicache.reference.model import ReferenceModel
    from hicache.reference.workloads import builtin_trace, read_trace

    trace = read_trace(trace_path) if trace_path else builtin_trace(scale=scale)
    if not torch.cuda.is_available():
        # The reference model's page-sized tiles are far too small to split
        # across threads (on a busy box OpenMP spinning made them ~100x slower),
        # and one thread keeps its exact mode reproducible.
        torch.set_num_threads(1)
    items = sorted(trace.requests, key=lambda r: r.arrival)
    spec = model_spec_for(cfg, trace.vocab)
    layout = spec.kv_layout(cfg.model.page_size, cfg.model.host_layout, model_id=layout_model_id)
    # On CPU the copies run inline (complete at submit, observed in poll/drain as on a
    # GPU): the schedule then does not depend on how fast copy threads run on the box.
    hc = HiCache(cfg, layout=layout, inline_transfers=_cpu(cfg.pool.device))
    model = ReferenceModel(spec, device=hc.device_pool.device)
    l3_before = _service_l3(hc)
    try:
        run = _run(hc, model, items, progress)
    except BaseException:
        hc.close()
        raise
    prompt_total = sum(r.prompt_tokens for r in run.results.values())
    rows = [_summarise("hicache (L1+L2+L3)", run, hc, prompt_total)]
    l3 = _service_l3_report(hc, l3_before, settle_s=SERVICE_SETTLE_S)
    if l3 is not None:  # the service's L3 traffic, in place of this process's (it has no L3 client)
        rows[0]["bytes_moved"].update(l3_put=l3["bytes_written"], l3_get=l3["bytes_read"])
        rows[0]["l3"] = l3
    series = [dataclasses.asdict(s) for s in run.samples]
    stats = hc.stats().as_dict()
    shared_l2 = hc.shared is not None
    hc.close()
    if baselines:
        forced = {rid: r.output for rid, r in run.results.items()}
        l1 = cfg.model_copy(update={"storage": cfg.storage.model_copy(update={"url": ""}),
                                    "policy": cfg.policy.model_copy(update={
                                        "write_policy": "write_through_selective",
                                        "write_through_threshold": 1 << 30}),
                                    "pool": cfg.pool.model_copy(update={"host_pages": 1})})
        rows.append(_null_run("L1-only radix cache", l1, layout, items, forced, prompt_total))
        oracle, earlier = _oracle(run, cfg.model.page_size, prompt_total)
        rows.append(oracle)
        rows[0]["earlier_runs_hit_tokens"] = sum(earlier.values())
        rows[0]["earlier_runs_hit_tokens_by_tier"] = earlier
        rows.append({"name": "no cache", "requests": len(items), "prompt_tokens": prompt_total,
                     "hit_tokens": 0, "hit_rate": 0.0, "l1_hit_tokens": 0, "l2_hit_tokens": 0,
                     "l3_hit_tokens": 0, "recomputed_tokens": prompt_total, "time_s": None})
    return {"trace": trace.name, "config": {"L1_pages": cfg.pool.device_pages,
                                            "L2_pages": stats["capacity_pages"]["L2"], "L2_shared": shared_l2,
                                            "L3": redact_url(cfg.storage.url) or "(none)",
                                            "page_size": cfg.model.page_size},
            "rows": rows, "series": series, "stats": stats}


def _run(hc: HiCache, model, items: list, progress: bool) -> EngineRun:
    """The reference engine over ``items``, a bar per request finished; a warning
    prints above the bar, never through it."""
    bar = iter_progress(len(items), progress)
    try:
        with logs_above_bars():
            return Engine(hc, model, drain_each_step=True).run(items, _resolver(), on_finish=lambda r: bar.update(1),
                                                               l2_used=_segment_pages(hc))
    finally:
        bar.close()


def _cpu(device: str) -> bool:
    """``pool.device`` resolves to the CPU ("auto" without CUDA)."""
    return device == "cpu" or (device == "auto" and not torch.cuda.is_available())


def _oracle(run: EngineRun, page_size: int, prompt_total: int) -> tuple[dict[str, Any], int]:
    """Infinite cache: in admission order, each request hits every whole page
    that any earlier-admitted request ever held (prompt and output), under the
    same rules (whole pages, at most all but the last token). No schedule can
    beat it within this run: a page is only reusable once an earlier request
    computed it. It starts empty, so a persistent L3 filled by earlier runs can
    beat it; returns ``(row, tokens hicache hit beyond it, per tier that served them)``,
    which are exactly the hits on pages no earlier request of this run held."""
    from hicache.core.hashing import page_hashes
    seen: set[bytes] = set()
    hit = 0
    earlier = {"L1": 0, "L2": 0, "L3": 0}
    for r in sorted(run.results.values(), key=lambda r: r.admitted):
        prompt = r.full[:r.prompt_tokens]
        hashes = page_hashes(prompt[:max(0, len(prompt) - 1)], page_size, r.namespace)
        n = 0
        while n < len(hashes) and hashes[n] in seen:
            n += 1
        hit += n * page_size
        for tier, tokens in _beyond(r, r.device_hit + r.host_hit - n * page_size).items():
            earlier[tier] += tokens
        seen.update(page_hashes(r.full, page_size, r.namespace))
    return {"name": "infinite cache (oracle)", "requests": len(run.results), "prompt_tokens": prompt_total,
            "hit_tokens": hit, "hit_rate": hit / prompt_total if prompt_total else 0.0,
            "l1_hit_tokens": hit, "l2_hit_tokens": 0, "l3_hit_tokens": 0,
            "recomputed_tokens": prompt_total - hit, "time_s": None}, earlier


def _beyond(r, extra: int) -> dict[str, int]:
    """The last ``extra`` tokens of ``r``'s hit, by the tier that served them. A hit runs
    L1, then L2 continuing it, then L3 continuing that, so its tail is L3's part first."""
    extra = max(0, extra)
    l3 = min(extra, r.storage_hit)
    l2 = min(extra - l3, r.host_hit - r.storage_hit)
    return {"L1": extra - l3 - l2, "L2": l2, "L3": l3}


def _null_run(name: str, cfg: HiCacheConfig, layout, items, forced, prompt_total: int) -> dict[str, Any]:
    hc = HiCache(cfg, layout=layout)
    try:
        run = Engine(hc, None, drain_each_step=True).run(items, _resolver(), forced_outputs=forced)
        return _summarise(name, run, hc, prompt_total)
    finally:
        hc.close()


def format_table(report: dict[str, Any]) -> str:
    cols = [("name", "run", "{}"), ("hit_rate", "hit rate", "{:.1%}"), ("l1_hit_tokens", "L1 hit", "{:,}"),
            ("l2_hit_tokens", "L2 hit", "{:,}"), ("l3_hit_tokens", "L3 hit", "{:,}"),
            ("recomputed_tokens", "recomputed", "{:,}"), ("time_s", "time", "{:.1f}s")]
    table = [[h for _, h, _ in cols]]
    for r in report["rows"]:
        table.append(["-" if r.get(k) is None else f.format(r[k]) for k, _, f in cols])
    widths = [max(len(row[i]) for row in table) for i in range(len(cols))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))
             for row in table]
    lines.insert(1, "  ".join("-" * w for w in widths))
    first = report["rows"][0]
    head = (f"trace {report['trace']}: {first['requests']} requests, {first['prompt_tokens']:,} prompt tokens; "
            f"L1 {report['config']['L1_pages']} pages, L2 {report['config']['L2_pages']} pages"
            f"{' (the service segment, shared)' if report['config'].get('L2_shared') else ''}, "
            f"L3 {report['config']['L3']}")
    moved = first.get("bytes_moved", {})
    tail = ["bytes moved: " + ", ".join(f"{k} {v / 2**20:.1f} MiB" for k, v in moved.items())]
    l3 = first.get("l3")
    if l3 and l3.get("service"):
        tail.append("l3_put / l3_get: the service's L3 during this run (it writes committed pages behind; "
                    "every engine of the node counts)" if l3["configured"] else "the service has no L3")
        if not l3["write_behind_settled"]:
            tail.append(f"the service was still writing pages to L3 after {SERVICE_SETTLE_S:.0f}s; "
                        "l3_put counts what it had stored then")
    if l3 and (l3["pages_dropped"] or l3["down_at_end"] or l3["reconnects"]):
        state = "was down at the end of the run" if l3["down_at_end"] else "was down during the run"
        tail.append(f"L3 {state}: {l3['pages_dropped']:,} pages not stored ({l3['pages_stored']:,} stored), "
                    f"{l3['errors']:,} errors; l3_put counts only bytes L3 stored")
    oracle = next((r for r in report["rows"] if r["name"].startswith("infinite")), None)
    if oracle and oracle["hit_rate"]:
        pct = f"{first['hit_rate'] / oracle['hit_rate']:.1%}"
        earlier = first.get("earlier_runs_hit_tokens", 0)
        if earlier:
            shared = report["config"].get("L2_shared")
            tail.append(f"hicache reaches {pct} of this run's infinite-cache hit rate; the oracle starts empty, "
                        f"while {_served(first, shared)} tokens of pages that earlier runs stored "
                        + ("(a fresh hicache serve on an empty L3 compares like with like)" if shared else
                           "(an empty L3, e.g. --set storage.url=memory://, compares like with like)"))
        else:
            tail.append(f"hicache reaches {pct} of the infinite-cache hit rate")
    return "\n".join([head, *lines, *tail])


def _served(row: dict[str, Any], shared: bool) -> str:
    """``L3 served N`` / ``the shared L2 served A and L3 B``: each tier that served earlier runs' pages."""
    by = row.get("earlier_runs_hit_tokens_by_tier") or {"L3": row["earlier_runs_hit_tokens"]}
    names = {"L1": "L1", "L2": "the shared L2" if shared else "L2", "L3": "L3"}
    parts = [(names[t], by[t]) for t in ("L1", "L2", "L3") if by.get(t)]
    first, *rest = parts
    return f"{first[0]} served {first[1]:,}" + "".join(f" and {n} {v:,}" for n, v in rest)


def plot(report: dict[str, Any], path: str) -> None:
    """Hit rates and tier occupancy against requests admitted (so two runs compare)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    s = report["series"]
    x = [p["admitted"] for p in s]
    fig, (a, b) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    a.plot(x, [p["hit_rate"] for p in s], label="hicache: cumulative hit rate (scheduler-visible)")
    a.plot(x, [p["l3_hit_tokens"] / p["prompt_tokens"] if p["prompt_tokens"] else 0.0 for p in s],
           label="of which served from L3", color="C4")
    for r in report["rows"][1:3]:
        a.axhline(r["hit_rate"], linestyle="--", linewidth=1, label=f"{r['name']} (final)",
                  color="gray" if r["name"].startswith("L1") else "green")
    a.set_ylabel("hit rate (of prompt tokens)")
    a.set_ylim(0, 1)
    a.legend(loc="lower right", fontsize=8)
    b.plot(x, [p["l1_used"] for p in s], label="L1 pages used", color="C0")
    shared = report["config"].get("L2_shared")
    b.plot(x, [p["l2_used"] for p in s], color="C1",
           label="L2 pages cached: the service's shared segment (every engine)" if shared else "L2 pages cached")
    b.axhline(report["config"]["L1_pages"], color="C0", linestyle=":", linewidth=1,
              label=f"L1 capacity ({report['config']['L1_pages']:,} pages)")
    b.axhline(report["config"]["L2_pages"], color="C1", linestyle=":", linewidth=1,
              label=f"L2 capacity ({report['config']['L2_pages']:,} pages)")
    b.set_yscale("symlog", linthresh=max(1, report["config"]["L1_pages"]))
    b.set_ylabel("pages")
    b.set_xlabel("requests admitted")
    b.legend(loc="upper left", fontsize=8)
    fig.suptitle(f"hicache replay: {report['trace']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def service_config(cfg: HiCacheConfig, socket_path: str) -> HiCacheConfig:
    """``cfg`` with the service at ``socket_path`` as L3. Raises ``ConfigError``."""
    if not os.path.isabs(socket_path):
        raise ConfigError(f"--service {socket_path!r}: give the absolute path of the service's engine socket "
                          "(its service.socket_path)")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:  # one short sentence, before the cache is built
        s.settimeout(5.0)
        try:
            s.connect(socket_path)
        except OSError as e:
            raise ConfigError(f"--service {socket_path}: no hicache service listens there ({e.strerror or e}); "
                              "start `hicache serve` first") from None
    return cfg.model_copy(update={"storage": cfg.storage.model_copy(
        update={"url": f"hicache+unix://{socket_path}"})})


def main(args: argparse.Namespace, cfg: HiCacheConfig) -> int:
    t0 = args.started  # the process's start when run as the `hicache` command (hicache.cli.main)
    setup_s = time.perf_counter() - t0
    model_id = None
    if args.service:
        # Engines and the service agree on one configured layout; the handshake
        # refuses (naming the fields) anything else.
        cfg, model_id = service_config(cfg, args.service), cfg.model.model_id
    report = replay(cfg, args.trace, progress=not args.quiet,
                    baselines=not args.no_baselines, scale=args.scale, layout_model_id=model_id)
    print(format_table(report))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2, default=str)
        print(f"report: {args.json}")
    if args.plot:
        plot(report, args.plot)
        print(f"plot: {args.plot}")
    print(f"done in {time.perf_counter() - t0:.1f}s ({setup_s:.1f}s of it start-up: Python, imports, configuration)")
    return 0
