"""Bytes a hybrid layout stores for one cached prefix, against storing every layer in full.

Pure accounting (``hicache.core.groups.stored_bytes``) at the published shapes: no
timing, so the figures are exact on any machine.

* gpt-oss-120b (SWA 128 / full, alternating): the SWA layers keep only the
  pages of the last window before each resumable boundary (here: the prefix's
  end) instead of every page.
* Qwen3-Next-80B-A3B (12 full-attention layers, 36 Gated DeltaNet layers):
  the KV of the full layers plus a state snapshot every ``k`` pages, against
  a snapshot at every page boundary (what a page-granular hit needs without
  flooring) -- and the KV alone for scale.

With ``--trace NAME`` (a built-in trace: mixed, chat, system, docs) it also
accounts a whole workload (``workload_bytes``): every distinct page of every
request's sequence once, as the prefix tree holds them; generated tokens are
placeholders distinct per request, as in ``workloads.oracle_reuse``.

    python bench/hybrid_bytes.py [--page-size 16] [--tokens 4096 32768 131072] [--trace mixed --scale small]
"""
from __future__ import annotations

import argparse

from hicache.core.groups import hybrid_layout, stored_bytes, workload_bytes
from hicache.core.shapes import model_shape

GiB = 1 << 30


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--tokens", type=int, nargs="+", default=[4096, 32768, 131072])
    ap.add_argument("--snapshot-every", type=int, nargs="+", default=[8, 64, 256])
    ap.add_argument("--trace", default="", help="also account a built-in trace (mixed, chat, system, docs)")
    ap.add_argument("--scale", default="small")
    a = ap.parse_args()
    ps = a.page_size
    print(f"page_size={ps}; one prefix, resumable at its end (and at every snapshot)\n")
    print("| model | prefix tokens | every layer in full GiB | hybrid GiB | saved |")
    print("|---|---:|---:|---:|---:|")
    oss = hybrid_layout(model_shape("gpt-oss-120b"), ps)
    for t in a.tokens:
        s = stored_bytes(oss, t // ps)
        print(f"| gpt-oss-120b | {t} | {s.every_layer_full / GiB:.3f} | {s.hybrid / GiB:.3f} | {s.saved:.1%} |")
    print("\n| model | state dtype | snapshot every (pages) | prefix tokens | full-layer KV GiB | snapshots | "
          "KV + snapshots GiB | snapshot at every page GiB | saved vs every page |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for dt, nbytes in (("bf16", 2), ("fp32", 4)):
        for k in a.snapshot_every:
            lay = hybrid_layout(model_shape("qwen3-next-80b-a3b"), ps, snapshot_every=k, state_dtype_bytes=nbytes)
            for t in a.tokens:
                s = stored_bytes(lay, t // ps)
                print(f"| qwen3-next-80b-a3b | {dt} | {k} | {t} | {s.every_layer_full / GiB:.3f} | {s.snapshots} | "
                      f"{s.hybrid / GiB:.3f} | {(s.every_layer_full + s.state_every_page) / GiB:.3f} | "
                      f"{s.saved:.1%} |")
    st = lay.groups[1]
    print(f"\nqwen3-next: one snapshot of all {len(st.layers)} state layers = "
          f"{len(st.layers) * st.state_bytes / 2**20:.1f} MiB (fp32); one page of KV = {lay.page_bytes / 2**10:.0f} KiB")

    if a.trace:
        trace_table(a.trace, a.scale, ps, a.snapshot_every)


def trace_sequences(name: str, scale: str) -> list[tuple[list[int], str]]:
    """Each request's computed sequence (prompt + placeholder answer but its last token)."""
    from hicache.reference.workloads import builtin_trace
    seqs: dict[str, list[int]] = {}
    out, fresh = [], 1 << 20  # placeholder answer ids, above every trace token id
    for r in sorted(builtin_trace(name, scale).requests, key=lambda r: r.arrival):
        prompt = list(r.prompt) if r.parent is None else seqs[r.parent] + list(r.append)
        full = prompt + list(range(fresh, fresh + r.max_new_tokens))
        fresh += r.max_new_tokens
        seqs[r.rid] = full
        out.append((full[:-1], r.namespace))
    return out


def trace_table(name: str, scale: str, ps: int, every: list[int]) -> None:
    seqs = trace_sequences(name, scale)
    print(f"\ntrace {name}-{scale}: {len(seqs)} requests, {sum(len(s) for s, _ in seqs):,} tokens\n")
    print("| model | snapshot every | every layer in full MiB | snapshots | hybrid MiB | snapshot at every page MiB | saved |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    rows = [("gpt-oss-120b", 0, False)] + [("qwen3-next-80b-a3b", k, e) for e in (False, True) for k in every]
    for model, k, ends in rows:
        lay = hybrid_layout(model_shape(model), ps, snapshot_every=k or 1)
        s = workload_bytes(lay, seqs, end_snapshots=ends)
        base = s.every_layer_full + s.state_every_page
        print(f"| {model} | {k or '-'}{' + ends' if ends else ''} | {s.every_layer_full / 2**20:.1f} | {s.snapshots} | "
              f"{s.hybrid / 2**20:.1f} | {base / 2**20:.1f} | {s.saved:.1%} |")


if __name__ == "__main__":
    main()
