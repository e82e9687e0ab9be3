"""vLLM's KV cache groups as ``HiCacheTier`` and ``HiCacheConnector`` see them, and the
tier's per-group counts.

vLLM's hybrid KV cache manager puts layers of one attention kind in one group
(gpt-oss: a sliding-window group and a full-attention group; Qwen3-Next: three
Gated DeltaNet groups and one full-attention group). The offloading path keys a
chunk by block hash *and* group (``OffloadKey``), so each group's chunk is its
own primary row and its own L3 object; which chunks of a windowed or recurrent
group get stored or loaded is vLLM's scheduler's decision, and a prefix hit
that needs several groups is composed there, one ``lookup`` per key. The
per-group counts (``GroupCounts``) are declared with the adapters' other
counters in ``hicache.integrations.metrics``. ``engine_groups`` maps the groups of
a ``KVCacheConfig`` to the connector's ``EngineGroup``s (``hicache.connector.groups``).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec, SlidingWindowSpec
from vllm.v1.kv_offload.base import OffloadKey, get_offload_group_idx
from vllm.v1.kv_offload.config import OffloadingConfig

from hicache.connector.groups import EngineGroup, check_groups
from hicache.core.errors import ConfigError, IntegrityError
from hicache.integrations.metrics import GroupCounts

__all__ = ["KVGroup", "GroupLedger", "kv_groups", "engine_groups"]


@dataclasses.dataclass(frozen=True, slots=True)
class KVGroup:
    """One offloaded KV cache group (vLLM's ``OffloadingGroupConfig``)."""

    group_id: int  # vLLM's KVCacheConfig group index: the last 4 bytes of its OffloadKeys
    layers: int
    tokens_per_block: int
    # None: every chunk of a prefix is needed (full attention); k: vLLM needs only
    # the last k chunks before a hit's end (sliding window; 1 for recurrent state).
    window_chunks: int | None

    def describe(self) -> str:
        kind = "full" if self.window_chunks is None else f"last {self.window_chunks} chunk(s)"
        return f"g{self.group_id}: {self.layers} layers, {self.tokens_per_block}-token blocks, {kind}"


def kv_groups(config: OffloadingConfig) -> tuple[KVGroup, ...]:
    """The groups vLLM offloads, validated (at least one, distinct ids)."""
    groups = tuple(KVGroup(g.group_id, len(g.layer_names), g.tokens_per_block, g.sliding_window_size_in_chunks)
                   for g in config.groups)
    ids = [g.group_id for g in groups]
    if not groups or len(set(ids)) != len(ids):
        raise ConfigError(f"HiCacheTier: vLLM's OffloadingConfig declares KV cache groups {ids}; "
                          "expected at least one, with distinct ids")
    return groups


class GroupLedger:
    """Per-group chunk counts, and the check that every key names a declared group.

    Not thread-safe: the tier calls it under its own lock."""

    __slots__ = ("_counts",)

    def __init__(self, groups: Iterable[KVGroup]):
        self._counts = {g.group_id: GroupCounts() for g in groups}

    def check_keys(self, job_id: int, keys: Iterable[OffloadKey]) -> None:
        """Raise ``ValueError`` when a key names a group vLLM did not declare to the tier."""
        unknown = sorted({get_offload_group_idx(k) for k in keys} - self._counts.keys())
        if unknown:
            raise ValueError(f"HiCacheTier job {job_id}: keys of KV cache group(s) {unknown}, but vLLM's "
                             f"OffloadingConfig declared groups {sorted(self._counts)} to this tier; the "
                             "tier and the connector must be built from the same KVCacheConfig")

    def stored(self, keys: Iterable[OffloadKey]) -> None:
        for k in keys:
            self._counts[get_offload_group_idx(k)].stored += 1

    def loaded(self, hits: Iterable[OffloadKey], misses: Iterable[OffloadKey]) -> None:
        for k in hits:
            self._counts[get_offload_group_idx(k)].loaded += 1
        for k in misses:
            self._counts[get_offload_group_idx(k)].load_missed += 1

    def snapshot(self) -> dict[int, GroupCounts]:
        return {g: dataclasses.replace(c) for g, c in self._counts.items()}

    def check(self, stored: int, loaded: int, load_missed: int) -> None:
        """The groups' counts add up to the tier's totals. Raises ``IntegrityError``."""
        sums = tuple(sum(getattr(c, f) for c in self._counts.values()) for f in ("stored", "loaded", "load_missed"))
        if sums != (stored, loaded, load_missed):
            raise IntegrityError(f"HiCacheTier: per-group (stored, loaded, load_missed) add up to {sums}, the "
                                 f"tier counted {(stored, loaded, load_missed)}: {self._counts}")


def engine_groups(kv_cache_config) -> tuple[EngineGroup, ...]:
    """The connector's view of vLLM's KV cache groups: full attention (and MLA) ``full``,
    sliding window ``swa`` (its window), Mamba / linear attention in ``align`` cache mode
    ``state`` (a state kept at every block boundary). Raises ``ConfigError`` naming the
    group for any other spec, mixed block sizes, or a Mamba group without ``align``."""
    out = []
    for i, g in enumerate(kv_cache_config.kv_cache_groups):
        spec, layers = g.kv_cache_spec, tuple(g.layer_names)
        if isinstance(spec, SlidingWindowSpec):
            out.append(EngineGroup(i, "swa", layers, spec.sliding_window))
        elif isinstance(spec, FullAttentionSpec) and spec.sliding_window is None:
            out.append(EngineGroup(i, "full", layers))
        elif isinstance(spec, MambaSpec) and spec.mamba_cache_mode == "align":
            out.append(EngineGroup(i, "state", layers))
        else:
            mode = f" (mamba_cache_mode {spec.mamba_cache_mode!r}: start vLLM with --enable-prefix-caching)" \
                if isinstance(spec, MambaSpec) else ""
            raise ConfigError(f"HiCacheConnector: KV cache group {i} is {type(spec).__name__}{mode}; it serves "
                              "full attention, MLA, sliding window and Mamba state groups")
    sizes = {g.kv_cache_spec.block_size for g in kv_cache_config.kv_cache_groups}
    if len(sizes) != 1:
        raise ConfigError(f"HiCacheConnector: KV cache groups of block sizes {sorted(sizes)}; it needs one "
                          "block size for every group (its page)")
    check_groups(out)
    return tuple(out)
