"""What SGLang's KV host-pool pages are to hicache: the ``KVLayout`` whose
fingerprint tags them (``sglang_layout``), the 16-byte L3 key of each SGLang
page hash (``page_key``: BLAKE2b-128 of the hash string) and the L3 MAC secret
the backend opens its store with (``auth_key``). Used by
``hicache.integrations.sglang.HiCacheBackend``; pure functions, no state.
"""
from __future__ import annotations

import hashlib
import os
from typing import Any, Mapping

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

from hicache.core.errors import ConfigError
from hicache.core.hashing import HASH_BYTES
from hicache.integrations.sglang_pools import pool_tag
from hicache.core.layout import KVLayout
from hicache.core.types import PageHash

__all__ = ["AUTH_ENV", "SUPPORTED_LAYOUTS", "auth_key", "page_key", "sglang_layout"]

SUPPORTED_LAYOUTS = ("layer_first", "page_first", "page_first_direct")
AUTH_ENV = ("HICACHE_STORAGE__AUTH_KEY", "HICACHE_STORAGE__AUTH_KEY_FILE")
_DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32",
                torch.uint8: "uint8", torch.float8_e4m3fn: "float8_e4m3fn",
                torch.float8_e5m2: "float8_e5m2"}



def page_key(sglang_hash: str) -> PageHash:
    """hicache's 16-byte L3 key for one SGLang page hash string."""
    return PageHash(hashlib.blake2b(sglang_hash.encode(), digest_size=HASH_BYTES).digest())


def sglang_layout(host_pool: Any, config: HiCacheStorageConfig) -> KVLayout:
    """The ``KVLayout`` whose fingerprint tags this pool's pages.

    ``model_id`` carries the model name, the SGLang host layout (it decides
    the byte order of a stored page) and the PP stage / attention-CP rank
    when those shard a page. MHA pages carry the TP rank (each rank holds
    other heads); MLA pages are replicated across TP ranks, so every rank
    gets one fingerprint and shares one object per page.
    Raises ``ConfigError`` for a pool this backend does not support.
    """
    layout = getattr(host_pool, "layout", None)
    if layout not in SUPPORTED_LAYOUTS:
        raise ConfigError(f"hicache SGLang backend: host layout {layout!r} is not supported; "
                          f"start SGLang with --hicache-mem-layout one of {SUPPORTED_LAYOUTS}")
    if getattr(host_pool, "kv_buffer", None) is None:
        raise ConfigError(f"hicache SGLang backend: {type(host_pool).__name__} has no materialized "
                          "kv_buffer (a logical anchor pool over a shared page arena); this backend "
                          "stores an anchor KV pool of its own beside v2 side pools")
    if config.dcp_size > 1:
        raise ConfigError(f"hicache SGLang backend: decode context parallel (dcp_size="
                          f"{config.dcp_size}) is not supported")
    dtype = _DTYPE_NAMES.get(host_pool.dtype)
    if dtype is None:
        raise ConfigError(f"hicache SGLang backend: KV dtype {host_pool.dtype} is not supported; "
                          f"known: {sorted(_DTYPE_NAMES.values())}")
    common = dict(model_id=pool_tag(config, layout), num_layers=host_pool.layer_num, dtype=dtype,
                  page_size=host_pool.page_size,
                  host_layout="layer_first" if layout == "layer_first" else "page_first")
    if isinstance(host_pool, MLATokenToKVPoolHost):
        return KVLayout(kind="mla", kv_lora_rank=host_pool.kv_lora_rank,
                        rope_dim=host_pool.kv_cache_dim - host_pool.kv_lora_rank, **common)
    if type(host_pool) is MHATokenToKVPoolHost:
        if host_pool.v_head_dim != host_pool.head_dim:
            raise ConfigError(f"hicache SGLang backend: MHA head_dim={host_pool.head_dim} != "
                              f"v_head_dim={host_pool.v_head_dim} is not supported")
        return KVLayout(kind="mha", num_kv_heads=host_pool.head_num, head_dim=host_pool.head_dim,
                        tp_rank=config.tp_rank, tp_size=config.tp_size, **common)
    raise ConfigError(f"hicache SGLang backend: host pool {type(host_pool).__name__} is not supported; "
                      "use an MHA (MHATokenToKVPoolHost) or MLA (MLATokenToKVPoolHost) model")


def auth_key(extra: Mapping[str, Any], env: Mapping[str, str] = os.environ) -> bytes:
    """The L3 MAC secret: ``auth_key`` / ``auth_key_file`` of the extra config, else the
    environment's ``HICACHE_STORAGE__AUTH_KEY`` / ``..._FILE``; b"" for none.
    Resolved as hicache's own ``storage`` section does. Raises ``ConfigError``."""
    from hicache.core.config import StorageConfig
    key, path = extra.get("auth_key"), extra.get("auth_key_file")
    if key is None and path is None:
        key, path = env.get(AUTH_ENV[0]), env.get(AUTH_ENV[1])
    for name, v in (("auth_key", key), ("auth_key_file", path)):
        if v is not None and not isinstance(v, str):
            raise ConfigError(f"hicache SGLang backend: {name} must be a string, got {type(v).__name__}")
    return StorageConfig(url="", auth_key=key or "", auth_key_file=path or "").resolved_auth_key()
