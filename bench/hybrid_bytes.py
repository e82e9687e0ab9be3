"""Bytes a hybrid layout stores for one cached prefix, against storing every layer in full.

Pure accounting (``hicache.hybrid.stored_bytes``) at the published shapes: no
timing, so the figures are exact on any machine.

* gpt-oss-120b (SWA 128 / full, alternating): the SWA layers keep only the
  pages of the last window before each resumable boundary (here: the prefix's
  end) instead of every page.
* Qwen3-Next-80B-A3B (12 full-attention layers, 36 Gated DeltaNet layers):
  the KV of the full layers plus a state snapshot every ``k`` pages, against
  a snapshot at every page boundary (what a page-granular hit needs without
  flooring) -- and the KV alone for scale.

    python bench/hybrid_bytes.py [--page-size 16] [--tokens 4096 32768 131072]
"""
from __future__ import annotations

import argparse

from hicache.hybrid import hybrid_layout, stored_bytes
from hicache.shapes import model_shape

GiB = 1 << 30


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--tokens", type=int, nargs="+", default=[4096, 32768, 131072])
    ap.add_argument("--snapshot-every", type=int, nargs="+", default=[8, 64, 256])
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


if __name__ == "__main__":
    main()
