"""An engine's KV cache groups as the connector sees them, and what each moves for a hit.

A hybrid engine keeps layers of one kind in one group with its own block ids (vLLM's
hybrid KV cache manager: full attention, sliding window, Mamba / linear-attention state).
Each maps to a hicache ``LayerGroup`` kind (``full``, ``swa``, ``state``). A hit is
floored at the last page boundary every group can resume from
(``hicache.core.groups.resumable_floor``), and each group moves only what that boundary
needs: every page beyond the engine's own hit (full), the window before the boundary
(swa), the state at it (state). Pure: no engine imports, nothing mutated.
"""
from __future__ import annotations

from typing import NamedTuple, Sequence

from hicache.core.errors import ConfigError
from hicache.core.groups import GroupKind, LayerGroup, resumable_floor


class EngineGroup(NamedTuple):
    """One KV cache group of the engine."""

    index: int  # the engine's group index (vLLM: position in KVCacheConfig.kv_cache_groups)
    kind: GroupKind
    layers: tuple[str, ...]  # the engine's layer names, in the group's order
    window: int = 0  # swa: tokens a query sees, itself included

    def resume_rule(self) -> LayerGroup:
        """The ``LayerGroup`` whose resume rule this group follows (layers numbered 0 .. n-1;
        a state group's snapshot is taken at every page boundary the engine keeps)."""
        layers = tuple(range(len(self.layers)))
        if self.kind == "state":
            return LayerGroup("state", layers, state_bytes=1, snapshot_every=1)
        return LayerGroup(self.kind, layers, window=self.window)


class GroupHit(NamedTuple):
    """``floor_hit``'s answer, in pages of ``page_size`` tokens."""

    end: int  # where the hit ends, floored where every group resumes (== first: no hit)
    limited_by: int | None  # index (into the groups) of the first group that pulled it below the match
    moves: tuple[range, ...]  # per group, the pages of [first, end) it must move

    def pages(self) -> int:
        """Pages all groups move together."""
        return sum(len(r) for r in self.moves)


def needed(group: EngineGroup, page_size: int, first: int, end: int) -> range:
    """Pages of ``[first, end)`` that ``group`` needs to resume at page ``end`` (the engine
    holds what is before ``first``). Pure."""
    if end <= first:
        return range(first, first)
    if group.kind == "full":
        return range(first, end)
    if group.kind == "swa":
        return range(max(first, max(0, end * page_size - group.window + 1) // page_size), end)
    return range(end - 1, end)


def floor_hit(groups: Sequence[EngineGroup], page_size: int, first: int,
              holds: Sequence[Sequence[bool]]) -> GroupHit:
    """The longest hit past the engine's own ``first`` pages that every group can resume
    from. ``holds[g][i]``: the connector holds page ``i`` of group ``g`` (full, swa: that
    page's rows; state: the state at the boundary after page ``i``); pages before
    ``first`` count as held (the engine has them). Rows have one length, the match's.
    Raises ``ValueError`` for rows of different lengths or not one per group."""
    rows = [[True] * min(first, len(h)) + list(h[first:]) for h in holds]
    fl = resumable_floor([g.resume_rule() for g in groups], page_size, rows)
    end = max(first, fl.pages)
    return GroupHit(end, fl.limited_by, tuple(needed(g, page_size, first, end) for g in groups))


def check_groups(groups: Sequence[EngineGroup]) -> None:
    """Raise ``ConfigError`` naming the group unless ``groups`` can be served: at least one
    full group (it keys the index), distinct indices, windows only on swa groups."""
    if not groups:
        raise ConfigError("the connector needs at least one KV cache group")
    if len({g.index for g in groups}) != len(groups):
        raise ConfigError(f"KV cache groups with repeated indices: {[g.index for g in groups]}")
    if not any(g.kind == "full" for g in groups):
        raise ConfigError(f"KV cache groups {[(g.index, g.kind) for g in groups]}: the connector needs a "
                          "full-attention group (its pages key the index)")
    for g in groups:
        if (g.kind == "swa") != (g.window > 0) or not g.layers:
            raise ConfigError(f"KV cache group {g.index} ({g.kind}, window {g.window}, {len(g.layers)} layers): "
                              "a window is for swa groups, which need one; every group needs layers")
