"""Eviction policies on every trace: the tables and the figure of bench/RESULTS.md (issue 35).

    python bench/eviction_tables.py --run DIR [TRACE...]   # replay each trace (long: minutes per trace)
    python bench/eviction_tables.py DIR [--plot docs/eviction_policies.png]   # tables from DIR/*.json

``--run`` writes the generated workloads into DIR (hicache.reference.workloads) and
runs ``hicache replay TRACE --simulate --policies all --json DIR/NAME.json`` for them and
for the TRACEs given; without it, the JSON reports in DIR become one markdown table per
trace and mode (hit rate of each policy at each capacity, Belady, and the best online
policy's margin over LRU), and a figure of every policy's margin over LRU.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys

ORDER = ["lru", "ghost_lru", "qd_lru", "slru", "s3fifo", "lfu", "fifo", "mru"]


def run(outdir: str, traces: list[str]) -> None:
    subprocess.run([sys.executable, "-m", "hicache.reference.workloads", outdir], check=True)
    for t in [*sorted(glob.glob(os.path.join(outdir, "*.jsonl"))), *traces]:
        name = os.path.splitext(os.path.basename(t))[0]
        print(f"== {name}", flush=True)
        subprocess.run([sys.executable, "-m", "hicache.cli", "replay", t, "--simulate", "--policies", "all",
                        "--json", os.path.join(outdir, f"{name}.json")], check=True)


def tok(n: int) -> str:
    return f"{n / 1e6:g}M" if n >= 1e6 else f"{n / 1e3:g}K"


def table(name: str, rep: dict, mode: str) -> list[str]:
    pols = [p for p in ORDER if p in rep["policies"]] + [p for p in rep["policies"] if p not in ORDER]
    lines = [f"**{name}, {mode}** (default {rep['default']}; working set {rep['working_set_pages']:,} pages of "
             f"{rep['page_size']} tokens; infinite cache {rep['infinite_hit_rate']:.1%})", "",
             "| capacity | " + " | ".join(pols) + " | Belady | LRU->Belady gap | best online - lru |",
             "|---|" + "---:|" * (len(pols) + 3)]
    for c in rep["capacities"]:
        rows = {r["policy"]: r for r in rep["runs"] if r["mode"] == mode and r["capacity_tokens"] == c}
        lru = rows["lru"]["hit_rate"]
        best = max(pols, key=lambda p: rows[p]["hit_tokens"])
        cells = [f"**{rows[p]['hit_rate']:.2%}**" if p == best else f"{rows[p]['hit_rate']:.2%}" for p in pols]
        gap = rep["belady"][str(c)] if str(c) in rep["belady"] else rep["belady"][c]
        held = max(max(r["l1_pages"], r["l2_pages"]) for r in rows.values()) * rep["page_size"]
        label = tok(c) if held <= c else f"{tok(c)} (lifted to {tok(held)})"
        lines.append(f"| {label} | " + " | ".join(cells) + f" | {gap:.2%} | {100 * (gap - lru):.2f} pt | "
                     f"{best} {100 * (rows[best]['hit_rate'] - lru):+.2f} pt |")
    return lines


def plot(reports: dict[str, dict], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    names = list(reports)
    fig, axes = plt.subplots(2, len(names), figsize=(3.4 * len(names), 6.4), sharey=True, squeeze=False)
    for j, name in enumerate(names):
        rep = reports[name]
        caps = rep["capacities"]
        for i, mode in enumerate(("GPU-only", "L1+L2")):
            ax = axes[i][j]
            at = {(r["policy"], r["capacity_tokens"]): r["hit_rate"] for r in rep["runs"] if r["mode"] == mode}
            for k, p in enumerate(p for p in ORDER if p in rep["policies"]):
                ax.plot(caps, [100 * (at[p, c] - at["lru", c]) for c in caps], marker="osD^v<>p"[k],
                        color=f"C{k}", markersize=4, linewidth=2.2 if p == rep["default"] else 1, label=p)
            bel = [100 * ((rep["belady"].get(str(c)) or rep["belady"].get(c)) - at["lru", c]) for c in caps]
            ax.plot(caps, bel, "k--", marker="x", markersize=4, label="Belady (offline)")
            ax.set_xscale("log")
            ax.set_yscale("symlog", linthresh=1.0)
            ax.set_xticks(caps, [tok(c) for c in caps], fontsize=7, rotation=45)
            ax.minorticks_off()
            ax.axhline(0, color="gray", linewidth=0.8)
            ax.grid(alpha=0.3)
            ax.set_title(f"{name}\n{mode}", fontsize=8)
            if j == 0:
                ax.set_ylabel("hit rate - LRU (points)")
    axes[0][-1].legend(fontsize=6, loc="upper right")
    fig.suptitle("eviction policies against LRU, every trace", fontsize=11)
    fig.text(0.5, 0.005, "Above 0 a policy beats LRU; the dashed line is what knowing the future would add. "
             "Online policies stay within a few points of LRU while Belady is 5-25 points above it at small "
             "capacities.", ha="center", fontsize=8)
    fig.tight_layout(rect=(0, 0.03, 1, 0.96))
    fig.savefig(path, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("dir")
    ap.add_argument("traces", nargs="*")
    ap.add_argument("--run", action="store_true")
    ap.add_argument("--plot")
    a = ap.parse_args()
    if a.run:
        run(a.dir, a.traces)
        return 0
    reports = {}
    for path in sorted(glob.glob(os.path.join(a.dir, "*.json"))):
        with open(path) as f:
            reports[os.path.splitext(os.path.basename(path))[0]] = json.load(f)
    for name, rep in reports.items():
        for mode in rep["modes"]:
            print("\n".join(table(name, rep, mode)) + "\n")
    if a.plot:
        plot(reports, a.plot)
        print(f"plot: {a.plot}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
