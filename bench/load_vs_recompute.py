"""Never slower than recompute: a prompt whose KV sits only on an L3 slower
than the prefill, served three ways in one run, on the same HiCache:

- ``cold``: nothing cached, full prefill (measures the prefill rate, fed to the
  cost model with ``HiCache.observe_prefill``);
- ``always load``: the cost model off, the L3 hit is fetched (``wait_complete``)
  and loaded back before the forward: what a cache without the model does;
- ``cost model``: the same L3 hit, the model on: it must choose to recompute.
  A second L3 (fast, unthrottled) then shows the model choosing to load.

L3 is ``memory://`` throttled to ``--l3-mbps`` on reads (a slow disk or a
congested network), so the bandwidth the model uses is the EWMA it measured
on the ``always load`` row's real transfer. Runs on the GPU (an 8B-shaped
model, ``bench/ttft.py --slow-l3`` calls ``run``) or here on the CPU::

    PYTHONPATH=. python bench/load_vs_recompute.py            # CPU, tiny model
    PYTHONPATH=. python bench/ttft.py --slow-l3 --tokens 8192 # H200

Prints a table; the last line says whether the decision was right both ways.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass

import torch

from hicache.core.config import HiCacheConfig
from hicache.reference.model import ReferenceModel
from hicache.reference.model_spec import ModelSpec
from hicache.cache.hicache import HiCache
from hicache.core.layout import KVLayout
from hicache.tiers.cost import Choice, choose
from hicache.storage.capacity import StorageOptions
from hicache.storage.memory import MemoryBackend


class ThrottledMemory(MemoryBackend):
    """``memory://`` whose reads take ``nbytes / bytes_per_s`` (a slow L3)."""

    def __init__(self, options: StorageOptions, bytes_per_s: float):
        super().__init__(options, max_bytes=0, name=f"memory:// at {bytes_per_s / 1e6:.0f} MB/s")
        self.bytes_per_s = bytes_per_s

    def _raw_get(self, keys):
        out = super()._raw_get(keys)
        time.sleep(sum(len(o) for o in out if o is not None) / self.bytes_per_s)
        return out


@dataclass(slots=True)
class Row:
    case: str
    choice: str
    l3_tokens: int  # tokens served from L3 (loaded)
    ttft_s: float
    first: int


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def serve(hc: HiCache, model: ReferenceModel, rid: str, prompt: list[int]) -> tuple[float, int, int]:
    """Admit, wait for loads, prefill the rest, first token: (seconds, first token, L3 tokens)."""
    dev = str(hc.device_pool.device)
    _sync(dev)
    t0 = time.perf_counter()
    req = hc.new_request(rid, prompt)
    adm = hc.admit(req)
    start = req.computed_tokens
    req.alloc(len(prompt) - start)
    adm.wait()
    slots = hc.device_pool.slot_ids(req.pages)[:len(prompt)]
    out = model.forward_chunk(hc.device_pool, prompt[start:], start, slots, draft=False)
    first = int(out.logits_last.argmax())
    dt = time.perf_counter() - t0
    req.commit()
    req.finish()
    return dt, first, adm.storage_tokens


def make_cache(layout: KVLayout, device: str, pages: int, storage) -> HiCache:
    cfg = HiCacheConfig.load(env={}, overrides={
        "storage.url": "", "pool.device": device, "pool.device_pages": str(pages), "pool.host_pages": str(pages),
        "policy.prefetch_policy": "wait_complete"})
    return HiCache(cfg, layout=layout, storage=storage)


def only_on_l3(hc: HiCache) -> None:
    hc.drain()  # write-through: L1 -> L2 -> L3
    hc.evict(10**9)
    hc.evict_host(10**9)
    hc.drain()


def run(model: ReferenceModel, layout: KVLayout, *, tokens: int, l3_bytes_per_s: float, reps: int,
        device: str) -> bool:
    """Print the table; True when the model recomputed on the slow L3 and loaded from the fast one."""
    pages = tokens // layout.page_size + 8
    opts = StorageOptions(fingerprint=layout.fingerprint())
    slow = make_cache(layout, device, pages, ThrottledMemory(opts, l3_bytes_per_s))
    fast = make_cache(layout, device, pages, MemoryBackend(opts))
    g = torch.Generator().manual_seed(0)
    warm = torch.randint(1, model.spec.vocab, (tokens,), generator=g).tolist()
    for hc in (slow, fast):  # compile / allocate; not measured
        serve(hc, model, "warmup", warm)
        only_on_l3(hc)
    rows: dict[str, list[Row]] = {}
    cold_firsts = []
    for i in range(reps):
        prompt = torch.randint(1, model.spec.vocab, (tokens,), generator=g).tolist()
        for name, hc in (("slow", slow), ("fast", fast)):
            dt, first, _ = serve(hc, model, f"{name}-cold{i}", prompt)
            hc.observe_prefill(tokens, dt)
            rows.setdefault(f"cold (full prefill), {name} L3", []).append(Row("cold", "-", 0, dt, first))
            cold_firsts.append(first)
            only_on_l3(hc)
        for case, hc, on in (("always load, slow L3", slow, False), ("cost model, slow L3", slow, True),
                             ("cost model, fast L3", fast, True)):
            hc.cost.enabled = on
            before = hc.cost.stats.recompute
            dt, first, l3 = serve(hc, model, f"{case}{i}", prompt)
            choice = "load (model off)" if not on else ("recompute" if hc.cost.stats.recompute > before else "load")
            rows.setdefault(case, []).append(Row(case, choice, l3, dt, first))
            only_on_l3(hc)  # the next case finds the prompt on L3 only again
    inp = slow.cost.inputs()
    print(f"# Load vs recompute, {tokens}-token prompt, {layout.num_layers} layers, "
          f"{layout.token_bytes * tokens / 2**20:.1f} MiB of KV, device {device}, {reps} reps (median)\n")
    print("| case | decision | tokens from L3 | TTFT ms |")
    print("|---|---|---:|---:|")
    for case, rs in rows.items():
        print(f"| {case} | {rs[-1].choice} | {rs[-1].l3_tokens} | {statistics.median(r.ttft_s for r in rs) * 1e3:.1f} |")
    d = choose(0, (tokens - 1) // layout.page_size * layout.page_size, inp)
    print(f"\ncost model inputs (slow L3): prefill {inp.prefill_tokens_per_s:,.0f} tokens/s (measured), "
          f"L2->L1 {_gbps(inp.bandwidth['L2'])}, L3->L2 {_gbps(inp.bandwidth['L3'])} (EWMA of real transfers), "
          f"{inp.bytes_per_token:,} B/token; a whole-prompt L3 hit: load {d.load_s * 1e3:.1f} ms vs recompute "
          f"{d.recompute_s * 1e3:.1f} ms -> {d.choice.value}")
    for case in ("cost model, slow L3", "cost model, fast L3"):
        print(f"{case}: per rep {[(r.choice, r.l3_tokens) for r in rows[case]]}")
    ok_slow = all(r.choice == "recompute" and r.l3_tokens == 0 for r in rows["cost model, slow L3"])
    ok_fast = all(r.choice == "load" and r.l3_tokens > 0 for r in rows["cost model, fast L3"])
    same = all(len({rs[i].first for rs in rows.values()}) == 1 for i in range(reps))  # per prompt, every case
    t_cold = statistics.median(r.ttft_s for r in rows["cold (full prefill), slow L3"])
    t_cost = statistics.median(r.ttft_s for r in rows["cost model, slow L3"])
    t_load = statistics.median(r.ttft_s for r in rows["always load, slow L3"])
    print(f"slow L3: cost model {t_cost * 1e3:.1f} ms vs always load {t_load * 1e3:.1f} ms vs cold "
          f"{t_cold * 1e3:.1f} ms; decision right both ways: {'yes' if ok_slow and ok_fast else 'NO'}; "
          f"same first token in every case: {same}")
    assert d.choice is Choice.RECOMPUTE or not ok_slow, d
    for hc in (slow, fast):
        hc.check_integrity()
        hc.close()
    return ok_slow and ok_fast and same


def _gbps(bw: float | None) -> str:
    return "unmeasured" if bw is None else f"{bw / 1e9:.3f} GB/s"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--l3-mbps", type=float, default=2.0, help="slow L3 read bandwidth, MB/s")
    ap.add_argument("--device", default="cpu")
    a = ap.parse_args()
    spec = ModelSpec(vocab=512, hidden=256, num_layers=a.layers, num_q_heads=4, num_kv_heads=2, head_dim=64,
                     mlp=512, max_seq_len=a.tokens + 64, name="bench-load-vs-recompute")
    model = ReferenceModel(spec, device=a.device, attention="sdpa", draft=False)
    ok = run(model, spec.kv_layout(16, "page_first"), tokens=a.tokens, l3_bytes_per_s=a.l3_mbps * 1e6,
             reps=a.reps, device=a.device)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
