"""What the connector's two halves share: the plans and reports that cross between
them, the page events they log, and the settings both are built from.

Plain data only (ints, bytes, tuples): an engine may run the two halves in
different processes and pickle these. The scheduler half
(``hicache.connector.scheduler``) builds one ``StepPlan`` per engine step; every
worker (TP rank) runs it (``hicache.connector.worker``) and answers with
``JobReport`` s, which the scheduler half completes once every rank reported.
Page ``i`` of a spec is block ``blocks[i]`` of the engine's KV tensors (page id
== block id) and L2 page ``host[i]`` of every rank's host pool.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Mapping, NamedTuple, Sequence

from hicache.client.link import SCHEME
from hicache.core.config import HiCacheConfig, HostNeed, check_host_memory
from hicache.core.errors import ConfigError
from hicache.core.layout import KVLayout
from hicache.core.types import HostPageId
from hicache.storage import open_storage
from hicache.storage.capacity import backend_options
from hicache.tiers.cost import CostModel
from hicache.tiers.l2.shared import ServiceHostTier


class JobKind(enum.StrEnum):
    LOAD = "load"  # L3 -> L2 (part) then L2 -> engine blocks
    SAVE = "save"  # engine blocks -> L2
    STORE = "store"  # L2 -> L3, after a save


@dataclass(frozen=True, slots=True)
class LoadSpec:
    """Load pages into engine blocks: the L2 part, then the L3 part continuing it."""

    job: int
    rid: str
    blocks: tuple[int, ...]  # one engine block per page, in page order: L2 part, L3 part, missing part
    host: tuple[int, ...]  # L2 pages of the first len(host) blocks
    l3_host: tuple[int, ...] = ()  # L2 pages reserved for the L3 part (the next len(l3_host) blocks)
    l3_hashes: tuple[bytes, ...] = ()  # the L3 keys of that part
    layerwise: bool = False  # True: the forward of this step waits per layer; False: loads between steps
    group: int = 0  # the engine's KV cache group whose blocks these are (its own worker and L2)

    @property
    def missing(self) -> tuple[int, ...]:
        """Blocks the engine allocated that this load cannot fill (reported as load errors)."""
        return self.blocks[len(self.host) + len(self.l3_host):]


@dataclass(frozen=True, slots=True)
class SaveSpec:
    """Copy engine blocks into L2 pages, then (``hashes`` given) those L2 pages to L3."""

    job: int
    rid: str
    blocks: tuple[int, ...]
    host: tuple[int, ...]
    hashes: tuple[bytes, ...] = ()  # L3 keys, one per page (() : no L3)
    group: int = 0  # the engine's KV cache group whose blocks these are (its own worker and L2)
    rows: int = 0  # rows of the last page that hold tokens (0: all); the rest are zeroed before L3
    # A running request's pages (``step_save``): copied within the step it is planned in, and
    # never reported to the engine as a finished save (the engine holds no blocks for it).
    running: bool = False
    # Blocks this step's forward writes (a Mamba group's state at a block boundary, offered by
    # the engine in the pass that schedules that forward): copied after the forward, within the step.
    after_forward: bool = False


@dataclass(frozen=True, slots=True)
class StepPlan:
    loads: tuple[LoadSpec, ...] = ()
    saves: tuple[SaveSpec, ...] = ()


@dataclass(frozen=True, slots=True)
class JobReport:
    """One rank's outcome of one job stage."""

    job: int
    rank: int
    kind: JobKind
    ok: bool  # the stage's copies succeeded (a load: its L2 part reached the blocks)
    pages: int = 0  # LOAD: leading pages of the L3 part that landed verified; STORE: pages L3 accepted
    seconds: float = 0.0  # LOAD: L2 -> blocks copy time; else 0
    l3_seconds: float = 0.0  # LOAD: L3 read time
    nbytes: int = 0  # LOAD: bytes copied into blocks


@dataclass(slots=True)
class WorkerStep:
    """What one worker hands the engine after a step (see ``ConnectorWorker.finish_step``)."""

    finished_loads: set[str] = field(default_factory=set)  # rids whose asynchronous load ended (ok or not)
    finished_saves: set[str] = field(default_factory=set)  # rids whose blocks the saves no longer read
    load_errors: set[int] = field(default_factory=set)  # blocks whose load failed or failed verification
    # rids among finished_loads whose load left a block unfilled (an engine with several KV cache
    # groups is told per request: its block ids are unique only within a group)
    failed_loads: set[str] = field(default_factory=set)
    reports: list[JobReport] = field(default_factory=list)


L2, L3 = "L2", "L3"


class PageEvent(NamedTuple):
    stored: bool  # False: removed
    medium: str  # L2 or L3
    keys: tuple  # the engine's keys of the pages, in order
    parent: object | None = None  # stored: the key of the page before the first (None: none)
    tokens: tuple[int, ...] = ()  # stored: the pages' token ids


class EventLog:
    """Events since the last ``take``, and the key of every indexed L2 page (for removals)."""

    def __init__(self) -> None:
        self._events: list[PageEvent] = []
        self._l2_keys: dict[HostPageId, object] = {}

    def stored(self, medium: str, keys: Sequence, parent, tokens: Sequence[int],
               host: Sequence[HostPageId] = ()) -> None:
        """Pages ``keys`` reached ``medium``; ``host``: their L2 ids (L2 only)."""
        if not keys:
            return
        if medium == L2:
            self._l2_keys.update(zip(host, keys))
        self._events.append(PageEvent(True, medium, tuple(keys), parent, tuple(tokens)))

    def removed_l2(self, freed: Sequence[HostPageId]) -> None:
        pop = self._l2_keys.pop  # thousands of pages per call where a step's saves make room
        keys = [pop(h, None) for h in freed]
        if None in keys:
            keys = [k for k in keys if k is not None]
        if keys:
            self._events.append(PageEvent(False, L2, tuple(keys)))

    def take(self) -> list[PageEvent]:
        out, self._events = self._events, []
        return out

    @property
    def tracked(self) -> int:
        """L2 pages whose keys are known."""
        return len(self._l2_keys)


LOAD_MODES = ("async", "layerwise")
_OWN_KEYS = ("load", "host_bytes", "draft_layers", "pd")


@dataclass(frozen=True)
class ConnectorSettings:
    config: HiCacheConfig
    layerwise: bool = False
    host_bytes: int = 0  # 0: config.pool.host_pages
    model_id: str = ""  # model.model_id when given: the operator names the model (else the engine derives it)
    draft_layers: int = 0  # the last N layers of vLLM's KV group are the drafter's (EAGLE / NextN)
    pd: Mapping[str, Any] = field(default_factory=dict)  # prefill/decode handoff settings (connector.pd)

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any] | None, env: Mapping[str, str] | None = None) -> "ConnectorSettings":
        """Validate the engine's connector object (``ConfigError`` names the key and the fix)."""
        extra = dict(extra or {})
        load = extra.pop("load", "async")
        if load not in LOAD_MODES:
            raise ConfigError(f"hicache connector: load={load!r}; use one of {', '.join(LOAD_MODES)}")
        host_bytes = extra.pop("host_bytes", 0)
        if not isinstance(host_bytes, int) or isinstance(host_bytes, bool) or host_bytes < 0:
            raise ConfigError(f"hicache connector: host_bytes={host_bytes!r}; must be an integer >= 0")
        draft = extra.pop("draft_layers", 0)
        if not isinstance(draft, int) or isinstance(draft, bool) or draft < 0:
            raise ConfigError(f"hicache connector: draft_layers={draft!r}; must be an integer >= 0 (the "
                              "drafter's layers at the end of vLLM's KV cache group)")
        pd = extra.pop("pd", {})
        if not isinstance(pd, Mapping):
            raise ConfigError(f"hicache connector: pd={pd!r}; must be an object of handoff settings")
        overrides: dict[str, Any] = {}
        for section, values in extra.items():
            if isinstance(values, Mapping):
                overrides.update({f"{section}.{k}": v for k, v in values.items()})
            else:
                overrides[section] = values
        cfg = HiCacheConfig.load(overrides=overrides, env=env)
        if cfg.storage.url.startswith("memory:"):
            raise ConfigError("hicache connector: storage.url='memory://' is one store per process object, so "
                              "the scheduler and the workers would not share it; use file:///dir, redis://, "
                              "or '' for no L3")
        named = isinstance(extra.get("model"), Mapping) and "model_id" in extra["model"]
        return cls(cfg, load == "layerwise", host_bytes, cfg.model.model_id if named else "", draft, dict(pd))

    def host_pages(self, layout: KVLayout) -> int:
        """L2 pages of ``layout`` (``host_bytes`` when given); ``ConfigError`` when under one page."""
        n = self.host_bytes // layout.page_bytes if self.host_bytes else self.config.pool.host_pages
        if n < 1:
            raise ConfigError(f"hicache connector: host_bytes={self.host_bytes} holds no page of "
                              f"{layout.page_bytes} bytes; give at least one page")
        check_host_memory(HostNeed("host_bytes" if self.host_bytes else "pool.host_pages", self.host_bytes or n,
                                   n * layout.page_bytes))
        return n

    @property
    def shared(self) -> bool:
        """L2 is the node service's segment (``storage.url = hicache+unix:///path.sock``)."""
        return self.config.storage.url.startswith(SCHEME + ":")

    def open_link(self, layout: KVLayout, device: str):
        """Map the node service's segment (``ServiceHostTier``; ``ConfigError`` when no service answers)."""
        return ServiceHostTier.open(self.config, layout, device)

    def open_l3(self, layout: KVLayout):
        """The L3 backend of ``storage.url`` for ``layout`` (None: no L3, or the service's behind its segment)."""
        s = self.config.storage
        if not s.url or self.shared:
            return None
        return open_storage(s.url, fingerprint=layout.fingerprint(), layout=layout, timeout_ms=s.timeout_ms,
                            max_retries=s.max_retries, auth_key=s.resolved_auth_key(), **backend_options(s))

    def cost_model(self, layout: KVLayout) -> CostModel:
        return CostModel.from_config(self.config.admission, layout.token_bytes)

    def probe_budget_s(self) -> float:
        """How long a lookup may wait for L3 (the prefetch policy's base budget)."""
        return self.config.policy.prefetch_timeout_base_ms / 1e3
