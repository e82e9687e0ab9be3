"""One typed configuration for the whole system.

Precedence (highest first): CLI overrides (``--set section.key=value``),
environment variables (``HICACHE_<SECTION>__<KEY>``, e.g.
``HICACHE_STORAGE__URL=redis://127.0.0.1:6379/0``), a TOML file
(``--config FILE`` or ``HICACHE_CONFIG``), then the defaults below, which run
everything embedded with no external service.
"""
from __future__ import annotations

import os
import tomllib
from pathlib import Path
from typing import Any, Literal, Mapping

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from hicache.errors import ConfigError, LayoutError
from hicache.layout import BytePlane, KVLayout


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelConfig(_Section):
    """The KV layout (see ``KVLayout``). Defaults: a tiny demo model."""

    model_id: str = "hicache-demo-tiny"
    num_layers: int = 4
    kind: Literal["mha", "mla"] = "mha"
    num_kv_heads: int = 2
    head_dim: int = 32
    kv_lora_rank: int = 0
    rope_dim: int = 0
    dtype: str = "float32"
    page_size: int = 16
    extra_planes: list[tuple[str, int]] = Field(default_factory=list)
    draft_layers: int = 0
    tp_rank: int = 0
    tp_size: int = 1
    cp_rank: int = 0
    cp_size: int = 1
    host_layout: Literal["layer_first", "page_first"] = "page_first"

    def to_layout(self) -> KVLayout:
        d = self.model_dump()
        d["extra_planes"] = tuple(BytePlane(n, b) for n, b in d["extra_planes"])
        return KVLayout(**d)


class PoolConfig(_Section):
    device: str = "auto"  # "auto" = cuda:0 when available, else cpu
    # Sized for the built-in demo: L1 smaller than the replay's working set,
    # L2 larger than it (so L2 and L3 have something to do).
    device_pages: int = Field(128, ge=1)
    host_pages: int = Field(2048, ge=1)


class StorageConfig(_Section):
    # L3 backend URL: "" (no L3), memory://, file:///dir, redis://host:port/db,
    # rediss://..., redis+cluster://host:port[,host:port...]
    url: str = "file://./.hicache/l3"
    timeout_ms: int = Field(50, ge=1)  # a lookup that takes longer answers "miss"
    max_retries: int = Field(2, ge=0)


class PolicyConfig(_Section):
    write_policy: Literal["write_through", "write_through_selective", "write_back"] = "write_through"
    write_through_threshold: int = Field(2, ge=1)  # hits before a selective backup
    device_eviction: str = "lru"
    host_eviction: str = "lru"
    prefetch_policy: Literal["best_effort", "wait_complete", "timeout"] = "timeout"
    prefetch_timeout_base_ms: float = Field(5.0, ge=0)
    prefetch_timeout_per_1k_tokens_ms: float = Field(2.0, ge=0)
    prefetch_timeout_cap_ms: float = Field(200.0, ge=0)
    storage_hit_min_pages: int = Field(1, ge=1)  # smaller L3 hits are not worth a prefetch

    @field_validator("device_eviction", "host_eviction")
    @classmethod
    def _known_eviction(cls, v: str) -> str:
        from hicache.eviction import POLICIES
        if v not in POLICIES:
            raise ValueError(f"unknown eviction policy {v!r}; known: {sorted(POLICIES)}")
        return v


class ServiceConfig(_Section):
    host: str = "127.0.0.1"
    port: int = Field(8177, ge=0, le=65535)
    socket_path: str = "/tmp/hicache.sock"
    admin_token: str = ""  # required when host is not loopback
    admin_token_file: str = ""  # read the token from this file (Compose/K8s secret) when admin_token is ""
    shm_name: str = "hicache-l2"
    max_request_bytes: int = Field(8 << 20, ge=1024)


class HiCacheConfig(BaseSettings):
    """The whole configuration; build with ``HiCacheConfig.load``."""

    model_config = SettingsConfigDict(env_prefix="HICACHE_", env_nested_delimiter="__",
                                      extra="forbid", frozen=True)

    model: ModelConfig = ModelConfig()
    pool: PoolConfig = PoolConfig()
    storage: StorageConfig = StorageConfig()
    policy: PolicyConfig = PolicyConfig()
    service: ServiceConfig = ServiceConfig()
    log_level: str = "WARNING"

    @field_validator("log_level")
    @classmethod
    def _level(cls, v: str) -> str:
        v = v.upper()
        if v not in ("DEBUG", "INFO", "WARNING", "ERROR"):
            raise ValueError("must be DEBUG, INFO, WARNING or ERROR")
        return v

    @classmethod
    def settings_customise_sources(cls, settings_cls, init_settings, env_settings,
                                   dotenv_settings, file_secret_settings):
        # ``load`` merges file < env < overrides itself and passes the result in,
        # so the precedence lives in one place.
        return (init_settings,)

    @classmethod
    def load(cls, file: str | os.PathLike | None = None, overrides: Mapping[str, Any] | None = None,
             env: Mapping[str, str] | None = None) -> "HiCacheConfig":
        """Resolve file < env < overrides, validate everything, raise ``ConfigError``.

        ``overrides`` maps dotted keys (``"storage.url"``) to values.
        ``env`` defaults to ``os.environ``.
        """
        env = os.environ if env is None else env
        file = file or env.get("HICACHE_CONFIG") or None
        data: dict[str, Any] = {}
        if file:
            try:
                data = tomllib.loads(Path(file).read_text())
            except FileNotFoundError:
                raise ConfigError(f"config file {str(file)!r} does not exist; fix --config or HICACHE_CONFIG")
            except tomllib.TOMLDecodeError as e:
                raise ConfigError(f"config file {str(file)!r} is not valid TOML: {e}")
        # env beats file: merge env explicitly so the file sits below it.
        _deep_merge(data, _env_tree(env))
        for key, value in (overrides or {}).items():
            _set_dotted(data, key, value)
        try:
            cfg = cls(**data)
            cfg.layout()  # validate the layout too
        except ValidationError as e:
            raise ConfigError(_explain(e)) from None
        except LayoutError as e:
            raise ConfigError(f"[model] {e}") from None
        return cfg

    def layout(self) -> KVLayout:
        return self.model.to_layout()

    def resolved_device(self) -> str:
        if self.pool.device != "auto":
            return self.pool.device
        import torch
        return "cuda:0" if torch.cuda.is_available() else "cpu"


def _env_tree(env: Mapping[str, str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in env.items():
        if not k.startswith("HICACHE_") or k == "HICACHE_CONFIG":
            continue
        path = k[len("HICACHE_"):].lower().split("__")
        _set_dotted(out, ".".join(path), v)
    return out


def _set_dotted(data: dict[str, Any], key: str, value: Any) -> None:
    parts = key.split(".")
    node = data
    for p in parts[:-1]:
        node = node.setdefault(p, {})
        if not isinstance(node, dict):
            raise ConfigError(f"cannot set {key!r}: {p!r} is not a section")
    node[parts[-1]] = value


def _deep_merge(dst: dict[str, Any], src: Mapping[str, Any]) -> None:
    for k, v in src.items():
        if isinstance(v, Mapping) and isinstance(dst.get(k), dict):
            _deep_merge(dst[k], v)
        else:
            dst[k] = v


def _explain(e: ValidationError) -> str:
    lines = []
    for err in e.errors():
        key = ".".join(str(p) for p in err["loc"])
        env = "HICACHE_" + "__".join(str(p).upper() for p in err["loc"])
        got = err.get("input")
        if err["type"] == "extra_forbidden":
            lines.append(f"unknown setting {key!r} (from {env} in the environment, the config file or "
                         f"--set); remove it or fix its name: settings are <section>.<key> with sections "
                         f"{', '.join(HiCacheConfig.model_fields)}")
            continue
        lines.append(f"{key}={got!r}: {err['msg']} (set it in the config file, with {env}=..., "
                     f"or with --set {key}=...)")
    return "invalid configuration: " + "; ".join(lines)


def parse_set_flags(items: list[str]) -> dict[str, str]:
    """``["a.b=1", ...]`` -> ``{"a.b": "1"}`` with a clear error on a bad item."""
    out = {}
    for it in items:
        if "=" not in it:
            raise ConfigError(f"--set {it!r}: expected section.key=value, e.g. --set storage.url=memory://")
        k, v = it.split("=", 1)
        out[k.strip()] = v
    return out
