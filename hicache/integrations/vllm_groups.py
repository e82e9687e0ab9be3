"""vLLM's KV cache groups as ``HiCacheTier`` sees them, and its per-group counts.

vLLM's hybrid KV cache manager puts layers of one attention kind in one group
(gpt-oss: a sliding-window group and a full-attention group; Qwen3-Next: three
Gated DeltaNet groups and one full-attention group). The offloading path keys a
chunk by block hash *and* group (``OffloadKey``), so each group's chunk is its
own primary row and its own L3 object; which chunks of a windowed or recurrent
group get stored or loaded is vLLM's scheduler's decision, and a prefix hit
that needs several groups is composed there, one ``lookup`` per key. The
per-group counts (``GroupCounts``) are declared with the adapters' other
counters in ``hicache.integrations.metrics``.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from vllm.v1.kv_offload.base import OffloadKey, get_offload_group_idx
from vllm.v1.kv_offload.config import OffloadingConfig

from hicache.core.errors import ConfigError, IntegrityError
from hicache.integrations.metrics import GroupCounts

__all__ = ["KVGroup", "GroupLedger", "kv_groups"]


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
