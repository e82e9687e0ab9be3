"""``bench/engines.py --corrupt`` (vLLM, in .venv-vllm) and ``bench/engines.py sglang
--corrupt`` (SGLang, in .venv-sglang): damaged objects on disk, loaded through each
engine's own load path, counting the chunks or pages handed to the engine as loaded
whose bytes differ from what was stored ("wrong bytes").

Damage, one object each: a flipped byte inside the payload, a truncation (the last
third cut), another chunk's object under the key (swapped), another model's object
under the key (hicache: an object of another layout's fingerprint; the built-in tiers
have no header, so a file of another model's bytes of the same size), and, MAC'd only,
an object forged with a recomputed checksum by someone without the key.
"""
from __future__ import annotations

import os

import numpy as np

KINDS = ("flip", "truncate", "swap", "other_model")
SECRET = "a-shared-secret-of-32-characters"
OTHER_FP = "f" * 32  # a layout fingerprint no engine here has


def damage_file(kind: str, path: str, swap_from: str, other_bytes: bytes | None = None) -> None:
    """Damage the file at ``path`` (``other_bytes``: what another model stored there)."""
    with open(path, "rb") as f:
        blob = bytearray(f.read())
    if kind == "flip":
        blob[len(blob) // 2 + 8] ^= 0x01
    elif kind == "truncate":
        blob = blob[:-max(1, len(blob) // 3)]
    elif kind == "swap":
        with open(swap_from, "rb") as f:
            blob = bytearray(f.read())
    elif kind == "other_model":
        blob = bytearray(other_bytes if other_bytes is not None else os.urandom(len(blob)))
    with open(path, "wb") as f:
        f.write(blob)


def forge(path: str, fingerprint: str, page_hash: bytes, sizes: list[int]) -> None:
    """A well-formed object with a recomputed checksum and no MAC (the attacker lacks the key)."""
    from hicache.storage import codec
    with open(path, "wb") as f:
        f.write(codec.encode(fingerprint, page_hash, sizes, bytes(sum(sizes))))


def vllm_corrupt(row: int, tier_cfgs: list[tuple[str, dict]], manager_for, wait_jobs) -> list[tuple]:
    """Per tier: (name, kind, loaded, wrong) for each damage kind, one fresh tier each."""
    from vllm.v1.kv_offload.base import ReqContext, make_offload_key
    from vllm.v1.kv_offload.tiering.base import TransferJob

    from hicache.integrations.vllm import page_hash
    out = []
    for name, cfg in tier_cfgs:
        kinds = KINDS + (("forged",) if cfg.get("auth_key") else ())
        for kind in kinds:
            manager = manager_for(row, 8, cfg)
            try:
                (tier,) = manager.secondary_tiers
                view = manager.primary_tier.get_kv_memoryview()
                arr = np.frombuffer(view, dtype=np.uint8).reshape(view.shape[0], -1)[:, :row]
                arr[:] = np.random.default_rng(len(kind)).integers(0, 256, size=arr.shape, dtype=np.uint8)
                want = arr[:2].copy()
                ctx = ReqContext(req_id=f"corrupt-{kind}")
                ks = [make_offload_key(f"{name}-{kind}-{c}".encode(), 0) for c in range(2)]
                tier.submit_store(TransferJob(job_id=1, keys=ks, chunk_ids=np.array([0, 1]), is_promotion=False,
                                              req_context=ctx))
                assert wait_jobs(tier, {1}), "store failed"
                hc = hasattr(tier, "storage")
                path = (str(tier.storage.path_of(page_hash(ks[0]))) if hc else tier.file_mapper.get_file_name(ks[0]))
                other = (str(tier.storage.path_of(page_hash(ks[1]))) if hc else tier.file_mapper.get_file_name(ks[1]))
                if kind == "forged":
                    forge(path, tier.fingerprint, page_hash(ks[0]), [row])
                elif kind == "other_model" and hc:
                    from hicache.storage import codec
                    damage_file(kind, path, other, codec.encode(OTHER_FP, page_hash(ks[0]), [row], os.urandom(row)))
                else:
                    damage_file(kind, path, other)
                arr[:] = 0
                tier.submit_load(TransferJob(job_id=2, keys=ks[:1], chunk_ids=np.array([4]), is_promotion=True,
                                             req_context=ctx))
                results = _finished(tier, 2)
                loaded = results.success or bool(results.successful_keys)
                out.append((name, kind, int(loaded), int(loaded and not np.array_equal(arr[4], want[0]))))
            finally:
                manager.shutdown()
    return out


def _finished(tier, job_id: int):
    import time
    for _ in range(20000):
        for r in tier.get_finished_jobs():
            if r.job_id == job_id:
                return r
        time.sleep(0.0005)
    raise AssertionError(f"job {job_id} never finished")


def print_counts(title: str, rows: list[tuple]) -> None:
    print(f"\n{title}: per damage kind, chunks handed to the engine as loaded / of those, with wrong bytes")
    kinds = sorted({k for _, k, _, _ in rows}, key=lambda k: (KINDS + ("forged",)).index(k))
    names = list(dict.fromkeys(n for n, _, _, _ in rows))
    print(f"{'tier':<34} " + " ".join(f"{k:>13}" for k in kinds) + f" {'wrong total':>12}")
    for n in names:
        cells = {k: (ld, w) for nn, k, ld, w in rows if nn == n}
        print(f"{n:<34} " + " ".join(f"{cells[k][0]:>11}/{cells[k][1]}" if k in cells else f"{'-':>13}"
                                     for k in kinds)
              + f" {sum(w for _, w in cells.values()):>12}")


def sglang_corrupt(m, page: int, make_controller, dynamic) -> list[tuple]:
    """SGLang's HiCacheFile and HiCacheBackend (default, MAC'd) through the controller's own
    page functions: (name, kind, loaded, wrong) per damage kind, a fresh store each."""
    import shutil
    import tempfile

    import torch
    from sglang.srt.managers.cache_controller import PrefetchOperation
    from sglang.srt.mem_cache.utils import get_storage_hash_str

    from hicache.integrations.sglang_keys import page_key
    from hicache.storage import codec
    out = []
    for name, mac in (("SGLang HiCacheFile", None), ("HiCacheBackend file://", ""), ("HiCacheBackend file:// MAC", SECRET)):
        for kind in KINDS + (("forged",) if mac else ()):
            d = tempfile.mkdtemp(prefix="hicache-bench-corrupt-", dir="/dev/shm")
            try:
                c = (make_controller(m, page, "file", {"file_storage_path": f"{d}/sglang"}) if mac is None else
                     make_controller(m, page, "dynamic", dynamic(f"file://{d}/hicache", **({"auth_key": mac} if mac else {}))))
                pool, b = c.mem_pool_host, c.storage_backend
                keys = get_storage_hash_str(list(range(2 * page)), None, page_size=page)
                src, dst = pool.alloc(2 * page), pool.alloc(2 * page)
                want = pool.get_data_page(int(src[0]), flat=True).clone().view(torch.uint8)
                assert c.page_set_func(keys, src)
                if mac is None:
                    path, other = (os.path.join(b.file_path, b._get_suffixed_key(k) + ".bin") for k in keys)
                    damage_file(kind, path, other)
                else:
                    h = page_key(keys[0])
                    path, other = str(b.store.path_of(h)), str(b.store.path_of(page_key(keys[1])))
                    sizes = [p.page_bytes for p in b.layout.planes]
                    if kind == "forged":
                        forge(path, b.layout.fingerprint(), h, sizes)
                    else:
                        damage_file(kind, path, other, codec.encode(OTHER_FP, h, sizes, os.urandom(sum(sizes)))
                                    if kind == "other_model" else None)
                try:
                    hits = c.page_get_func(PrefetchOperation("corrupt", []), keys[:1], dst[:page])
                except OSError:  # HiCacheFile raises on a short read: not loaded (its prefetch thread dies)
                    hits = 0
                got = pool.get_data_page(int(dst[0]), flat=True).view(torch.uint8)
                out.append((name, kind, int(hits >= 1), int(hits >= 1 and not torch.equal(got, want))))
                c.detach_storage_backend()
            finally:
                shutil.rmtree(d, ignore_errors=True)
    return out
