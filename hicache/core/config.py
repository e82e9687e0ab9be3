"""One typed configuration for the whole system.

Precedence (highest first): CLI overrides (``--set section.key=value``),
environment variables (``HICACHE_<SECTION>__<KEY>``, e.g.
``HICACHE_STORAGE__URL=redis://127.0.0.1:6379/0``), a TOML file
(``--config FILE`` or ``HICACHE_CONFIG``), then the defaults below, which run
everything embedded with no external service.
"""
from __future__ import annotations

import os
import re
import tomllib
from pathlib import Path
from typing import Annotated, Any, Literal, Mapping, NamedTuple

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from hicache.core.types import EVICTION_POLICIES, PrefetchPolicy, WritePolicy
from hicache.core.errors import ConfigError, LayoutError
from hicache.core.layout import BytePlane, KVLayout


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgtp]?)(i?)b?\s*$", re.IGNORECASE)


def parse_size(value: Any) -> int | Literal["auto"]:
    """``"auto"``, an int, or a size string (``"20GiB"``, ``"500M"``, ``"1.5TB"``) -> bytes.

    Raises ``ValueError`` naming the value (the config turns it into ``ConfigError``)."""
    if isinstance(value, bool):
        raise ValueError("must be a byte count, a size such as 20GiB, or auto; not a boolean")
    if isinstance(value, int):
        if value < 0:
            raise ValueError("must be >= 0 (0 = unbounded)")
        return value
    if isinstance(value, str):
        if value.strip().lower() == "auto":
            return "auto"
        m = _SIZE.match(value)
        if m:
            num, unit, binary = m.groups()
            base = 1024 if binary or not unit else 1000
            return int(float(num) * base ** " kmgtp".index(unit.lower() or " "))
    raise ValueError(f"{value!r} is not a byte count: use bytes (21474836480), a size (20GiB, 500MB) or auto")


class _Section(BaseModel):
    # allow_inf_nan=False: "inf" or "nan" for any float setting is an error (an infinite
    # rate made every hit recompute; an infinite bandwidth turned the meter NaN).
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_numbers(cls, v: Any, info: ValidationInfo) -> Any:
        # pydantic's lax mode turns ``true`` into 1; a boolean is never a count.
        ann = cls.model_fields[info.field_name].annotation
        if isinstance(v, bool) and ann in (int, float):
            raise ValueError("must be a number, not a boolean")
        return v


class ModelConfig(_Section):
    """The KV layout (see ``KVLayout``). Defaults: a tiny demo model."""

    model_id: str = "hicache-demo-tiny"
    num_layers: int = 4
    kind: Literal["mha", "mla", "rows"] = "mha"
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
    row_bytes: int = 0  # kind="rows" (an engine's opaque rows, e.g. vLLM's tier): bytes of one row
    engine_layout: str = ""  # kind="rows": the engine's description of a row (HiCacheTier logs it)
    host_layout: Literal["layer_first", "page_first"] = "page_first"
    # The engine's block interior when it is not (head, token) cells of K then V: "cpu_attn"
    # for vLLM's CPU backend (what HiCacheConnector derives there; a node's service must match)
    engine_cells: Literal["", "cpu_attn"] = ""

    def to_layout(self) -> KVLayout:
        d = self.model_dump()
        d["extra_planes"] = tuple(BytePlane(n, b) for n, b in d["extra_planes"])
        return KVLayout(**d)


# Bounds that keep a typo from becoming a hang: a lookup waits up to
# timeout_ms * (1 + max_retries); uids are uid_t values below (uid_t)-1.
MAX_RETRIES = 10
MAX_UID = 2**32 - 2

# Where `hicache serve` listens for engines unless service.socket_path says otherwise;
# the README's examples, `hicache serve --help` and ServiceClient's errors name it.
DEFAULT_SOCKET_PATH = "/tmp/hicache.sock"
_DEVICE = re.compile(r"^(auto|cpu|cuda(:\d{1,3})?)$")


class PoolConfig(_Section):
    device: str = "auto"  # "auto" = cuda:0 when available, else cpu
    # Sized for the built-in demo: L1 smaller than the replay's working set,
    # L2 larger than it (so L2 and L3 have something to do).
    device_pages: int = Field(128, ge=1)
    host_pages: int = Field(2048, ge=1)

    @field_validator("device")
    @classmethod
    def _device(cls, v: str) -> str:
        if not _DEVICE.match(v):
            raise ValueError("must be auto, cpu, cuda or cuda:N")
        return v


def default_l3_url() -> str:
    """``file://`` in the per-user cache directory ($XDG_CACHE_HOME/hicache/l3,
    else ~/.cache/hicache/l3 on Linux): one store whatever the current directory,
    shared by ``hicache replay`` and ``hicache serve``."""
    import platformdirs
    return f"file://{platformdirs.user_cache_path('hicache') / 'l3'}"


class StorageConfig(_Section):
    # L3 backend URL: "" (no L3), memory://, file:///dir, redis://host:port/db,
    # rediss://..., redis+cluster://host:port[,host:port...]
    url: str = Field(default_factory=default_l3_url)
    timeout_ms: int = Field(50, ge=1)  # a lookup that takes longer answers "miss"
    max_retries: int = Field(2, ge=0, le=MAX_RETRIES)  # each retry can wait timeout_ms again
    # A secret shared by every process that may write this L3: objects carry a
    # keyed MAC and objects without a valid one are misses (see the threat model
    # in docs/storage.md). auth_key_file: read it from a file (a Compose/K8s secret).
    auth_key: str = ""
    auth_key_file: str = ""
    # Byte cap of file:// and memory:// (bytes, "20GiB", 0 = unbounded); "auto":
    # min(20 GiB, 10% of the file system / of RAM). See hicache.storage.capacity.
    max_bytes: int | Literal["auto"] = "auto"
    eviction: Literal["lru", "fifo"] = "lru"  # which objects go first at the cap
    # file://: a group (name or gid) whose members share the store: objects 0640 in
    # setgid 2770 directories of it; "": this user only (0600 in 0700).
    file_group: str = ""

    @field_validator("max_bytes", mode="before")
    @classmethod
    def _max_bytes(cls, v: Any) -> Any:
        return parse_size(v)

    def resolved_auth_key(self) -> bytes:
        """``auth_key``, else the stripped contents of ``auth_key_file``, else b"". Raises ``ConfigError``."""
        if self.auth_key:
            return self.auth_key.encode()
        if not self.auth_key_file:
            return b""
        key = read_secret_file(self.auth_key_file, "storage.auth_key_file").strip()
        if not key:
            raise ConfigError(f"storage.auth_key_file={self.auth_key_file!r} is empty")
        return key


MAX_SECRET_BYTES = 64 << 10  # a key or token file larger than this is not one


def read_secret_file(path: str, key: str) -> bytes:
    """The contents of the secret file ``path`` (setting ``key``): a regular file of at most
    ``MAX_SECRET_BYTES``, checked before reading (a FIFO would hang, /dev/zero never end).
    Raises ``ConfigError`` naming the setting and the fix."""
    import stat
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        raise ConfigError(f"{key}={path!r} cannot be read ({e.strerror}); fix the path or the secret mount") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ConfigError(f"{key}={path!r} is not a regular file ({stat.filemode(st.st_mode)}: a FIFO, "
                              "directory or device); point it at the file holding the secret")
        data = os.read(fd, MAX_SECRET_BYTES + 1)
        if st.st_size > MAX_SECRET_BYTES or len(data) > MAX_SECRET_BYTES:
            raise ConfigError(f"{key}={path!r} holds {max(st.st_size, len(data)):,} bytes, more than a secret "
                              f"file may ({MAX_SECRET_BYTES:,}); point it at the file holding the secret")
        return data
    except OSError as e:
        raise ConfigError(f"{key}={path!r} cannot be read ({e.strerror}); fix the path or the secret mount") from None
    finally:
        os.close(fd)


class PolicyConfig(_Section):
    write_policy: WritePolicy = WritePolicy.WRITE_THROUGH
    write_through_threshold: int = Field(2, ge=1)  # hits before a selective backup
    # write_back: share of L1 pages, at the eviction end, kept clean (on L2 or being copied
    # there) ahead of eviction, so admission finds clean victims and never waits (0: off).
    write_back_clean_fraction: float = Field(0.125, ge=0.0, le=1.0)
    # lru: the only policy >= lru at every capacity on every trace measured (bench/RESULTS.md, eviction sweep)
    device_eviction: str = "lru"
    host_eviction: str = "lru"
    prefetch_policy: PrefetchPolicy = PrefetchPolicy.TIMEOUT
    prefetch_timeout_base_ms: float = Field(5.0, ge=0)
    prefetch_timeout_per_1k_tokens_ms: float = Field(2.0, ge=0)
    prefetch_timeout_cap_ms: float = Field(200.0, ge=0)
    storage_hit_min_pages: int = Field(1, ge=1)  # smaller L3 hits are not worth a prefetch
    # Requests that arrived but are not admitted (HiCache.new_request before admit): their
    # cached prefix is evicted only after every other page (protect_waiting), and the
    # first waiting_prefetch_requests of them, next-admitted first, have their L3 pages
    # prefetched into L2 while they wait (0: none).
    protect_waiting: bool = True
    waiting_prefetch_requests: int = Field(8, ge=0)
    # Pages whose last tier the miss tracker remembers (hicache.index.misses; ~120 B each).
    miss_window_pages: int = Field(1_000_000, ge=1)

    @field_validator("device_eviction", "host_eviction")
    @classmethod
    def _eviction(cls, v: str) -> str:
        if v not in EVICTION_POLICIES:
            raise ValueError(f"must be one of {', '.join(EVICTION_POLICIES)}")
        return v


class AdmissionConfig(_Section):
    """Cost-based admission (``hicache.tiers.cost``): load an L2/L3 hit only when that
    is estimated faster than recomputing it."""

    policy: Literal["cost", "always_load"] = "cost"
    # Prefill tokens/s of the engine; 0: measured (HiCache.observe_prefill), and
    # until measured every hit is loaded.
    prefill_tokens_per_s: float = Field(0.0, ge=0)
    # Bandwidth priors (bytes/s) before the first transfer is measured; 0: unknown.
    l2_bytes_per_s: float = Field(0.0, ge=0)  # L2 -> L1 load back
    l3_bytes_per_s: float = Field(0.0, ge=0)  # L3 -> L2 prefetch
    ewma_alpha: float = Field(0.2, gt=0, le=1)  # weight of each new measurement


GiB, TiB = 1 << 30, 1 << 40


class SimulateConfig(_Section):
    """``hicache replay --simulate``: tier capacities in bytes of a real model's KV
    (``shape``, from ``hicache.core.shapes``); pages carry small stand-in payloads.
    Defaults: llama-3.1-8b on one H200 (L1 = 100 GiB: 140 GiB x 0.9 utilisation,
    minus 15 GiB of bf16 weights, minus ~11 GiB activations and graphs), a 1 TiB
    host L2 and a 16 TiB L3. ``page_size`` 512 tokens: one Mooncake block."""

    shape: str = "llama-3.1-8b"
    page_size: int = Field(512, ge=3)
    block_tokens: int = Field(512, ge=3)  # tokens per hash id of a hash-block trace
    l1_bytes: int = Field(100 * GiB, ge=1)
    l2_bytes: int = Field(1 * TiB, ge=0)
    l3_bytes: int = Field(16 * TiB, ge=0)  # enforced on memory:// (its max_bytes); 0 = no L3
    l3_url: str = "memory://"  # memory://, file:///dir, redis://host:port/db


class ServiceConfig(_Section):
    host: str = "127.0.0.1"
    port: int = Field(8177, ge=0, le=65535)
    socket_path: str = DEFAULT_SOCKET_PATH
    admin_token: str = ""  # required when host is not loopback
    admin_token_file: str = ""  # read the token from this file (Compose/K8s secret) when admin_token is ""
    # Per user by default, so one user's server never meets another's segment
    # (and a segment planted under the name is refused: see hicache.memory.shm).
    shm_name: str = Field(default_factory=lambda: f"hicache-l2-{os.geteuid()}")
    max_request_bytes: int = Field(8 << 20, ge=1024)  # engine socket frames and REST bodies
    max_body_requests: int = Field(2, ge=1, le=1024)  # REST requests with a body >= 64 KiB read at once; more get 503
    body_read_timeout_s: float = Field(10.0, gt=0)  # such a body must arrive within this, else 408 (frees the slot)
    # Who may use the engine socket: the file's mode (octal) and group, and
    # the uids (besides the server's own and root) whose connections are accepted.
    socket_mode: str = "0600"
    socket_group: str = ""  # a group name or gid; its members are allowed too
    allowed_uids: list[Annotated[int, Field(ge=0, le=MAX_UID)]] = Field(default_factory=list, max_length=1024)
    max_connections: int = Field(256, ge=1, le=65536)
    # Per client (a peer process, by its SO_PEERCRED pid; peers whose pid the server cannot
    # see, e.g. from another pid namespace, count as one client per uid), so that one client
    # cannot starve the others: connections at once, and the share of pool.host_pages it
    # may hold reserved or acquired at once (1 = no cap; past it, reserve is refused and
    # acquire returns a shorter prefix).
    max_connections_per_client: int = Field(32, ge=1, le=65536)
    client_page_share: float = Field(0.5, gt=0, le=1)
    # REST connections and requests at once (uvicorn's limit_concurrency); past it, 503.
    # Above the /v1/events streams (64) so that /healthz is still answered with every stream open.
    rest_max_connections: int = Field(128, ge=80, le=65536)
    # A REST request's line and headers must arrive within this of the connection's start (or
    # of the previous response), else the connection is closed: a slow sender holds no slot.
    rest_header_timeout_s: float = Field(10.0, gt=0, le=3600)
    handshake_timeout_s: float = Field(5.0, gt=0)  # for hello, and for finishing any frame once begun
    idle_timeout_s: float = Field(600.0, ge=0)  # between frames of a handshaken client; 0 = never

    @field_validator("allowed_uids", mode="before")
    @classmethod
    def _uids(cls, v: Any) -> Any:
        # From the environment or --set: "1001,1002" (or "[1001, 1002]").
        if isinstance(v, str):
            return [int(x) for x in v.strip("[] ").replace(",", " ").split()] if v.strip("[] ") else []
        return v

    @field_validator("socket_mode")
    @classmethod
    def _mode(cls, v: str) -> str:
        try:
            mode = int(v, 8)
        except ValueError:
            raise ValueError("must be an octal file mode such as 0600 or 0660") from None
        if not 0 <= mode <= 0o777:
            raise ValueError("must be an octal file mode between 0000 and 0777")
        return v

    @property
    def socket_mode_bits(self) -> int:
        return int(self.socket_mode, 8)


class HiCacheConfig(BaseSettings):
    """The whole configuration; build with ``HiCacheConfig.load``."""

    model_config = SettingsConfigDict(env_prefix="HICACHE_", env_nested_delimiter="__",
                                      extra="forbid", frozen=True)

    model: ModelConfig = ModelConfig()
    pool: PoolConfig = PoolConfig()
    storage: StorageConfig = Field(default_factory=StorageConfig)  # its default URL reads the environment
    policy: PolicyConfig = PolicyConfig()
    admission: AdmissionConfig = AdmissionConfig()
    service: ServiceConfig = ServiceConfig()
    simulate: SimulateConfig = SimulateConfig()
    log_level: str = "WARNING"
    debug_states: bool = False  # check every L2 page's state transition (hicache.tiers.host_states); tests, debugging

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
        sources: dict[tuple[str, ...], str] = {}  # key path -> where it was set, for errors
        if file:
            data = _read_toml(file)
            _note_sources(sources, data, (), f"the config file {str(file)!r}")
        # env beats file: merge env explicitly so the file sits below it.
        for k, path in _env_keys(env):
            _set_dotted(data, ".".join(path), env[k])
            sources[tuple(path)] = f"{k} in the environment"
        for key, value in (overrides or {}).items():
            _set_dotted(data, key, value)
            sources[tuple(key.split("."))] = f"--set {key}=..."
        from hicache.core.redact import Redactor
        redact = Redactor.from_config_data(data).text
        try:
            cfg = cls(**data)
            cfg.layout()  # validate the layout too
        except ValidationError as e:
            raise ConfigError(redact(_explain(e, sources))) from None
        except LayoutError as e:
            raise ConfigError(redact(_explain_layout(e))) from None
        return cfg

    def check_host_memory(self, layout: KVLayout | None = None, device: str | None = None) -> None:
        """``ConfigError`` when the L2 (host) pool, and L1 too when ``device`` is the CPU, would
        exceed this machine's memory (``check_host_memory``). Called by whoever is about to
        allocate them (``HiCache``, ``hicache serve``), not at load: a config for a bigger
        machine can still be described (``hicache info``)."""
        layout = layout or self.layout()
        needs = [HostNeed("pool.host_pages", self.pool.host_pages, layout.host_addressing(self.pool.host_pages)[2])]
        if device is not None and device.startswith("cpu"):
            needs.append(HostNeed("pool.device_pages", self.pool.device_pages,
                                  layout.page_bytes * self.pool.device_pages))
        check_host_memory(*needs)

    def layout(self) -> KVLayout:
        return self.model.to_layout()

    def resolved_device(self) -> str:
        """``pool.device`` with ``auto`` resolved; ``ConfigError`` for a CUDA device this machine lacks."""
        import torch
        dev = self.pool.device
        if dev == "auto":
            return "cuda:0" if torch.cuda.is_available() else "cpu"
        if dev.startswith("cuda"):
            have = torch.cuda.device_count() if torch.cuda.is_available() else 0
            idx = int(dev.partition(":")[2] or 0)
            if idx >= have:
                raise ConfigError(f"pool.device={dev!r}: this machine has {have} CUDA device(s); use "
                                  f"{'cuda:0..cuda:' + str(have - 1) + ', ' if have else ''}cpu or auto "
                                  f"{_where_to_set('pool.device')}")
        return dev


def _read_toml(file: str | os.PathLike) -> dict[str, Any]:
    name = str(file)
    try:
        raw = Path(file).read_bytes()
    except FileNotFoundError:
        raise ConfigError(f"config file {name!r} does not exist; fix --config or HICACHE_CONFIG") from None
    except IsADirectoryError:
        raise ConfigError(f"config file {name!r} is a directory; name a TOML file with --config or "
                          "HICACHE_CONFIG") from None
    except OSError as e:
        raise ConfigError(f"config file {name!r} cannot be read ({e.strerror}); fix the path or its "
                          "permissions") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"config file {name!r} is not UTF-8 (byte {e.start}); TOML files are UTF-8, "
                          "re-save it as UTF-8") from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config file {name!r} is not valid TOML: {e}") from None


def _note_sources(sources: dict[tuple[str, ...], str], data: Mapping[str, Any], at: tuple[str, ...],
                  where: str) -> None:
    for k, v in data.items():
        sources[at + (k,)] = where
        if isinstance(v, Mapping):
            _note_sources(sources, v, at + (k,), where)


def _env_keys(env: Mapping[str, str]) -> list[tuple[str, list[str]]]:
    """``(variable, key path)`` of every ``HICACHE_*`` setting variable in ``env``."""
    return [(k, k[len("HICACHE_"):].lower().split("__")) for k in env
            if k.startswith("HICACHE_") and k != "HICACHE_CONFIG"]


class HostNeed(NamedTuple):
    """Host memory that one setting sizes, for ``check_host_memory``."""

    setting: str  # what the user set: "pool.host_pages", or the vLLM connector's "host_bytes"
    value: int  # its value; the bytes grow with it
    bytes: int  # the host memory it asks for


_CGROUP_LIMITS = ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes")


def host_memory() -> tuple[int, str] | None:
    """This machine's memory in bytes and what it is: the RAM, or the container's (cgroup)
    memory limit where that is lower; None where the OS does not say."""
    try:
        have = (os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"), "RAM")
    except (ValueError, OSError, AttributeError):
        return None
    for path in _CGROUP_LIMITS:
        try:
            limit = int(Path(path).read_text().strip())  # "max" (no limit) is a ValueError
        except (OSError, ValueError):
            continue
        if 0 < limit < have[0]:
            return limit, f"container memory limit ({path})"
    return have


def check_host_memory(*needs: HostNeed) -> None:
    """Raise ``ConfigError`` when ``needs`` together exceed this machine's memory (``host_memory``).

    The one check every entry point calls before it allocates host memory for a pool
    (``HiCache``, ``hicache serve`` and ``replay``, the vLLM connector's halves): past the
    RAM the allocation is a bare ``MemoryError``, or the kernel's OOM killer."""
    need = sum(n.bytes for n in needs)
    have = host_memory()
    if have is None or need <= have[0]:
        return
    ram, what = have
    asked = " and ".join(f"{n.setting}={n.value:,}" for n in needs)
    # The settings scale linearly: lowering the largest until the sum fits is the fix to name.
    big = max(needs, key=lambda n: n.bytes)
    room = ram - (need - big.bytes)
    fix = (f"lower {big.setting} well below {big.value * room // big.bytes:,}, which would fill all of it"
           if room > 0 else f"lower {'it' if len(needs) == 1 else 'them'}")
    if "." in big.setting:  # a configuration key (not an engine's own, such as the connector's host_bytes)
        fix += f" {_where_to_set(big.setting)}"
    raise ConfigError(f"{asked} {'asks' if len(needs) == 1 else 'ask'} for {need:,} bytes ({need / GiB:,.1f} GiB) "
                      f"of host memory, more than this machine's {what} of {ram:,} bytes ({ram / GiB:,.1f} GiB); "
                      f"{fix}")


def _set_dotted(data: dict[str, Any], key: str, value: Any) -> None:
    parts = key.split(".")
    node = data
    for p in parts[:-1]:
        node = node.setdefault(p, {})
        if not isinstance(node, dict):
            raise ConfigError(f"cannot set {key!r}: {p!r} is not a section")
    node[parts[-1]] = value


def _where_to_set(key: str) -> str:
    env = "HICACHE_" + key.upper().replace(".", "__")
    return f"(set it in the config file, with {env}=..., or with --set {key}=...)"


def _explain(e: ValidationError, sources: Mapping[tuple[str, ...], str] | None = None) -> str:
    lines = []
    for err in e.errors():
        loc = tuple(str(p) for p in err["loc"])
        key = ".".join(loc)
        got = err.get("input")
        if err["type"] == "extra_forbidden":
            where = (sources or {}).get(loc, "the environment, the config file or --set")
            lines.append(f"unknown setting {key!r} (from {where}); remove it or fix its name: settings are "
                         f"<section>.<key> with sections {', '.join(HiCacheConfig.model_fields)}")
            continue
        msg = err["msg"].removeprefix("Value error, ")
        lines.append(f"{key}={_short(got)}: {msg} {_where_to_set(key)}")
    return "invalid configuration: " + "; ".join(lines)


def _short(value: Any, limit: int = 80) -> str:
    r = repr(value)
    return r if len(r) <= limit else r[:limit] + f"... ({len(r)} characters)"


def _explain_layout(e: LayoutError) -> str:
    """A layout error in the configuration's terms (``model.<field>``), not ``KVLayout``'s."""
    if e.field is None:
        return f"invalid configuration: [model] {e}"
    key = f"model.{e.field}"
    return f"invalid configuration: {key}={_short(e.value)}: {e.why} {_where_to_set(key)}"


def parse_set_flags(items: list[str]) -> dict[str, str]:
    """``["a.b=1", ...]`` -> ``{"a.b": "1"}`` with a clear error on a bad item."""
    out = {}
    for it in items:
        if "=" not in it:
            raise ConfigError(f"--set {it!r}: expected section.key=value, e.g. --set storage.url=memory://")
        k, v = it.split("=", 1)
        out[k.strip()] = v
    return out
