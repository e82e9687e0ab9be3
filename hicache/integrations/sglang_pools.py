"""SGLang's v2 hybrid-pool storage: side pools (SWA, Mamba state, ...) beside the KV pool.

SGLang's ``HybridCacheController`` keeps a hybrid model's cache in several host
pools (a ``HostPoolGroup``): the KV anchor pool, which the v1 methods store,
and side pools registered with ``register_mem_host_pool_v2``: the sliding-window
layers' KV (``swa``, one page per KV page) and the recurrent state (``mamba``,
one state slot per node end, ``page_size`` 1). This module stores side pools:
"""
from __future__ import annotations

import bisect
import dataclasses
import hashlib
import threading
from typing import Any, Callable, List, NamedTuple, Optional, Sequence

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig, PoolHitPolicy, PoolName, PoolTransferResult
from sglang.srt.mem_cache.pool_host.mamba import MambaPoolHost

from hicache.core.errors import ConfigError, IntegrityError
from hicache.core.hashing import HASH_BYTES
from hicache.core.layout import KVLayout
from hicache.storage import StorageBackend, StorageStats
from hicache.storage.into import wipe_unloaded
from hicache.storage.capacity import StorageOptions
from hicache.core.types import PageHash

KV_POOL = PoolName.KV  # the anchor pool, stored by the v1 methods
# A side pool's per-page timeout covers one of its pages moved at this rate: a
# Qwen3-Next state slot is 74 MiB (1.5 s at 50 MB/s). With the default 50 ms per
# page every such write to file:// timed out on the 2-core test machine, where
# writes of that slot measured 150 MiB/s (median of 5: one join copy, xxh3, the
# write) and reads 2.4 GiB/s; 50 MB/s leaves 3x for a loaded disk or network.
SLOW_PAGE_BYTES_PER_S = 50e6
DEFAULT_TIMEOUT_MS: int = next(f.default for f in dataclasses.fields(StorageOptions) if f.name == "timeout_ms")


def side_timeout_ms(page_bytes: int, configured: int | None) -> int:
    """The per-page timeout of a side pool's store: the configured one (or the
    default), raised to what one page needs at ``SLOW_PAGE_BYTES_PER_S``."""
    return max(configured or DEFAULT_TIMEOUT_MS, -(-page_bytes * 1000 // int(SLOW_PAGE_BYTES_PER_S)))


def pool_key(pool: str, sglang_hash: str) -> PageHash:
    """hicache's 16-byte L3 key for one page of side pool ``pool``."""
    return PageHash(hashlib.blake2b(f"{pool}/{sglang_hash}".encode(), digest_size=HASH_BYTES).digest())


def pool_tag(config: HiCacheStorageConfig, host_layout: str) -> str:
    """The ``model_id`` of a pool's layout: model, SGLang host layout, PP stage, attention-CP rank."""
    tag = f"{config.model_name or 'unnamed'}#sglang:{host_layout}"
    if config.pp_size > 1:
        tag += f":pp{config.pp_rank}/{config.pp_size}"
    if config.attn_cp_size > 1:
        tag += f":cp{config.attn_cp_rank}/{config.attn_cp_size}"
    return tag


def mamba_layout(host_pool: MambaPoolHost, name: str, config: HiCacheStorageConfig, page_bytes: int) -> KVLayout:
    """The layout of a Mamba state pool: one opaque row per state slot, described
    by its tensors. Mamba state is TP-sharded (every rank its own heads), so the
    TP rank is in the fingerprint even for MLA models."""
    engine = {"pool": name, "layers": host_pool.num_mamba_layers, "layout": host_pool.layout,
              "temporal": [list(host_pool.temporal_state_shape), str(host_pool.temporal_dtype)],
              "conv": [[list(s), str(host_pool.conv_dtype)] for s in host_pool.conv_state_shapes],
              "order": "temporal,conv"}
    return KVLayout.rows(f"{pool_tag(config, host_pool.layout)}:{name}", page_bytes, engine,
                         tp_rank=config.tp_rank, tp_size=config.tp_size)


# ------------------------------------------------------------------- hits
class PoolVerdict(NamedTuple):
    """What one side pool holds for the pages of a lookup (see ``fold_hits``)."""

    name: Any  # SGLang's PoolName (a str)
    policy: PoolHitPolicy
    trailing: int  # trailing_pages: pages that must precede a boundary (the transfer's key count)
    present: Sequence[bool]  # per page of the KV hit, whether the pool holds it


def _restorable(v: PoolVerdict, kv_pages: int) -> set[int]:
    if len(v.present) != kv_pages:
        raise ValueError(f"pool {v.name!r}: {len(v.present)} presence flags for a KV hit of {kv_pages} pages")
    if v.policy == PoolHitPolicy.ALL_PAGES:
        end = next((i for i, p in enumerate(v.present) if not p), kv_pages)
        return set(range(1, end + 1))
    if v.policy == PoolHitPolicy.TRAILING_PAGES:
        n = max(1, v.trailing)
        return {b for b in range(1, kv_pages + 1) if all(v.present[max(0, b - n):b])}
    policy = getattr(v.policy, "value", v.policy)
    raise ValueError(f"hicache SGLang backend: pool {str(v.name)!r} asks hit policy {policy!r}; supported: "
                     f"{PoolHitPolicy.ALL_PAGES.value!r}, {PoolHitPolicy.TRAILING_PAGES.value!r} (SWA and Mamba pools)")


def fold_hits(kv_pages: int, verdicts: Sequence[PoolVerdict]) -> PoolTransferResult:
    """SGLang's v2 hit: the longest prefix (in pages) resumable in every pool. Pure.

    ``kv_pages``: the KV pool's contiguous hit. Each side pool restricts the
    boundaries it can resume from; the result keeps their intersection
    (``restorable_prefix_pages``, which SGLang reduces across ranks), its
    largest member as ``kv_hit_pages``, and each pool's own largest boundary in
    ``extra_pool_hit_pages`` (absent for a pool with none). Raises
    ``ValueError`` for a hit policy other than all_pages / trailing_pages.
    """
    restorable = set(range(1, kv_pages + 1))
    hits: dict[Any, int] = {KV_POOL: kv_pages} if kv_pages else {}
    for v in verdicts:
        own = _restorable(v, kv_pages)
        if own:
            hits[v.name] = max(own)
        restorable &= own
    ordered = sorted(restorable)
    return PoolTransferResult(ordered[-1] if ordered else 0, hits, ordered)


# ------------------------------------------------------------------ bytes
def _buffers(host_pool: Any) -> list[torch.Tensor]:
    bufs = host_pool.kv_buffer
    return list(bufs) if isinstance(bufs, (list, tuple)) else [bufs]


class PageSegments:
    """A host pool's pages as writable memoryviews of its buffers, from
    ``get_page_buffer_meta`` (several buffers: a Mamba pool's temporal and
    conv states). The views stay valid while the pool's buffers do
    (``moved()`` says when they no longer are)."""

    def __init__(self, host_pool: Any, name: str):
        bufs = _buffers(host_pool)
        for b in bufs:
            if not b.is_contiguous() or b.device.type != "cpu":
                raise ConfigError(f"hicache SGLang backend: pool {name!r} buffers must be contiguous CPU tensors "
                                  f"(device={b.device}, contiguous={b.is_contiguous()})")
        self.host_pool, self.name = host_pool, name
        spans = sorted((b.data_ptr(), b.view(-1).view(torch.uint8).numpy()) for b in bufs)
        self._starts = [s for s, _ in spans]
        self._views = [memoryview(a) for _, a in spans]

    def moved(self) -> bool:
        return sorted(b.data_ptr() for b in _buffers(self.host_pool)) != self._starts

    def _view(self, ptr: int, size: int) -> memoryview:
        i = bisect.bisect_right(self._starts, ptr) - 1
        off = ptr - self._starts[i] if i >= 0 else -1
        if off < 0 or off + size > self._views[i].nbytes:
            raise ValueError(f"pool {self.name!r}: page buffer [{ptr:#x}, +{size}) lies outside its host buffers")
        return self._views[i][off:off + size]

    def pages(self, n_keys: int, host_indices: torch.Tensor) -> list[list[memoryview]]:
        """Per page, its byte ranges. Raises ``ValueError`` when ``host_indices`` does
        not hold ``n_keys`` pages of the pool or a range lies outside its buffers."""
        ps = self.host_pool.page_size
        if host_indices is None or host_indices.numel() != n_keys * ps:
            got = None if host_indices is None else host_indices.numel()
            raise ValueError(f"pool {self.name!r}: {n_keys} keys need {n_keys * ps} host indices "
                             f"(page_size={ps}), got {got}")
        ptrs, sizes = self.host_pool.get_page_buffer_meta(host_indices.cpu())
        per = len(ptrs) // max(n_keys, 1)
        assert per * n_keys == len(ptrs), (self.name, len(ptrs), n_keys)
        return [[self._view(p, int(s)) for p, s in zip(ptrs[i * per:(i + 1) * per], sizes[i * per:(i + 1) * per])]
                for i in range(n_keys)]

    def page_bytes(self) -> int:
        """Bytes of one page of the pool (from its first page's ranges)."""
        zero = torch.zeros(self.host_pool.page_size, dtype=torch.int64)
        return sum(v.nbytes for v in self.pages(1, zero)[0])


class SidePool(NamedTuple):
    """One registered side pool and its own L3 store."""

    name: str
    layout: KVLayout
    store: StorageBackend
    segments: PageSegments
    replicated: bool  # every TP rank holds the same bytes (MLA): only the writer rank stores

    @property
    def plane_sizes(self) -> list[int]:
        return [p.page_bytes for p in self.layout.planes]


class SidePools:
    """The side pools of one SGLang backend, by pool name. Thread-safe (SGLang's
    backup and prefetch threads call it; the stores are thread-safe).

    * **Keys**: ``pool_key(pool name, SGLang page hash)``, BLAKE2b-128 of
      ``"<pool>/<hash>"``; a KV key is the hash alone (``page_key``), and SGLang's
      hashes are hex, so no side-pool key equals a KV key.
    * **Fingerprints**: every side pool opens its own store with its own layout
      (``pool_tag`` names the pool; a Mamba page is a ``KVLayout.rows`` page whose
      ``engine_layout`` lists its state tensors), so a Mamba state page and a KV
      page never alias, and an object of one pool read as another's is a counted
      fingerprint mismatch (a miss).
    * **Hits** (``fold_hits``): SGLang's v2 hit policies, as its built-in ``file``
      backend folds them: the usable prefix ends at a page boundary where the KV
      pool holds every page and each side pool holds what its policy needs there
      (``all_pages``: every page up to it; ``trailing_pages``: the last ``n`` pages
      before it, ``n`` = the transfer's key count). What the KV pool holds but a
      side pool lacks is a miss.
    * **Bytes**: a page's bytes in the order of the pool's ``get_page_buffer_meta``
      (zero-copy, read and verified in place, like v1).
    """

    def __init__(self) -> None:
        self._pools: dict[str, SidePool] = {}
        self._lock = threading.Lock()

    def add(self, pool: SidePool) -> None:
        """Bind ``pool`` (replacing, and closing the store of, one of the same name)."""
        with self._lock:
            old = self._pools.get(pool.name)
            self._pools[pool.name] = pool
        if old is not None and old.store is not pool.store:
            old.store.close()

    def get(self, name: str) -> Optional[SidePool]:
        with self._lock:
            return self._pools.get(str(name))

    def all(self) -> list[SidePool]:
        with self._lock:
            return list(self._pools.values())

    def exists(self, name: str, keys: Sequence[str]) -> list[bool]:
        """Per key, whether the pool's store holds it (not verified: reads verify).
        All ``False`` for a pool never registered."""
        pool = self.get(name)
        if pool is None or not keys:
            return [False] * len(keys)
        return pool.store.exists([pool_key(pool.name, k) for k in keys])

    def read(self, pool: SidePool, keys: List[str], host_indices: torch.Tensor) -> list[bool]:
        """Load verified pages into the pool; ``True`` for the leading run loaded (a
        miss, corrupt or foreign object ends it; see ``HiCacheBackend.batch_get_v1``)."""
        dests = pool.segments.pages(len(keys), host_indices)
        got = pool.store.get_into([pool_key(pool.name, k) for k in keys], pool.plane_sizes, dests)
        wipe_unloaded(pool.store.DIRECT_IO, dests, got)  # a refused page's bytes never stay in the pool
        run = next((i for i, ok in enumerate(got) if not ok), len(got))
        return [i < run for i in range(len(keys))]

    def write(self, pool: SidePool, keys: List[str], host_indices: torch.Tensor) -> list[bool]:
        """Store pages from the pool; per key, whether L3 now holds it."""
        items = []
        for key, parts in zip(keys, pool.segments.pages(len(keys), host_indices)):
            payload = parts[0] if len(parts) == 1 else b"".join(parts)
            items.append((pool_key(pool.name, key), payload, pool.plane_sizes))
        return pool.store.put_new(items)

    def stats(self) -> dict[str, StorageStats]:
        return {p.name: p.store.stats() for p in self.all()}

    def clear(self) -> bool:
        return all(p.store.clear() is not None for p in self.all())

    def close(self) -> None:
        for p in self.all():
            p.store.close()

    def check_integrity(self, layout_of: Callable[[Any, str], KVLayout]) -> None:
        """Each store verifies, each pool still has the layout its store was opened
        with (``layout_of(host_pool, name)``) and its buffers have not moved.
        Raises ``IntegrityError``."""
        for p in self.all():
            p.store.check_integrity()
            now = layout_of(p.segments.host_pool, p.name)
            if now.fingerprint() != p.store.fingerprint or now.fingerprint() != p.layout.fingerprint():
                raise IntegrityError(f"hicache SGLang backend: pool {p.name!r} layout {now.model_id!r} "
                                     f"fingerprint {now.fingerprint()} != its store's {p.store.fingerprint}")
            if p.segments.moved():
                raise IntegrityError(f"hicache SGLang backend: pool {p.name!r} buffers moved since "
                                     "register_mem_host_pool_v2(); register it again")
            if p.segments.page_bytes() != p.layout.page_bytes or sum(p.plane_sizes) != p.layout.page_bytes:
                raise IntegrityError(f"hicache SGLang backend: pool {p.name!r} pages of "
                                     f"{p.segments.page_bytes()} bytes, layout {p.layout.page_bytes}")


def page_bytes_of(host_pool: Any, name: str) -> tuple[PageSegments, int]:
    """The pool's segments and page bytes. Raises ``ConfigError`` for a pool whose
    pages ``get_page_buffer_meta`` cannot describe (e.g. a Mamba pool with slot
    side states, or a layout without zero-copy metadata)."""
    segs = PageSegments(host_pool, name)
    try:
        return segs, segs.page_bytes()
    except (NotImplementedError, ValueError) as e:
        raise ConfigError(f"hicache SGLang backend: pool {name!r} ({type(host_pool).__name__}, layout "
                          f"{getattr(host_pool, 'layout', None)!r}) has no zero-copy page metadata: {e}") from None
