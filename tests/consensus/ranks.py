"""One rank of a TP (x CP) group for the consensus tests, run by ``torch.multiprocessing.spawn``.

Each rank owns an embedded ``HiCache`` whose pages carry token-derived values
(the same on every rank: a TP rank's planes differ in what they hold, not in
which tokens they cover). The scenarios make the ranks' hits differ, admit
with a ``HitConsensus``, and record, per rank: the hit before consensus, the
tokens the admitted request holds after it, and whether every held row
carries the value its token was computed with.
"""
from __future__ import annotations

import json

from pathlib import Path

import torch

from hicache.core.config import HiCacheConfig
from hicache.cache.hicache import HiCache
from hicache.core.layout import KVLayout

PS = 4
PROMPT = list(range(100, 125))  # 6 pages + 1 token
TAIL_PROMPT = list(range(300, 318))  # 4 pages + 2 tokens: a private partial page


def value(token: int, plane: int) -> float:
    return float(token * 10 + plane)


def make_cache(tp_rank: int, tp_size: int, cp_rank: int, cp_size: int, consensus, device: str = "cpu") -> HiCache:
    layout = KVLayout(model_id="t", num_layers=2, num_kv_heads=1, head_dim=4, dtype="float32", page_size=PS,
                      host_layout="page_first", tp_rank=tp_rank, tp_size=tp_size, cp_rank=cp_rank, cp_size=cp_size)
    o = {"storage.url": "", "pool.device": device, "pool.device_pages": "32", "pool.host_pages": "64",
         "policy.write_policy": "write_through"}
    return HiCache(HiCacheConfig.load(env={}, overrides=o), layout=layout, consensus=consensus)


def _rows(hc: HiCache, req, start: int, end: int) -> list[tuple[int, int]]:
    """(global position, L1 slot) of this rank's rows among positions [start, end)."""
    lay, own = hc.layout, hc.cache.ownership
    owned = [j for j in range(-(-req.allocated_tokens // PS)) if own.owner(j) == lay.cp_rank]
    slot = {j: pid for j, pid in zip(owned, req.pages)}
    return [(pos, slot[pos // PS] * PS + pos % PS) for pos in range(start, end) if pos // PS in slot]


def compute(hc: HiCache, req, upto: int) -> None:
    """'Compute' the request's tokens up to ``upto`` (allocate, write values, commit)."""
    start = req.computed_tokens
    req.alloc(upto - req.allocated_tokens)
    toks = req.tokens
    for i, buf in enumerate(hc.device_pool.buffers):
        for pos, s in _rows(hc, req, start, upto):
            buf[s] = value(toks[pos], i)
    req.commit()


def values_ok(hc: HiCache, req) -> bool:
    toks = req.tokens
    return all(bool(torch.all(buf[s] == value(toks[pos], i)))
               for i, buf in enumerate(hc.device_pool.buffers)
               for pos, s in _rows(hc, req, 0, req.computed_tokens))


def admit(hc: HiCache, req) -> dict:
    before = hc.cache.match(req.key, req.namespace, max_tokens=req.num_tokens - 1, need_draft=req.draft)
    exact = req.match().exact_tokens
    adm = hc.admit(req)
    adm.wait()
    hc.check_integrity()
    return {"before": before.tokens, "before_exact": exact, "after": req.computed_tokens,
            "host_loaded": adm.host_tokens, "values_ok": values_ok(hc, req)}


def scenario_differ(hc: HiCache, rank: int, world: int) -> dict:
    """Rank r cached 6 - r pages; rank 1 holds its pages on L2 only."""
    warm = hc.new_request("warm", PROMPT[:(6 - rank) * PS + 1])
    hc.admit(warm)
    compute(hc, warm, warm.num_tokens)
    warm.finish()
    hc.drain()
    if rank == 1:
        hc.cache.evict(100)  # on L2 only now: its hit is loaded back
    req = hc.new_request("x", PROMPT)
    out = admit(hc, req)
    compute(hc, req, req.num_tokens)
    req.finish()
    hc.drain()
    return out


def scenario_tail(hc: HiCache, rank: int, world: int, lose_on: int) -> dict:
    """A preempted request with a private partial page; rank ``lose_on`` (-1: none)
    lost its prefix from every tier, so its tail no longer continues a hit."""
    tag = f"t{lose_on}"
    req = hc.new_request(tag, [t + 1000 * (lose_on + 1) for t in TAIL_PROMPT])
    hc.admit(req)
    compute(hc, req, req.num_tokens)
    req.preempt()
    hc.drain()
    if rank == lose_on:
        hc.cache.evict(100)
        hc.cache.evict_host(100)
    req.extend([7, 8, 9])
    out = admit(hc, req)
    compute(hc, req, req.num_tokens)
    req.finish()
    hc.drain()
    return out


def run_rank(rank: int, world: int, transport: str, cp_size: int, rendezvous: str, out_dir: str) -> None:
    """Entry point for ``torch.multiprocessing.spawn`` (rank first). ``transport``:
    ``torch`` (gloo, CPU pools), ``nccl`` (one GPU per rank, GPU pools) or ``service``."""
    device = "cpu"
    if transport in ("torch", "nccl"):
        import torch.distributed as dist
        from hicache.client.consensus import TorchConsensus
        if transport == "nccl":
            device = f"cuda:{rank}"
            torch.cuda.set_device(rank)
        dist.init_process_group("gloo" if transport == "torch" else "nccl", init_method=f"file://{rendezvous}",
                                rank=rank, world_size=world)
        consensus = TorchConsensus()
    else:
        from hicache.client.consensus import ServiceConsensus
        consensus = ServiceConsensus(rendezvous, "test-group", rank, world, timeout_s=120)
    tp_size = world // cp_size
    try:
        hc = make_cache(rank % tp_size, tp_size, rank // tp_size, cp_size, consensus, device)
        out = {"differ": scenario_differ(hc, rank, world)}
        if cp_size == 1:
            out["tail_kept"] = scenario_tail(hc, rank, world, lose_on=-1)
            out["tail_lost"] = scenario_tail(hc, rank, world, lose_on=world - 1)
        hc.check_integrity()
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(out))
    finally:
        consensus.close()
        if transport in ("torch", "nccl"):
            import torch.distributed as dist
            dist.destroy_process_group()

