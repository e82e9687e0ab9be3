"""SGLang HiCache storage backend over any hicache L3 URL (``dynamic`` backend).

SGLang loads it with::

    --hicache-storage-backend dynamic
    --hicache-storage-backend-extra-config '{"backend_name": "hicache",
        "module_path": "hicache.integrations.sglang", "class_name": "HiCacheBackend",
        "interface_v1": 1, "url": "redis://host:6379/0"}'

Extra-config keys besides the factory's own: ``url`` (required), ``timeout_ms``,
``max_retries``, ``key_prefix``, ``auth_key`` / ``auth_key_file`` (the L3 MAC
secret; else the environment's ``HICACHE_STORAGE__AUTH_KEY`` /
``HICACHE_STORAGE__AUTH_KEY_FILE``: prefer those, SGLang logs its arguments),
``stats_window`` (how many per-call figures ``get_stats`` keeps between calls).
"""
from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Any, List, NamedTuple, Optional

import numpy as np
import torch
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
    PoolTransfer,
    PoolTransferResult,
)
from sglang.srt.mem_cache.pool_host.mamba import MambaPoolHost
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

from hicache.core.errors import ConfigError, IntegrityError
from hicache.integrations.metrics import AdapterMetrics, SglangStats, adapter_stats, sglang_stats, start_line, warnings_for
from hicache.integrations.sglang_keys import auth_key, page_key, sglang_layout
from hicache.integrations.sglang_pools import (
    KV_POOL,
    PageSegments,
    PoolVerdict,
    SidePool,
    SidePools,
    fold_hits,
    mamba_layout,
    page_bytes_of,
    side_timeout_ms,
)
from hicache.core.layout import KVLayout
from hicache.storage import StorageBackend, StorageStats, open_storage
from hicache.storage.into import wipe_unloaded
from hicache.storage.service import SCHEME as SERVICE_SCHEME

log = logging.getLogger(__name__)

# extra_config keys this backend reads (besides the factory's own).
_OPTIONS = ("url", "timeout_ms", "max_retries", "key_prefix", "auth_key", "auth_key_file", "stats_window")
# Per-call figures kept for get_stats() between two calls; SGLang calls it only with
# --enable-metrics (its storage metrics), so without a bound the lists would grow forever.
STATS_WINDOW = 1024
class _Segment(NamedTuple):
    offset: int  # byte offset in the host pool's kv_buffer
    size: int


class _Transfers:
    """Per-call page counts and bandwidths since the last ``get_stats`` (SGLang's
    StorageMetrics), the latest ``window`` calls of each kind: SGLang drains them
    only when its storage metrics are on, so older figures are dropped, not kept."""

    __slots__ = ("prefetch_pgs", "backup_pgs", "prefetch_bandwidth", "backup_bandwidth")

    def __init__(self, window: int):
        for name in self.__slots__:
            setattr(self, name, collections.deque(maxlen=window))  # bandwidths in GB/s


class HiCacheBackend(HiCacheStorage):
    """SGLang ``HiCacheStorage`` over a hicache L3 (file, memory, redis, cluster, service).

    Thread-safe: SGLang calls it from its prefetch and backup threads; the
    hicache storage backend is thread-safe and local counters sit behind a lock.
    Never raises on L3 failures: an outage turns into misses and failed writes.

    Inside SGLang: one INFO line at start through the ``hicache`` loggers (which
    propagate to the root logger SGLang configures), warnings rate-limited, and
    the ``hicache.integrations.metrics`` counters (``hicache_adapter_*{engine=
    "sglang"}``) on the process registry, which SGLang's ``/metrics`` serves
    through its multiprocess directory (``--enable-metrics``).

    SGLang's ``StorageBackendFactory`` builds ``HiCacheBackend(storage_config, {})``
    and its ``HiCacheController`` then calls ``register_mem_pool_host``; the L3
    store is opened there, because hicache's fingerprint is derived from the host
    pool (``sglang_keys.sglang_layout``).

    Keys: SGLang's page hash string is the key, mapped to hicache's 16-byte key
    space by BLAKE2b-128 (``sglang_keys.page_key``). Objects: hicache's codec (header with
    fingerprint, key and xxh3 checksum), verified on every read; a corrupt or
    foreign object is a miss that ends the hit, and its bytes never reach the
    host pool.

    Payload: a page's bytes in the order of ``host_pool.get_page_buffer_meta``
    (the order SGLang's zero-copy backends store; the host layout in the
    fingerprint names it), split into the ``KVLayout``'s plane sizes so that the
    node-local service (``hicache+unix://``) accepts it. The copying
    ``get``/``set`` produce the same bytes, so either path reads what the other
    wrote.

    Hybrid models (SGLang's ``HybridCacheController``): the v2 methods
    (``register_mem_host_pool_v2``, ``batch_exists_v2``, ``batch_get_v2``,
    ``batch_set_v2``) store the side pools of its ``HostPoolGroup`` (SWA KV pages,
    Mamba state slots) under per-pool keys and fingerprints, with SGLang's
    ``all_pages`` / ``trailing_pages`` hit policies; see
    ``hicache.integrations.sglang_pools``.

    Not implemented: the ``block_groups`` hit policy and DeepSeek-V4's compressed
    pools, pools without zero-copy page metadata (a Mamba pool with slot side
    states), anchors without a KV buffer of their own (the shared page-envelope
    arena), host layouts other than ``layer_first``/``page_first``/
    ``page_first_direct``, DCP shards (SGLang only allows file/Mooncake there) and
    ``page_head`` split heads across heterogeneous TP, and side pools through the
    node-local service (it serves one layout). Registering such a pool raises
    ``ConfigError``.
    """

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: Optional[dict] = None):
        extra = dict(storage_config.extra_config or {})
        url = extra.get("url")
        if not isinstance(url, str) or "://" not in url:
            raise ConfigError(f"hicache SGLang backend: extra config needs \"url\" (an L3 URL such as "
                              f"redis://host:6379/0 or file:///dir), got {url!r}; keys read: {_OPTIONS}")
        window = extra.get("stats_window", STATS_WINDOW)
        if not isinstance(window, int) or isinstance(window, bool) or window < 1:
            raise ConfigError(f"hicache SGLang backend: stats_window={window!r} must be an integer >= 1")
        self.storage_config = storage_config
        self.url = url
        self._open_opts = {k: extra[k] for k in ("timeout_ms", "max_retries", "key_prefix") if k in extra}
        self._open_opts["auth_key"] = auth_key(extra)
        self.stats_window = window
        self.layout: Optional[KVLayout] = None
        self.store: Optional[StorageBackend] = None
        self.mem_pool_host = None
        self._pool_bytes: Optional[np.ndarray] = None  # writable uint8 view of kv_buffer
        self._plane_sizes: list[int] = []
        self._lock = threading.Lock()
        self._transfers = _Transfers(window)
        self.skipped_writes = 0  # pages a non-writer MLA rank left to the writer
        self.lookups = self.lookup_hits = 0  # pages asked / found by batch_exists and exists
        self.is_writer = storage_config.is_storage_writer
        self.metrics = AdapterMetrics("sglang")
        self._warn = warnings_for(log)
        self.side = SidePools()  # v2 side pools (SWA, Mamba state, ...), each with its own store

    # ---------------------------------------------------------------- setup
    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Bind the host pool and open the L3 store for its layout. Raises ``ConfigError``."""
        layout = sglang_layout(mem_pool_host, self.storage_config)
        buf = mem_pool_host.kv_buffer
        if not buf.is_contiguous() or buf.device.type != "cpu":
            raise ConfigError(f"hicache SGLang backend: host kv_buffer must be one contiguous CPU tensor "
                              f"(device={buf.device}, contiguous={buf.is_contiguous()})")
        if self.store is not None:
            self.store.close()
        super().register_mem_pool_host(mem_pool_host)
        self.layout = layout
        self._plane_sizes = [p.page_bytes for p in layout.planes]
        self._pool_bytes = buf.view(-1).view(torch.uint8).numpy()
        if self._page_bytes() != layout.page_bytes:
            raise ConfigError(f"hicache SGLang backend: a {type(mem_pool_host).__name__} page holds "
                              f"{self._page_bytes()} bytes but layout {layout.model_id!r} describes "
                              f"{layout.page_bytes}")
        self.store = open_storage(self.url, fingerprint=layout.fingerprint(), layout=layout,
                                  **self._open_opts)
        pool = mem_pool_host
        start_line(log, "sglang", self.url, layout.fingerprint(),
                   f"host pool {pool.size // pool.page_size} pages of {pool.page_size} tokens x "
                   f"{layout.page_bytes} bytes ({layout.model_id}, {pool.layout}, TP rank "
                   f"{self.storage_config.tp_rank}/{self.storage_config.tp_size}"
                   f"{', MAC on' if self._open_opts['auth_key'] else ''})")

    def _require_store(self) -> StorageBackend:
        if self.store is None:
            raise RuntimeError("hicache SGLang backend: register_mem_pool_host() has not been called; "
                               "SGLang's HiCacheController calls it right after create_backend()")
        return self.store

    def _page_bytes(self) -> int:
        """Bytes of one page as ``get_page_buffer_meta`` describes it."""
        zero = torch.zeros(self.mem_pool_host.page_size, dtype=torch.int64)
        return sum(s.size for s in self._segments(1, zero)[0])

    def _segments(self, n_keys: int, host_indices: torch.Tensor) -> list[list[_Segment]]:
        """Per page, its byte ranges in kv_buffer, from ``get_page_buffer_meta``."""
        pool = self.mem_pool_host
        if host_indices.numel() != n_keys * pool.page_size:
            raise ValueError(f"{n_keys} keys need {n_keys * pool.page_size} host indices "
                             f"(page_size={pool.page_size}), got {host_indices.numel()}")
        ptrs, sizes = pool.get_page_buffer_meta(host_indices.cpu())
        per = len(ptrs) // n_keys
        assert per * n_keys == len(ptrs), (len(ptrs), n_keys)
        base, total = pool.kv_buffer.data_ptr(), self._pool_bytes.nbytes
        out = []
        for i in range(n_keys):
            segs = []
            for ptr, size in zip(ptrs[i * per:(i + 1) * per], sizes[i * per:(i + 1) * per]):
                off = ptr - base
                if off < 0 or off + size > total:
                    raise ValueError(f"page buffer [{ptr:#x}, +{size}) lies outside the host pool's "
                                     f"kv_buffer [{base:#x}, +{total})")
                segs.append(_Segment(off, int(size)))
            out.append(segs)
        return out

    # ---------------------------------------------------------- zero-copy v1
    def batch_get_v1(self, keys: List[str], host_indices: torch.Tensor,
                     extra_info: Optional[HiCacheStorageExtraInfo] = None) -> List[bool]:
        """Load verified pages straight into the host pool; ``True`` for the leading run loaded.

        Stops at the first miss (absent, corrupt, foreign, or L3 down): that page
        and every later one are ``False``. Pages are read into the pool's page
        segments and verified there; a page that failed is zeroed (a forger's
        bytes never stay in the pool), and SGLang frees the host indices of
        pages not loaded (see ``hicache.storage.into``).
        """
        store = self._require_store()
        if not keys:
            return []
        t0 = time.perf_counter()
        mv = memoryview(self._pool_bytes)
        dests = [[mv[s.offset:s.offset + s.size] for s in page] for page in self._segments(len(keys), host_indices)]
        got = store.get_into([page_key(k) for k in keys], self._plane_sizes, dests)
        wipe_unloaded(store.DIRECT_IO, dests, got)  # a refused page's bytes never stay in the host pool
        out = [False] * len(keys)
        for i, hit in enumerate(got):
            if not hit:
                break
            out[i] = True
        self._record("prefetch", sum(out), time.perf_counter() - t0)
        self.publish()
        return out

    def batch_set_v1(self, keys: List[str], host_indices: torch.Tensor,
                     extra_info: Optional[HiCacheStorageExtraInfo] = None) -> List[bool]:
        """Store pages from the host pool; per key, whether L3 now holds it.

        Pages L3 already holds are not rewritten. A non-writer TP rank of an
        MLA model writes nothing and answers ``True``: the writer rank stores
        the same bytes (SGLang's ``is_storage_writer``).
        """
        store = self._require_store()
        if not keys:
            return []
        if not self.is_writer:
            with self._lock:
                self.skipped_writes += len(keys)
            self.publish()
            return [True] * len(keys)
        t0 = time.perf_counter()
        segs = self._segments(len(keys), host_indices)
        hkeys = [page_key(k) for k in keys]
        mv = memoryview(self._pool_bytes)
        items = []
        for key, page in zip(hkeys, segs):
            parts = [mv[s.offset:s.offset + s.size] for s in page]
            # One segment is stored straight from the pool; several are joined (one copy).
            items.append((key, parts[0] if len(parts) == 1 else b"".join(parts), self._plane_sizes))
        # One call: L3 skips the pages it holds and answers, per page, whether it holds it now.
        out = store.put_new(items)
        if not all(out):
            self._warn.warning("put", "hicache SGLang backend: L3 %s took %d of %d pages; the rest are "
                               "recomputed when needed", self.store.name, sum(out), len(out))
        self._record("backup", len(items), time.perf_counter() - t0)
        self.publish()
        return out

    # ------------------------------------------------------------- copying API
    def _flat_to_payload(self, flat: torch.Tensor) -> torch.Tensor:
        """A flat data page (``get_data_page``) in the v1 byte order, as uint8."""
        pool = self.mem_pool_host
        if isinstance(pool, MHATokenToKVPoolHost) and pool.layout == "layer_first":
            # [2, L, page, H, D] -> [L, 2, page, H, D]: K and V of one layer side by side.
            flat = flat.view(2, pool.layer_num, -1).transpose(0, 1)
        return flat.contiguous().view(-1).view(torch.uint8)

    def _payload_into_flat(self, payload: memoryview, target: torch.Tensor) -> None:
        # numpy on this thread, from the payload itself: no staging copy, and no torch
        # intra-op threads for a page of MiBs (see HostPool.write_page).
        pool = self.mem_pool_host
        src = np.frombuffer(payload, dtype=np.uint8)
        dst = target.view(-1).view(torch.uint8).numpy()
        if isinstance(pool, MHATokenToKVPoolHost) and pool.layout == "layer_first":
            # [L, 2, page, H, D] (stored) -> [2, L, page, H, D] (flat data page)
            dst.reshape(2, pool.layer_num, -1)[:] = src.reshape(pool.layer_num, 2, -1).transpose(1, 0, 2)
            return
        dst[:] = src

    def batch_get(self, keys: List[str], target_locations: Optional[Any] = None,
                  target_sizes: Optional[Any] = None) -> List[Optional[torch.Tensor]]:
        """Verified pages as flat tensors (SGLang's flat data page), ``None`` per miss."""
        store = self._require_store()
        if not keys:
            return []
        targets = target_locations or [self.mem_pool_host.get_dummy_flat_data_page() for _ in keys]
        views = store.get([page_key(k) for k in keys], self._plane_sizes)
        out: List[Optional[torch.Tensor]] = []
        for view, target in zip(views, targets):
            if view is None or target.numel() * target.element_size() != view.nbytes:
                out.append(None)
                continue
            self._payload_into_flat(view, target)
            out.append(target)
        self.publish()
        return out

    def get(self, key: str, target_location: Optional[Any] = None,
            target_sizes: Optional[Any] = None) -> Optional[torch.Tensor]:
        return self.batch_get([key], [target_location] if target_location is not None else None)[0]

    def batch_set(self, keys: List[str], values: Optional[Any] = None,
                  target_locations: Optional[Any] = None, target_sizes: Optional[Any] = None) -> bool:
        """Store flat data pages; ``True`` when every one is stored."""
        store = self._require_store()
        if not self.is_writer:
            with self._lock:
                self.skipped_writes += len(keys)
            return True
        items = [(page_key(k), self._flat_to_payload(v).numpy(), self._plane_sizes)
                 for k, v in zip(keys, values)]
        ok = store.put(items) == len(items)
        self.publish()
        return ok

    def set(self, key: str, value: Optional[Any] = None, target_location: Optional[Any] = None,
            target_sizes: Optional[Any] = None) -> bool:
        return self.batch_set([key], [value])

    def exists(self, key: str) -> bool:
        found = self._require_store().exists([page_key(key)])[0]
        self._looked_up(1, int(found))
        return found

    def batch_exists(self, keys: List[str], extra_info: Optional[HiCacheStorageExtraInfo] = None) -> int:
        """How many leading keys L3 holds (stored, not yet verified: reads verify)."""
        n = self._require_store().prefix_hits([page_key(k) for k in keys])
        self._looked_up(len(keys), n)
        return n

    def _looked_up(self, asked: int, found: int) -> None:
        with self._lock:
            self.lookups += asked
            self.lookup_hits += found
        self.publish()

    # ------------------------------------------------------------ v2 side pools
    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        """Bind one pool of a hybrid model's ``HostPoolGroup`` and open its own L3 store.

        The ``kv`` entry is the anchor pool the v1 methods store (SGLang registers
        it first, through ``register_mem_pool_host``); every other pool (``swa``,
        ``mamba``, ...) gets a store of its own layout (see
        ``hicache.integrations.sglang_pools``). Raises ``ConfigError`` for a pool
        this backend cannot store, which fails SGLang's attach.
        """
        name = str(host_pool_name)
        if name == str(KV_POOL):
            if host_pool is not self.mem_pool_host:
                raise ConfigError("hicache SGLang backend: the v2 'kv' pool is not the host pool given to "
                                  "register_mem_pool_host(); SGLang registers its anchor pool there first")
            super().register_mem_host_pool_v2(host_pool, host_pool_name)
            return
        if self.url.partition("://")[0].lower() == SERVICE_SCHEME:
            raise ConfigError(f"hicache SGLang backend: side pool {name!r} of a hybrid model cannot go through the "
                              f"node-local service ({self.url}): it serves one layout, the KV pool's; use an "
                              "object store URL (file://, redis://, a Redis Cluster) for hybrid models")
        layout, segs = self._side_layout(host_pool, name)
        opts = {**self._open_opts,
                "timeout_ms": side_timeout_ms(layout.page_bytes, self._open_opts.get("timeout_ms"))}
        store = open_storage(self.url, fingerprint=layout.fingerprint(), layout=layout, **opts)
        super().register_mem_host_pool_v2(host_pool, host_pool_name)
        self.side.add(SidePool(name, layout, store, segs, replicated=isinstance(host_pool, MLATokenToKVPoolHost)))
        log.info("hicache SGLang backend: side pool %r, %d pages of %d bytes (%s), L3 fingerprint %s",
                 name, host_pool.size // host_pool.page_size, layout.page_bytes, layout.model_id,
                 layout.fingerprint())

    def _side_layout(self, host_pool: Any, name: str) -> tuple[KVLayout, PageSegments]:
        """A side pool's layout (its fingerprint names the pool) and its page segments."""
        segs, nbytes = page_bytes_of(host_pool, name)
        if isinstance(host_pool, MambaPoolHost):
            return mamba_layout(host_pool, name, self.storage_config, nbytes), segs
        base = sglang_layout(host_pool, self.storage_config)
        layout = base.replace(model_id=f"{base.model_id}:{name}")
        if layout.page_bytes != nbytes:
            raise ConfigError(f"hicache SGLang backend: a page of pool {name!r} holds {nbytes} bytes but "
                              f"layout {layout.model_id!r} describes {layout.page_bytes}")
        return layout, segs

    def batch_exists_v2(self, keys: List[str], pool_transfers: Optional[List[PoolTransfer]] = None,
                        extra_info: Optional[HiCacheStorageExtraInfo] = None) -> PoolTransferResult:
        """The longest prefix of ``keys`` that the KV pool and every pool of
        ``pool_transfers`` can resume from, under each transfer's hit policy
        (``sglang_pools.fold_hits``). A transfer's own keys are not looked up: only
        their count matters (``trailing_pages``); the pages are ``keys``' own.
        Stored, not yet verified: reads verify. Raises ``ValueError`` for a hit
        policy other than all_pages / trailing_pages."""
        store = self._require_store()
        kv = store.prefix_hits([page_key(k) for k in keys]) if keys else 0
        verdicts = []
        for t in pool_transfers or ():
            if str(t.name) == str(KV_POOL):
                continue
            if self.side.get(t.name) is None:
                self._warn.warning("v2-pool", "hicache SGLang backend: pool %r was never registered "
                                   "(register_mem_host_pool_v2); its pages count as missing", str(t.name))
            verdicts.append(PoolVerdict(t.name, t.hit_policy, len(t.keys or ()), self.side.exists(t.name, keys[:kv])))
        out = fold_hits(kv, verdicts)
        self._looked_up(len(keys), out.kv_hit_pages)
        return out

    def batch_get_v2(self, transfers: List[PoolTransfer],
                     extra_info: Optional[HiCacheStorageExtraInfo] = None) -> dict[Any, List[bool]]:
        """Per pool, load its keys' verified pages into its host indices: ``True`` for
        the leading run loaded (absent, corrupt, foreign or L3 down ends it, as in
        ``batch_get_v1``). A ``kv`` transfer is the v1 read."""
        return self._v2("prefetch", transfers)

    def batch_set_v2(self, transfers: List[PoolTransfer],
                     extra_info: Optional[HiCacheStorageExtraInfo] = None) -> dict[Any, List[bool]]:
        """Per pool, store its keys' pages from its host indices; per key, whether L3
        now holds it. A pool replicated across TP ranks (MLA) is stored by the
        writer rank only, as in ``batch_set_v1``."""
        return self._v2("backup", transfers)

    def _v2(self, kind: str, transfers: List[PoolTransfer]) -> dict[Any, List[bool]]:
        self._require_store()
        out: dict[Any, List[bool]] = {}
        for t in transfers:
            keys = list(t.keys or ())
            if str(t.name) == str(KV_POOL):
                v1 = self.batch_get_v1 if kind == "prefetch" else self.batch_set_v1
                out[t.name] = v1(keys, t.host_indices) if keys else []
            else:
                out[t.name] = self._side_io(kind, t, keys)
        self.publish()
        return out

    def _side_io(self, kind: str, t: PoolTransfer, keys: List[str]) -> List[bool]:
        pool = self.side.get(t.name)
        if pool is None or not keys:
            if keys:
                self._warn.warning("v2-pool", "hicache SGLang backend: pool %r was never registered "
                                   "(register_mem_host_pool_v2); %s of %d pages fails", str(t.name), kind, len(keys))
            return [False] * len(keys)
        if kind == "backup" and pool.replicated and not self.is_writer:
            with self._lock:
                self.skipped_writes += len(keys)
            return [True] * len(keys)
        want = len(keys) * pool.segments.host_pool.page_size
        if t.host_indices is None or t.host_indices.numel() != want:
            # What SGLang's file backend does (its controller relies on it): nothing moves.
            got = None if t.host_indices is None else t.host_indices.numel()
            self._warn.warning("v2-indices", "hicache SGLang backend: %s of pool %r refused: %d keys need %d "
                               "host indices, got %s", kind, pool.name, len(keys), want, got)
            return [False] * len(keys)
        t0 = time.perf_counter()
        ok = (self.side.read if kind == "prefetch" else self.side.write)(pool, keys, t.host_indices)
        if kind == "backup" and not all(ok):
            self._warn.warning("put", "hicache SGLang backend: L3 %s took %d of %d pages of pool %r; the rest "
                               "are recomputed when needed", pool.store.name, sum(ok), len(ok), pool.name)
        self._record(kind, sum(ok), time.perf_counter() - t0, pool.layout.page_bytes)
        return ok

    # ------------------------------------------------------------------ admin
    def clear(self) -> bool:
        """Delete this layout's pages and its side pools' (other layouts and TP ranks
        are untouched)."""
        kv = self._require_store().clear() is not None
        return self.side.clear() and kv

    def _record(self, kind: str, pages: int, seconds: float, page_bytes: int = 0) -> None:
        if pages <= 0:
            return
        gb = pages * (page_bytes or self.layout.page_bytes) / 1e9
        with self._lock:
            getattr(self._transfers, f"{kind}_pgs").append(pages)
            getattr(self._transfers, f"{kind}_bandwidth").append(gb / max(seconds, 1e-9))

    def get_stats(self):
        """SGLang's ``StorageMetrics`` for the calls since the last ``get_stats`` (drains
        them; at most ``stats_window`` of each kind, the latest)."""
        from sglang.srt.observability.metrics_collector import StorageMetrics

        with self._lock:
            t, self._transfers = self._transfers, _Transfers(self.stats_window)
        return StorageMetrics(prefetch_pgs=list(t.prefetch_pgs), backup_pgs=list(t.backup_pgs),
                              prefetch_bandwidth=list(t.prefetch_bandwidth),
                              backup_bandwidth=list(t.backup_bandwidth))

    def adapter_stats(self) -> SglangStats:
        """This backend's counters as ``hicache.integrations.metrics`` declares them:
        every pool's store summed, and each pool's own (``kv``: the v1 KV pool)."""
        store = self._require_store()
        with self._lock:
            own = dict(lookups=self.lookups, lookup_hits=self.lookup_hits, skipped=self.skipped_writes)
        by_pool = {str(KV_POOL): adapter_stats(store, **own)}
        by_pool.update((str(pool.name), adapter_stats(pool.store)) for pool in self.side.all())
        return sglang_stats(by_pool)

    def publish(self) -> None:
        """Bring the ``hicache_adapter_*`` counters up to date (called after every batch call)."""
        if self.store is not None:
            self.metrics.update(self.adapter_stats())

    def hicache_stats(self) -> StorageStats:
        """hicache's L3 counters (hits, misses, corrupt, fingerprint mismatches, drops)."""
        return self._require_store().stats()

    def pool_stats(self, name: Any) -> StorageStats:
        """The L3 counters of one pool (``kv``: ``hicache_stats()``). Raises ``KeyError``
        for a pool never registered."""
        if str(name) == str(KV_POOL):
            return self.hicache_stats()
        pool = self.side.get(name)
        if pool is None:
            raise KeyError(f"hicache SGLang backend: no side pool {str(name)!r}; registered: "
                           f"{[p.name for p in self.side.all()]}")
        return pool.store.stats()

    def close(self) -> None:
        if self.store is not None:
            self.store.close()
        self.side.close()

    def check_integrity(self) -> None:
        """The store verifies (counters and, where it can list, every object), and
        this backend still describes its pool. Raises ``IntegrityError``."""
        store = self._require_store()
        store.check_integrity()
        now = sglang_layout(self.mem_pool_host, self.storage_config)
        if now.fingerprint() != store.fingerprint or now.fingerprint() != self.layout.fingerprint():
            raise IntegrityError(f"hicache SGLang backend: pool layout {now.model_id!r} fingerprint "
                                 f"{now.fingerprint()} != store's {store.fingerprint}")
        if self._pool_bytes.ctypes.data != self.mem_pool_host.kv_buffer.data_ptr():
            raise IntegrityError("hicache SGLang backend: the host pool's kv_buffer moved since "
                                 "register_mem_pool_host(); register it again")
        with self._lock:
            held = [len(q) for q in (self._transfers.prefetch_pgs, self._transfers.backup_pgs,
                                     self._transfers.prefetch_bandwidth, self._transfers.backup_bandwidth)]
            if max(held) > self.stats_window or self.lookup_hits > self.lookups:
                raise IntegrityError(f"hicache SGLang backend: {held} per-call figures held (window "
                                     f"{self.stats_window}), lookups {self.lookup_hits}/{self.lookups}")
        self.metrics.check_integrity()
        self.side.check_integrity(lambda host_pool, name: self._side_layout(host_pool, name)[0])
        if self._page_bytes() != self.layout.page_bytes or self._plane_sizes != [
                p.page_bytes for p in self.layout.planes]:
            raise IntegrityError(f"hicache SGLang backend: pool pages of {self._page_bytes()} bytes, "
                                 f"planes {self._plane_sizes[:4]}... disagree with layout "
                                 f"{self.layout.model_id!r} ({self.layout.page_bytes} bytes)")
