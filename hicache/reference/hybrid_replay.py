"""``hicache replay --hybrid SHAPE``: a workload through a ``HybridCache`` at a published
hybrid shape (gpt-oss-120b, qwen3-next-80b-a3b), bytes held against every layer in full.

No model: every request's tokens go through the real index, tiers and group stores
(``HybridCache``) at the shape's real page and snapshot sizes; KV payloads are left
as the pools hold them and snapshots are zeros of the real size. Requests run one
at a time in arrival order; a child turn's prompt is its parent's prompt, the
parent's output (placeholders distinct per request) and its own appended tokens.
L2 is sized to hold the whole workload (written through), so what it holds at the
end is what the hybrid layout keeps for it: compared with every layer of every page in
full (and, for a state group, a snapshot at every page boundary), and with
``hicache.core.groups.workload_bytes``' accounting of the same sequences.
"""
from __future__ import annotations

import argparse
import json
import resource
from typing import Any

import torch

from hicache.cache.hybrid import group_layout, HybridCache, HybridPools
from hicache.core.config import HiCacheConfig, host_memory
from hicache.core.groups import hybrid_layout, workload_bytes
from hicache.core.layout import KVLayout
from hicache.core.shapes import model_shape
from hicache.core.types import WritePolicy
from hicache.memory.pools import HostPool
from hicache.reference.progress import logs_above_bars, Progress


HYBRID_SHAPES = ("gpt-oss-120b", "qwen3-next-80b-a3b")
PLACEHOLDER_BASE = 1 << 24  # output token ids: above every trace vocab, distinct per request


def _sequences(trace) -> list[tuple[str, list[int], list[int], str]]:
    """``(rid, prompt, output, namespace)`` in arrival order (parents resolved)."""
    full: dict[str, list[int]] = {}
    out = []
    for i, r in enumerate(sorted(trace.requests, key=lambda r: r.arrival)):
        prompt = list(r.prompt) if not r.parent else full.get(r.parent, []) + list(r.append)
        output = [PLACEHOLDER_BASE + i * 4096 + j for j in range(r.max_new_tokens)]
        full[r.rid] = prompt + output
        out.append((r.rid, prompt, output, r.namespace))
    return out


def _snapshots(hy: HybridCache, first: int, last: int, end: int, payload: list) -> dict[int, list]:
    """Snapshots (zeros) at the state group's boundaries in ``(first, last]`` pages, and at
    ``end`` (the sequence's last full page; 0: none) when it is in that span."""
    if hy.state_gi is None:
        return {}
    k = hy.groups[hy.state_gi].snapshot_every
    bs = {b for b in range(first + 1, last + 1) if b % k == 0} | ({end} if first < end <= last else set())
    return {b: payload for b in bs}


def _serve(hy: HybridCache, rid: str, prompt: list[int], output: list[int], ns: str, end: bool,
           payload: list) -> tuple[int, int]:
    """One request: admit, compute the prompt and the output, finish. ``(hit, resume)``."""
    ps = hy.ps
    req = hy.new_request(rid, prompt, ns)
    adm = hy.admit(req)
    done = req.computed_tokens
    e = (len(prompt) + len(output)) // ps if end else 0
    replay = _snapshots(hy, adm.resume // ps, done // ps, e, payload)
    if hy.state_gi is not None and done // ps > adm.resume // ps:
        replay[done // ps] = payload  # the fork: as HybridRunner marks it
    req.advance(done, replay)
    req.alloc(len(prompt) - done)
    req.commit(None, _snapshots(hy, done // ps, len(prompt) // ps, e, payload))
    if output:
        req.extend(output)
        req.alloc(len(output))
        req.commit(None, _snapshots(hy, len(prompt) // ps, req.num_tokens // ps, e, payload))
    req.finish()
    return adm.hit - adm.hit % ps, adm.resume


def pool_bytes(lay: KVLayout, device_pages: int, host_pages: int, state_device: int, state_host: int) -> int:
    """Bytes of every pool a ``HybridCache`` allocates at these sizes (the full groups'
    ``HiCache``, each SWA group's pools at the same page counts, the state slots)."""
    total = 0
    for gi, g in enumerate(lay.groups):
        if g.kind == "full" and gi != next(i for i, x in enumerate(lay.groups) if x.kind == "full"):
            continue  # the full groups share one HiCache
        sub = group_layout(lay, ("full",)) if g.kind == "full" else group_layout(lay, (g.kind,), gi)
        dev, host = (state_device, state_host) if g.kind == "state" else (device_pages, host_pages)
        total += sub.page_bytes * dev + HostPool.nbytes_for(sub, host)
    return total


def _peak_rss_bytes() -> int:
    """This process's peak resident set so far (Python, torch, the trace)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def _expect(progress: Progress, pools: int) -> None:
    gib = 1 << 30
    now = _peak_rss_bytes()
    have = host_memory()
    ram, what = have if have else (0, "")
    progress.note(f"expected peak RSS: about {(now + pools) / gib:.1f} GiB (the pools {pools / gib:.2f} GiB, "
                  f"sized to hold the whole workload, + {now / gib:.2f} GiB of Python, torch and the trace)"
                  + (f"; this machine has {ram / gib:.1f} GiB ({what})" if ram else "")
                  + ("; it will not fit: use a smaller --scale or trace" if ram and now + pools > ram else ""))


def replay_hybrid(cfg: HiCacheConfig, shape_name: str, trace_path: str | None, *, scale: str = "tiny",
                  snapshot_every: int = 8, end_snapshots: bool = False,
                  progress: Progress | None = None) -> dict[str, Any]:
    """Run the trace (default: the built-in one at ``scale``); returns the report.
    ``progress``: the expected peak RSS before allocating, and a bar over the requests."""
    progress = progress or Progress(False)
    from hicache.reference.workloads import builtin_trace, read_trace

    trace = read_trace(trace_path) if trace_path else builtin_trace(scale=scale)
    ps = cfg.model.page_size
    layout = hybrid_layout(model_shape(shape_name), ps, snapshot_every=snapshot_every, draft=False,
                           host_layout=cfg.model.host_layout)
    seqs = _sequences(trace)
    acct = workload_bytes(layout, [(p + o, ns) for _, p, o, ns in seqs], end_snapshots=end_snapshots)
    # L2 holds the whole workload (write-through), L1 what the configuration gives it: what
    # is held on L2 at the end is what the layout keeps (memory: L2 ~ the workload's bytes).
    pages = sum(-(-(len(p) + len(o)) // ps) for _, p, o, _ in seqs) + 1
    slots = acct.snapshots + len(seqs) + 2  # + one fork per request
    cfg = cfg.model_copy(update={
        "pool": cfg.pool.model_copy(update={"device_pages": min(cfg.pool.device_pages, pages), "host_pages": pages}),
        "policy": cfg.policy.model_copy(update={"write_policy": WritePolicy.WRITE_THROUGH})})
    # snapshots: 4 on L1 (one is taken or recorded at a time; the rest stay on L2), all on L2
    pools_b = pool_bytes(layout, cfg.pool.device_pages, pages, 4, slots)
    _expect(progress, pools_b)
    hy = HybridCache(cfg, layout=layout, pools=HybridPools(state_device_slots=4, state_host_slots=slots))
    try:
        payload = []
        if hy.state_gi is not None:
            payload = [torch.zeros(hy.stores[hy.state_gi].layout.row_bytes, dtype=torch.uint8)]
        prompt_total = hit = resumed = 0
        for rid, prompt, output, ns in progress.wrap(seqs, f"--hybrid {shape_name}", total=len(seqs)):
            h, r = _serve(hy, rid, prompt, output, ns, end_snapshots, payload)
            hy.drain()  # as the reference engine's replay: backups done before the next request
            prompt_total, hit, resumed = prompt_total + len(prompt), hit + h, resumed + r
        hy.drain()
        hy.check_integrity()
        held = hy.held_bytes()
        stats = hy.stats()
        return {"shape": shape_name, "trace": trace.name, "page_size": ps, "snapshot_every": snapshot_every,
                "requests": len(seqs), "prompt_tokens": prompt_total, "hit_tokens": hit, "pool_bytes": pools_b,
                "resumed_tokens": resumed, "hit_rate": hit / prompt_total if prompt_total else 0.0,
                "floored_hit_rate": resumed / prompt_total if prompt_total else 0.0,
                "held_bytes": held, "boundaries": stats.boundaries, "forgotten_boundaries": stats.forgotten,
                "groups": {hy.stores[gi].name: hy.stores[gi].counts()._asdict()
                                               for gi in hy.stores},
                "every_layer_full_bytes": acct.every_layer_full, "state_every_page_bytes": acct.state_every_page,
                "accounted_hybrid_bytes": acct.hybrid, "saved": 1.0 - held["L2"] / (acct.every_layer_full +
                                                                                   acct.state_every_page)}
    finally:
        hy.close()


def format_report(r: dict[str, Any]) -> str:
    mib = 1 << 20
    base = r["every_layer_full_bytes"] + r["state_every_page_bytes"]
    lines = [f"{r['shape']} on {r['trace']} ({r['requests']} requests, {r['prompt_tokens']:,} prompt tokens, "
             f"page {r['page_size']}, snapshot every {r['snapshot_every']} pages)",
             f"  hit rate: {r['hit_rate']:.1%} full-attention pages, {r['floored_hit_rate']:.1%} floored to "
             "where every group resumes",
             f"  held on L2: {r['held_bytes']['L2'] / mib:,.1f} MiB  (L1 {r['held_bytes']['L1'] / mib:,.1f} MiB, "
             f"L3 {r['held_bytes']['L3'] / mib:,.1f} MiB)",
             f"  every layer in full: {r['every_layer_full_bytes'] / mib:,.1f} MiB"
             + (f" + a snapshot at every page {r['state_every_page_bytes'] / mib:,.1f} MiB"
                if r["state_every_page_bytes"] else ""),
             f"  saved: {r['saved']:.1%} of {base / mib:,.1f} MiB (accounted by workload_bytes: "
             f"{r['accounted_hybrid_bytes'] / mib:,.1f} MiB held)",
             f"  group items (L1/L2/L3): {r['groups']}",
             f"  boundaries recorded: {r['boundaries']:,} ({r['forgotten_boundaries']:,} forgotten)"]
    return "\n".join(lines)


def main(args: argparse.Namespace, cfg: HiCacheConfig) -> int:
    with logs_above_bars():
        report = replay_hybrid(cfg, args.hybrid, args.trace, scale=args.scale, snapshot_every=args.snapshot_every,
                               end_snapshots=args.end_snapshots, progress=Progress(not args.quiet))
    print(format_report(report))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2, default=str)
        print(f"report: {args.json}")
    return 0
