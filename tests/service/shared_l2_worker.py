"""An engine process for the zero-copy shared-L2 test: ``python shared_l2_worker.py MODE JSON``.

The JSON carries ``socket``, ``kind`` (mha / mla), ``host_layout`` and
``prompt``. Pages move between this process's L1 and the service's segment
only through the client's two-phase calls and the page-copy kernels: the CPU byte path of the
pool (``read_page`` / ``write_page``) is disabled here, so using it fails.

* ``prefill``: compute the prompt cold, share its full pages; prints
  ``{"stored", "copied", "logits"}``.
* ``warm``: load the shared prefix into L1 (scattered page ids), compute the
  rest, and compute the whole prompt cold in a second pool; prints
  ``{"loaded", "warm", "cold"}`` (logits as hex of their float32 bytes).
* ``hc_prefill`` / ``hc_warm``: the same through ``HiCache`` in service mode
  (``storage.url = hicache+unix://``): admission, layer-wise load back and
  write-through backup run the page-copy kernels between L1 and the segment.
"""
from __future__ import annotations

import json
import sys
from typing import NamedTuple, Sequence

import torch

from hicache.client.link import ServiceClient
from hicache.reference.model import ReferenceModel
from hicache.reference.model_spec import ModelSpec
from hicache.core.hashing import page_hashes
from hicache.memory.pools import DevicePool, HostPool
from hicache.kernels.page_copy import PageCopier, default_copier
from hicache.core.types import PageHash

PS = 4
NUM_PAGES = 32


# Whole-page store and load through the client's two-phase calls, the page-copy
# kernels moving the bytes (the engine's own path is HiCache in service mode,
# ``hicache.tiers.l2.shared``; these serve this worker and the tests).
class StoreResult(NamedTuple):
    present: int  # leading pages the service already held complete (not copied)
    copied: int  # pages copied into the segment
    inserted: int  # of those, pages that became lookup-able


def _wait(device: DevicePool) -> None:
    if device.device.type == "cuda":
        import torch
        torch.cuda.current_stream(device.device).synchronize()


def store(client: ServiceClient, device: DevicePool, device_pages: Sequence[int], hashes: Sequence[PageHash], *,
          draft_pages: int | None = None, copier: PageCopier | None = None) -> StoreResult:
    """Share L1 pages ``device_pages`` (logical order) under ``hashes``; ``draft_pages``:
    leading pages whose draft rows are valid (None: all). Leading pages the service
    already holds complete are not copied."""
    if len(device_pages) != len(hashes):
        raise ValueError(f"store: {len(device_pages)} device pages for {len(hashes)} hashes")
    dp = len(hashes) if draft_pages is None else draft_pages
    draft = client.layout.draft_layers > 0
    skip = client.lookup(hashes[:dp], need_draft=draft).num_pages if dp else 0
    if skip == len(hashes):
        return StoreResult(skip, 0, 0)
    pages = client.reserve(len(hashes) - skip)
    assert client.pool is not None
    try:
        (copier or default_copier()).copy_pages(device, client.pool, list(device_pages[skip:]), pages)
        _wait(device)
    except BaseException:
        client.cancel(pages)
        raise
    inserted = client.commit(hashes[skip:], pages, draft_pages=max(0, dp - skip)).inserted
    return StoreResult(skip, len(pages), inserted)


def load(client: ServiceClient, hashes: Sequence[PageHash], device: DevicePool, device_pages: Sequence[int], *,
         need_draft: bool = False, copier: PageCopier | None = None) -> int:
    """Copy the leading shared pages of ``hashes`` into L1 ``device_pages`` (same order);
    returns how many (the rest of ``device_pages`` is untouched)."""
    pages = client.acquire(hashes, need_draft=need_draft)
    assert client.pool is not None
    try:
        if pages:
            (copier or default_copier()).copy_pages(client.pool, device, pages, list(device_pages[:len(pages)]))
            _wait(device)
    finally:
        client.release(hashes[:len(pages)])
    return len(pages)


def _no_cpu_copy(*a, **k):
    raise AssertionError("a page payload went through the CPU byte path (read_page/write_page)")


def layout_of(kind: str, host_layout: str):
    return ModelSpec.tiny(kind).kv_layout(PS, host_layout)


def _slots(pages: list[int]) -> torch.Tensor:
    return (torch.tensor(pages)[:, None] * PS + torch.arange(PS)).reshape(-1)


def hicache_mode(mode: str, args: dict, model, layout) -> dict:
    """One engine process using ``HiCache`` with the service's segment as its L2."""
    from hicache.core.config import HiCacheConfig
    from hicache.cache.hicache import HiCache
    cfg = HiCacheConfig.load(env={}, overrides={
        "storage.url": f"hicache+unix://{args['socket']}", "pool.device": "cpu",
        "pool.device_pages": str(NUM_PAGES), "policy.write_policy": "write_through",
        "policy.prefetch_policy": "wait_complete"})
    prompt = args["prompt"]
    hc = HiCache(cfg, layout=layout)
    try:
        held = hc.cache.alloc_device(3) if mode == "hc_warm" else []  # B's L1 pages differ from A's
        req = hc.new_request("r", prompt, draft=False)
        adm = hc.admit(req)
        start = req.computed_tokens
        req.alloc(len(prompt) - start)
        hc.cache.free_device(held)
        slots = hc.device_pool.slot_ids(req.pages)[:len(prompt)]
        out = model.forward_chunk(hc.device_pool, prompt[start:], start, slots, draft=False,
                                  before_layer=adm.wait_layer)
        req.commit()
        req.finish()
        hc.drain()
        hc.check_integrity()
        st = hc.stats()
        cold_pool = DevicePool(layout, NUM_PAGES, "cpu")
        n_pages = -(-len(prompt) // PS)
        cold = model.forward_chunk(cold_pool, prompt, 0, _slots(list(range(n_pages))), draft=False)
        svc = hc.shared.client.stats()
        return {"hit": adm.hit_tokens, "host_tokens": adm.host_tokens, "backup_pages": st.tiers.backup_pages,
                "load_back_pages": st.tiers.load_back_pages, "private_l2_bytes": hc.private_host_bytes,
                "logits": out.logits_last.numpy().tobytes().hex(),
                "cold": cold.logits_last.numpy().tobytes().hex(),
                "locked_after": svc["locked_pages"], "reserved_after": svc["reserved_pages"]}
    finally:
        hc.close()


def main(mode: str, args: dict) -> dict:
    torch.set_num_threads(1)  # one reduction order: bit-exact comparisons
    HostPool.read_page = HostPool.write_page = _no_cpu_copy  # type: ignore[method-assign]
    spec = ModelSpec.tiny(args["kind"])
    layout = layout_of(args["kind"], args["host_layout"])
    model = ReferenceModel(spec, draft=False)
    if mode.startswith("hc_"):
        return hicache_mode(mode, args, model, layout)
    prompt = args["prompt"]
    n_pages = -(-len(prompt) // PS)
    full = (len(prompt) - 1) // PS  # shareable: whole pages before the last token
    hashes = page_hashes(prompt[:full * PS], PS)
    with ServiceClient(args["socket"], layout, pin=False) as client:
        if mode == "prefill":
            pool = DevicePool(layout, NUM_PAGES, "cpu")
            pages = list(range(n_pages))
            out = model.forward_chunk(pool, prompt, 0, _slots(pages), draft=False)
            r = store(client, pool, pages[:full], hashes)
            return {"stored": r.present + r.copied, "copied": r.copied, "logits": out.logits_last.numpy().tobytes().hex()}
        assert mode == "warm", mode
        pool = DevicePool(layout, NUM_PAGES, "cpu")
        pages = [NUM_PAGES - 1 - 2 * i for i in range(n_pages)]  # scattered, unlike the writer's
        n = load(client, hashes, pool, pages[:full])
        warm = model.forward_chunk(pool, prompt[n * PS:], n * PS, _slots(pages), draft=False)
        cold_pool = DevicePool(layout, NUM_PAGES, "cpu")
        cold = model.forward_chunk(cold_pool, prompt, 0, _slots(list(range(n_pages))), draft=False)
        st = client.stats()
        return {"loaded": n, "warm": warm.logits_last.numpy().tobytes().hex(),
                "cold": cold.logits_last.numpy().tobytes().hex(), "locked_after": st["locked_pages"]}


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], json.loads(sys.argv[2]))), flush=True)
