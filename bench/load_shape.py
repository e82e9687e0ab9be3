"""Standalone rate of a layer-wise load back (one page-copy launch per layer, as the
load graph issues them) for several launch shapes, on several KV shapes.

    PYTHONPATH=. python3 bench/load_shape.py [--shapes 8:64:8,8:32:4,16:16:2]

A shape is BLOCKS:TILE_KIB:WARPS. ``bench/ttft.py --load-blocks`` measures what a
shape costs the forward beside it; this script checks that a shape which
interferes less does not lose rate where nothing runs beside it: pages of 1, 16
and 64 tokens (Qwen3-8B KV, 36 layers) and DeepSeek-V3 MLA at page 64 (an fp8
byte plane, a draft layer), 512 random pages of a pool twice that size,
``page_first`` and ``layer_first`` host pools. Every shape's copy is checked
byte for byte against the default's. Prints GB/s and % of the contiguous copy
of the same bytes, measured in the same process.
"""
from __future__ import annotations

import argparse

import torch
import triton.testing

from hicache.kernels.page_copy import PageCopier
from hicache.kernels.plan import TileConfig
from hicache.core.layout import BytePlane, KVLayout
from hicache.memory.pools import DevicePool, HostPool
from hicache.transfer.engine import layer_plane_groups


def launch_shape(spec: str) -> tuple[int, PageCopier]:
    """``BLOCKS`` (the tuned tile) or ``BLOCKS:TILE_KIB:WARPS`` -> (blocks, a copier with that PCIe tile).
    Keep the copier alive while anything replays a graph captured with it (its plans)."""
    blocks, *tile = (int(x) for x in spec.split(":"))
    if not tile:
        return blocks, PageCopier()
    kib, warps = tile
    return blocks, PageCopier(pcie=TileConfig(kib * 1024, 4096, kib * 1024, warps))


def contiguous_h2d_gbps(nbytes: int, dev: torch.device) -> float:
    """GB/s of one contiguous pinned host -> device copy of ``nbytes`` (the limit)."""
    hbuf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dbuf = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    return nbytes / triton.testing.do_bench(lambda: dbuf.copy_(hbuf, non_blocking=True), return_mode="median") / 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default="8:64:8,8:32:4,16:16:2,4:64:8")
    ap.add_argument("--pages", type=int, default=512)
    a = ap.parse_args()
    dev = torch.device("cuda")
    shapes = a.shapes.split(",")
    copiers = {s: launch_shape(s) for s in shapes}
    kv = {"qwen8b-p1": KVLayout("q", 36, num_kv_heads=8, head_dim=128, page_size=1),
          "qwen8b-p16": KVLayout("q", 36, num_kv_heads=8, head_dim=128, page_size=16),
          "qwen8b-p64": KVLayout("q", 36, num_kv_heads=8, head_dim=128, page_size=64),
          "dsv3-mla-p64": KVLayout("d", 61, kind="mla", kv_lora_rank=512, rope_dim=64, page_size=64,
                                   extra_planes=(BytePlane("index_k", 132),), draft_layers=1)}
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}: layer-wise load of {a.pages} random "
          "pages, one launch per layer (median of do_bench), GB/s (% of the contiguous copy)\n")
    print("| KV shape | host layout | contiguous GB/s | " + " | ".join(shapes) + " |")
    print("|---|---|---:|" + "---:|" * len(shapes))
    for name, lay0 in kv.items():
        n = a.pages if lay0.page_size > 1 else a.pages * 16
        cap = 2 * n
        g = torch.Generator().manual_seed(0)
        sp = torch.randperm(cap, generator=g)[:n].to(dev)
        dp = torch.randperm(cap, generator=g)[:n].to(dev)
        nbytes = n * lay0.page_bytes
        limit = contiguous_h2d_gbps(nbytes, dev)
        for hl in ("page_first", "layer_first"):
            lay = lay0.replace(host_layout=hl)
            host = HostPool(lay, cap, pin=True)
            host.buffer.copy_(torch.randint(0, 256, host.buffer.shape, generator=g, dtype=torch.uint8))
            groups = [grp for grp in layer_plane_groups(lay) if grp]  # as the load back's launches
            ref = None
            row = []
            for s in shapes:
                blocks, cp = copiers[s]
                d = DevicePool(lay, cap, device=dev)
                for b in d.buffers:
                    b.view(torch.uint8).fill_(0x5A)

                def run(cp=cp, d=d, blocks=blocks, host=host):
                    for grp in groups:
                        cp.copy_pages(host, d, sp, dp, planes=grp, num_blocks=blocks)

                run()
                torch.cuda.synchronize()
                got = [b.clone() for b in d.buffers]
                if ref is None:
                    ref = got
                else:
                    assert all(torch.equal(x.view(torch.uint8), y.view(torch.uint8)) for x, y in zip(ref, got)), \
                        f"{name} {hl} {s}: bytes differ from {shapes[0]}"
                gb = nbytes / triton.testing.do_bench(run, return_mode="median") / 1e6
                row.append(f"{gb:.1f} ({100 * gb / limit:.1f})")
                del d, got
            print(f"| {name} | {hl} | {limit:.1f} | " + " | ".join(row) + " |", flush=True)
            del host, ref
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
