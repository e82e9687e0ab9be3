"""``hicache replay --simulate``: the runs, the table, the sweep and its plot, and
the offline baselines over the same page stream (``infinite``, ``belady``; see
``page_stream``)."""
from __future__ import annotations

import argparse
import itertools
import json
import os
import time
from typing import Any, Callable, Iterator


from hicache.core.config import HiCacheConfig
from hicache.core.errors import ConfigError
from hicache.index.eviction import POLICIES
from hicache.index.misses import REASONS
from hicache.reference.progress import logs_above_bars, point_text, Progress
from hicache.reference import sim_policies as sp
from hicache.reference.sim_policies import PageStream, belady, infinite, page_stream
from hicache.reference.simulate import run_hicache, sim_config, SimPlan, SimRequest, trace_requests


Factory = Callable[[], Iterator[SimRequest]]
SWEEP_FRACTIONS = (1 / 64, 1 / 32, 1 / 16, 1 / 8, 1 / 4, 1 / 2, 1.0)  # of the working set's bytes, per tier


def _limited(factory: Factory, limit: int | None) -> Factory:
    return factory if limit is None else (lambda: itertools.islice(factory(), limit))


def _offline_row(name: str, hit: int, stream: PageStream, plan: SimPlan) -> dict[str, Any]:
    prompt = sum(stream.tokens)
    return {"name": name, "requests": len(stream.tokens), "prompt_tokens": prompt, "hit_tokens": hit,
            "hit_rate": hit / prompt if prompt else 0.0, "l1_hit_tokens": None, "l2_hit_tokens": None,
            "l3_hit_tokens": None, "recomputed_tokens": prompt - hit, "time_s": None}


def tiers_label(plan: SimPlan, *, l2: bool = True, l3: bool = True) -> str:
    """The tiers a run really has: "L1", "L1+L2", "L1+L2+L3"; a run with L3 but no L2
    stages through a 1-page L2 and says so."""
    has_l2, has_l3 = l2 and plan.l2_pages > 0, l3 and plan.l3_pages > 0 and bool(plan.l3_url)
    if has_l3 and not has_l2:
        return "L1+L3 (through a 1-page L2)"
    return "+".join(t for t, on in (("L1", True), ("L2", has_l2), ("L3", has_l3)) if on)


def distinct_capacity(l1_pages: int, l2_pages: int, write_policy: str) -> tuple[int, str]:
    """Distinct pages L1 and L2 can hold together, and the rule that gave it. Under
    ``write_through`` every page inserted on L1 is backed up to L2 at once, so L2 holds a
    copy of what L1 holds (inclusive): ``max(L1, L2)``. Under ``write_back`` and
    ``write_through_selective`` a page may live on one tier only (exclusive): ``L1 + L2``."""
    if l2_pages <= 0:
        return l1_pages, "L1"
    if write_policy == "write_through":
        return max(l1_pages, l2_pages), "max(L1, L2): inclusive (write_through)"
    return l1_pages + l2_pages, f"L1 + L2: exclusive ({write_policy})"


def simulate(cfg: HiCacheConfig, factory: Factory, *, policies: list[str] | None = None,
             baselines: bool = True, plan: SimPlan | None = None, progress: Progress | None = None) -> dict[str, Any]:
    """Every row of the simulation report (see ``hicache.reference.simulate``); ``progress``
    draws a bar per run (default: none)."""
    plan = plan or SimPlan.from_config(cfg.simulate)
    ps = plan.page_size
    default = cfg.policy.device_eviction
    feed = _feeder(factory, progress)
    label = tiers_label(plan)
    first = f"hicache {label} ({default})"
    rows = [run_hicache(first, sim_config(cfg, plan, backup=label != "L1"), plan if label != "L1" else _no_l2(plan),
                        feed(first))]
    stream = page_stream(feed("page stream (baselines)"), ps)
    if baselines:
        gpu = "GPU-only prefix cache (L1, lru)"
        rows.append(run_hicache(gpu, sim_config(cfg, plan, eviction="lru", l3=False, backup=False), _no_l2(plan),
                                feed(gpu)))
        if plan.l2_pages:
            for p in policies if policies is not None else [default]:
                if label == "L1+L2" and p == default == cfg.policy.host_eviction:
                    continue  # the first row is this very run (no L3 to tell them apart)
                rows.append(run_hicache(f"hicache L1+L2 ({p})", sim_config(cfg, plan, eviction=p, l3=False),
                                        plan, feed(f"hicache L1+L2 ({p})")))
        cap, rule = distinct_capacity(plan.l1_pages, plan.l2_pages, cfg.policy.write_policy.value)
        rows.append(_offline_row(f"Belady MIN ({cap:,} pages = {rule})", belady(stream, ps, cap), stream, plan))
        rows.append(_offline_row("infinite cache", infinite(stream, ps), stream, plan))
    return {"config": _plan_dict(plan), "working_set_pages": stream.unique_pages,
            "working_set_bytes": stream.unique_pages * plan.page_bytes, "rows": rows}


def _feeder(factory: Factory, progress: Progress | None) -> Callable[[str], Iterator[SimRequest]]:
    """A fresh request stream per run, drawn as a bar named after the run."""
    if progress is None:
        return lambda name: factory()
    return lambda name: progress.wrap(factory(), name)


def runs_ahead(policies: list[str] | None, baselines: bool) -> int:
    """Passes over the trace ``simulate`` makes: hicache, the page stream, and the baselines' runs."""
    return 2 + (1 + len(policies if policies is not None else [None]) if baselines else 0)


def _no_l2(plan: SimPlan) -> SimPlan:
    return SimPlan(plan.shape, plan.page_size, plan.l1_pages, 0, 0, "")


def _plan_dict(plan: SimPlan) -> dict[str, Any]:
    pb = plan.page_bytes
    return {"shape": plan.shape.name, "page_size": plan.page_size, "page_bytes": pb,
            "L1_pages": plan.l1_pages, "L2_pages": plan.l2_pages, "L3_pages": plan.l3_pages,
            "L1_bytes": plan.l1_pages * pb, "L2_bytes": plan.l2_pages * pb, "L3_bytes": plan.l3_pages * pb,
            "L3": plan.l3_url or "(none)"}


def human_bytes(n: float) -> str:
    for unit, size in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n:.0f} B"


NARROW_NAME = 32  # a run name longer than this is cut at its " (" in the narrow table, and given in full below it
WIDE_ONLY = ("l2_hit_bytes", "l2_used_bytes", "l3_stored_bytes")  # columns only --wide shows


def format_report(rep: dict[str, Any], trace: str, wide: bool = False) -> str:
    """The simulation report; narrow (under 100 columns) unless ``wide``, which adds the
    L2 read, L2 used and L3 stored columns and keeps every run's name whole in its row."""
    c = rep["config"]
    first = rep["rows"][0]
    cols = [("name", "run", "{}"), ("hit_rate", "hit rate", "{:.1%}"), ("l1_hit_tokens", "L1 hit tok", "{:,}"),
            ("l2_hit_tokens", "L2 hit tok", "{:,}"), ("l3_hit_tokens", "L3 hit tok", "{:,}"),
            ("l2_hit_bytes", "L2 read", "B"), ("l3_hit_bytes", "L3 read", "B"),
            ("l2_used_bytes", "L2 used", "B"), ("l3_stored_bytes", "L3 stored", "B"), ("time_s", "time", "{:.1f}s")]
    cols = [col for col in cols if wide or col[0] not in WIDE_ONLY]
    table = [[h for _, h, _ in cols]]
    notes = []
    for r in rep["rows"]:
        name = r["name"]
        if not wide and len(name) > NARROW_NAME and " (" in name:
            name, rest = name.split(" (", 1)
            notes.append(f"  {name}: ({rest}")
        table.append([name] + ["-" if r.get(k) is None else human_bytes(r[k]) if f == "B" else f.format(r[k])
                               for k, _, f in cols[1:]])
    widths = [max(len(row[i]) for row in table) for i in range(len(cols))]
    lines = ["  ".join(x.ljust(w) if i == 0 else x.rjust(w) for i, (x, w) in enumerate(zip(row, widths)))
             for row in table]
    lines.insert(1, "  ".join("-" * w for w in widths))
    lines += notes
    head = [f"simulated replay of {trace}: {first['requests']:,} requests over {first['duration_s']:.0f} s of "
            f"arrivals, {first['prompt_tokens']:,} prompt tokens",
            f"working set {rep['working_set_pages']:,} pages ({human_bytes(rep['working_set_bytes'])})",
            f"shape {c['shape']}, page {c['page_size']} tokens = {human_bytes(c['page_bytes'])}",
            f"L1 {human_bytes(c['L1_bytes'])} ({c['L1_pages']:,} pages), L2 {human_bytes(c['L2_bytes'])} "
            f"({c['L2_pages']:,} pages), L3 {c['L3']} {human_bytes(c['L3_bytes'])} ({c['L3_pages']:,} pages)",
            "bytes accounted, not moved: each page carried a stand-in payload counted at the shape's page size"]
    tail = []
    inf = next((r for r in rep["rows"] if r["name"] == "infinite cache"), None)
    if inf and inf["hit_rate"]:
        tail.append(f"{first['name']} reaches {first['hit_rate'] / inf['hit_rate']:.1%} of the infinite cache")
    m = first["misses"]
    total = sum(m[k] for k in REASONS)
    tail.append(f"missed pages of {first['name']}: {total:,} = " + ", ".join(
        f"{k} {m[k]:,}" for k in REASONS if m[k]) + (f" (tracker forgot {m['forgotten']:,})"
                                                     if m["forgotten"] else ""))
    per = first["time_s"] / max(1, first["requests"]) * 1e3
    parts = first["time_parts_s"]
    spent = sum(parts.values()) or 1.0
    tail.append(f"{first['name']}: {per:.2f} ms a request;\n  " + ", ".join(
        f"{k} {v / spent:.0%}" for k, v in parts.items()))
    return "\n".join([*head, *lines, *tail])


# ----------------------------------------------------------------- the sweep
def sweep(cfg: HiCacheConfig, factory: Factory, fractions=SWEEP_FRACTIONS,
          progress: Progress | None = None) -> dict[str, Any]:
    """Hit rate against each tier's capacity (the tiers above it at their configured
    size, the tiers below it absent), at ``fractions`` of the working set; L2 and L3
    points no larger than the tier above are skipped (they hold copies of it).
    ``progress``: a note of the points ahead, and a bar per point."""
    s = cfg.simulate
    base = SimPlan.from_config(s)
    feed = _feeder(factory, progress)
    stream = page_stream(feed("page stream (working set)"), base.page_size)
    ws = stream.unique_pages * base.page_bytes
    prompt = sum(stream.tokens)
    points = []
    todo = sweep_points(base, stream, fractions)
    if progress is not None:
        n = f"{progress.total:,}" if progress.total is not None else "all the"
        progress.note(f"sweep: {len(todo)} capacity points, each a whole replay of {n} requests; --limit N "
                      "replays only the first N")
    t0 = time.perf_counter()
    for k, (tier, f, b) in enumerate(todo):
        if progress is not None:
            progress.note(f"sweep {point_text(k + 1, len(todo), time.perf_counter() - t0, k)}: {tier} "
                          f"{human_bytes(b)}")
        plan, c = _point(cfg, tier, b)
        row = run_hicache(f"{tier} {human_bytes(b)}", c, plan if tier != "L1" else _no_l2(plan),
                          feed(f"{tier} {human_bytes(b)}"))
        points.append({"tier": tier, "bytes": b, "fraction": f, "hit_rate": row["hit_rate"],
                       "time_s": row["time_s"]})
    return {"working_set_bytes": ws, "infinite_hit_rate": infinite(stream, base.page_size) / prompt,
            "config": _plan_dict(base), "points": points}


def sweep_points(base: SimPlan, stream: PageStream, fractions) -> list[tuple[str, float, int]]:
    """(tier, fraction, bytes) of each sweep point that can run: L2 and L3 points no larger
    than the tier above are skipped (they hold copies of it), and L1 points below the
    largest request (it could not be served) are lifted to it, once. ``ConfigError``
    when the configured L1 cannot hold the largest request (every L2 and L3 point needs it)."""
    pb = base.page_bytes
    largest = max((-(-n // base.page_size) for n in stream.tokens), default=1)  # L1 pages one request needs
    if base.l1_pages < largest:
        raise ConfigError(f"simulate.l1_bytes={base.l1_pages * pb:,} holds {base.l1_pages} pages; the largest "
                          f"request needs {largest} pages ({largest * pb:,} bytes): raise simulate.l1_bytes")
    ws = stream.unique_pages * pb
    above = {"L1": 0, "L2": base.l1_pages * pb, "L3": base.l2_pages * pb}
    todo = [(tier, f, max(pb, int(ws * f))) for tier in ("L1", "L2", "L3") for f in fractions]
    todo = [(t, f, max(b, largest * pb) if t == "L1" else b) for t, f, b in todo]
    seen: set[tuple[str, int]] = set()
    out = []
    for t, f, b in todo:
        if b > above[t] and (t, b) not in seen:
            seen.add((t, b))
            out.append((t, f if b == max(pb, int(ws * f)) else b / ws, b))
    return out


def _point(cfg: HiCacheConfig, tier: str, b: int) -> tuple[SimPlan, HiCacheConfig]:
    """One sweep point: ``tier`` at ``b`` bytes, the tiers above at their configured size, those below absent."""
    s = cfg.simulate
    if tier == "L1":
        plan = SimPlan.from_config(s, l1_bytes=b, l2_bytes=0, l3_bytes=0)
        return plan, sim_config(cfg, plan, l3=False, backup=False)
    if tier == "L2":
        plan = SimPlan.from_config(s, l2_bytes=b, l3_bytes=0)
        return plan, sim_config(cfg, plan, l3=False)
    plan = SimPlan.from_config(s, l3_bytes=b)
    return plan, sim_config(cfg, plan)


def format_sweep(sw: dict[str, Any]) -> str:
    lines = [f"hit rate against capacity (working set {human_bytes(sw['working_set_bytes'])}, infinite cache "
             f"{sw['infinite_hit_rate']:.1%}); each tier varied with the tiers above at "
             f"L1 {human_bytes(sw['config']['L1_bytes'])}, L2 {human_bytes(sw['config']['L2_bytes'])} "
             "and the tiers below absent",
             f"{'tier':<5} {'capacity':>10} {'of working set':>15} {'hit rate':>9}"]
    for p in sw["points"]:
        lines.append(f"{p['tier']:<5} {human_bytes(p['bytes']):>10} {p['fraction']:>15.1%} {p['hit_rate']:>9.1%}")
    return "\n".join(lines)


SWEEP_STYLE = {  # tier -> (label, colour, marker, size, line): hollow big L1 under filled small L2
    "L1": ("L1 alone (GPU-only prefix cache)", "C0", "o", 11, "-"),
    "L2": ("L2, with the configured L1", "C1", "s", 6, "--"),
    "L3": ("L3, with the configured L1 and L2", "C3", "^", 7, ":"),
}


def plot_sweep(sw: dict[str, Any], path: str, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker
    fig, ax = plt.subplots(figsize=(8, 5.4))
    ticks: set[int] = set()
    for tier, (label, colour, marker, size, line) in SWEEP_STYLE.items():
        pts = [p for p in sw["points"] if p["tier"] == tier]
        if not pts:
            continue
        ticks.update(p["bytes"] for p in pts)
        hollow = tier == "L1"
        ax.plot([p["bytes"] for p in pts], [p["hit_rate"] for p in pts], marker=marker, markersize=size,
                color=colour, linestyle=line, linewidth=4 if hollow else 1.6, alpha=0.55 if hollow else 1.0,
                label=f"{label} ({len(pts)} points)", markerfacecolor="none" if hollow else colour,
                markeredgewidth=2 if hollow else 1, zorder=2 if hollow else 3)  # L2 drawn over a wide L1
    ax.axvline(sw["working_set_bytes"], color="gray", linestyle="--",
               label=f"working set ({human_bytes(sw['working_set_bytes'])})")
    ax.axhline(sw["infinite_hit_rate"], color="black", linestyle="-.", linewidth=1,
               label=f"infinite cache ({sw['infinite_hit_rate']:.1%})")
    ax.set_xscale("log")
    ticks.add(sw["working_set_bytes"])
    ax.set_xticks(sorted(ticks), [human_bytes(t) for t in sorted(ticks)], rotation=30, fontsize=8)
    ax.minorticks_off()
    ax.set_xlabel("tier capacity (bytes of KV of the model shape)")
    ax.set_ylabel("hit rate (of prompt tokens)")
    top = min(1.0, max(0.1, 1.15 * max([sw["infinite_hit_rate"], *(p["hit_rate"] for p in sw["points"])])))
    ax.set_ylim(0, top)
    ax.yaxis.set_major_locator(matplotlib.ticker.MaxNLocator(10))
    ax.yaxis.set_major_formatter(matplotlib.ticker.PercentFormatter(1.0))
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left", fontsize=8)
    ax.set_title(title, fontsize=11)
    fig.text(0.5, 0.01, sweep_caption(sw), ha="center", fontsize=8)
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def sweep_caption(sw: dict[str, Any]) -> str:
    """One line on what the curve's shape means for sizing."""
    ws, inf = sw["working_set_bytes"], sw["infinite_hit_rate"]
    near = sorted(p["bytes"] for p in sw["points"] if p["hit_rate"] >= 0.95 * inf)
    if near:
        return (f"Hit rate grows with capacity until about {human_bytes(near[0])} (95% of the infinite cache); "
                f"past that, more capacity buys little (working set {human_bytes(ws)}).")
    return f"No point reaches 95% of the infinite cache: every tier below the working set ({human_bytes(ws)}) misses."


# ------------------------------------------------------------------ command
def _policies(args: argparse.Namespace, cfg: HiCacheConfig, factory: Factory, name: str) -> dict[str, Any]:
    """``--policies``: the policy sweep (``hicache.reference.sim_policies``), printed and plotted."""
    pol = sorted(POLICIES) if args.policies == "all" else args.policies.split(",")
    unknown = [p for p in pol if p not in POLICIES]
    if unknown:
        raise ConfigError(f"--policies {','.join(unknown)}: unknown; known: {', '.join(sorted(POLICIES))}")
    pol = pol if "lru" in pol else ["lru", *pol]  # the reference every gap is measured from
    out = sp.policy_sweep(cfg, factory, pol, sp.parse_capacities(args.capacities or sp.DEFAULT_CAPACITIES))
    print(sp.format_policy_sweep(out, name))
    if args.plot:
        sp.plot_policy_sweep(out, args.plot, f"eviction policies: {short_name(name)}")
        print(f"plot: {args.plot}")
    return out


def _queue(args: argparse.Namespace, cfg: HiCacheConfig, factory: Factory, name: str) -> dict[str, Any]:
    """``--utilisation``: the waiting-queue replay (``sim_policies.queue_sweep``), printed."""
    try:
        utils = [float(u) for u in args.utilisation.split(",")]
    except ValueError:
        raise ConfigError(f"--utilisation {args.utilisation!r}: want fractions like 0.5,0.8,0.95") from None
    bad = [u for u in utils if not 0 < u < 1]
    if bad:
        raise ConfigError(f"--utilisation {bad}: each must be in (0, 1): at 1 or more the queue grows without end")
    out = sp.queue_sweep(cfg, factory, sp.parse_capacities(args.capacities or sp.QUEUE_CAPACITIES), utils)
    print(sp.format_queue_sweep(out, name))
    return out


def short_name(trace: str) -> str:
    """A plot title's name for a trace path: the file name without its extension."""
    return os.path.splitext(os.path.basename(trace))[0] or trace


def main(args: argparse.Namespace, cfg: HiCacheConfig) -> int:
    t0 = time.perf_counter()
    if args.shape:
        cfg = cfg.model_copy(update={"simulate": cfg.simulate.model_copy(update={"shape": args.shape})})
    if args.block_tokens:
        cfg = cfg.model_copy(update={"simulate": cfg.simulate.model_copy(
            update={"block_tokens": args.block_tokens})})
    factory = _limited(trace_requests(args.trace, cfg.simulate, args.scale), args.limit)
    name = args.trace or f"built-in mixed trace ({args.scale})"
    progress = Progress(not args.quiet, count_requests(args.trace, factory, args.limit))
    with logs_above_bars():
        if args.sweep:
            sw = sweep(cfg, factory, progress=progress)
            print(format_sweep(sw))
            out: dict[str, Any] = {"sweep": sw}
            png = args.plot or "hicache-sweep.png"
            plot_sweep(sw, png, f"{short_name(name)}, {sw['config']['shape']}")
            print(f"plot: {png}")
        elif args.policies:
            out = _policies(args, cfg, factory, name)
        elif getattr(args, "utilisation", None):
            out = _queue(args, cfg, factory, name)
        else:
            progress.note(f"simulating {name}: {runs_ahead(None, not args.no_baselines)} passes over "
                          f"{progress.total:,} requests" + ("" if args.limit else "; --limit N replays only "
                                                            "the first N (a first look)"))
            out = simulate(cfg, factory, policies=None, baselines=not args.no_baselines, progress=progress)
            print(format_report(out, name, wide=args.wide))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2, default=str)
        print(f"report: {args.json}")
    print(f"done in {time.perf_counter() - t0:.1f}s")
    return 0


def count_requests(trace: str | None, factory: Factory, limit: int | None) -> int:
    """Requests one pass reads: a hash-block trace's non-blank lines (counted without
    parsing them), else the stream's length; at most ``limit``."""
    from hicache.reference.hash_trace import detect_format
    if trace is not None and detect_format(trace) == "hash_blocks":
        with open(trace, "rb") as f:
            n = sum(1 for line in f if line.strip())
    else:
        n = sum(1 for _ in factory())
    return n if limit is None else min(n, limit)
