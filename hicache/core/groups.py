"""Hybrid models: layer groups, the resumable-boundary floor, and what a hybrid stores.

A hybrid model's layers fall into *groups*, each with its own rule for what a
cached prefix must hold so that a request can resume right after it:

* ``full``  (full attention): a page for every token of the prefix;
* ``swa``   (sliding window ``W``): a query at position ``p`` sees keys at
  ``(p - W, p]``, so resuming at token ``t`` needs the keys ``[t - W + 1, t)``
  (pages ``(t - W + 1) // page_size .. t / page_size - 1``), nothing older;
* ``state`` (recurrent, e.g. linear attention / Gated DeltaNet): a fixed-size
  state per layer instead of KV; resuming at ``t`` needs the state *snapshot*
  taken exactly at ``t``. Snapshots are taken every ``snapshot_every`` pages.
"""
from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate
from typing import Any, Iterable, Literal, NamedTuple, Protocol, Sequence

from hicache.core.errors import LayoutError
from hicache.core.hashing import page_hashes


# What this module reads of a KVLayout and a ModelShape. Protocols, not imports:
# hicache.core.layout imports this module (LayerGroup, validate_groups).
class _Layout(Protocol):
    planes: Sequence[Any]
    groups: Sequence["LayerGroup"]
    page_size: int
    num_layers: int


class _Shape(Protocol):
    name: str
    kind: str
    layers: int
    attention_layers: int
    sliding_window: int

    def kv_layout(self, page_size: int, **extra: Any) -> Any: ...

GroupKind = Literal["full", "swa", "state"]
MAX_GROUPS = 16
MAX_WINDOW = 1 << 24
MAX_STATE_BYTES = 1 << 31
MAX_SNAPSHOT_EVERY = 1 << 20


@dataclass(frozen=True, slots=True)
class LayerGroup:
    """One group of layers that share a resume rule.

    ``full`` and ``swa`` groups name the ``KVLayout`` layers (plane layer indices)
    they own and partition them; a ``state`` group names its own layers
    ``0 .. n - 1`` (they have no per-token planes) and the bytes of one layer's
    state. Everything here is pure: the index, the engines and the tests feed it
    what they hold and act on the answer.
    """

    kind: GroupKind
    layers: tuple[int, ...]  # full/swa: KVLayout layer indices; state: 0 .. n-1 of the state layers
    window: int = 0  # swa: tokens a query sees, itself included
    state_bytes: int = 0  # state: bytes of one layer's state (one snapshot of one layer)
    snapshot_every: int = 0  # state: a snapshot every this many pages

    def __post_init__(self) -> None:
        for name in ("window", "state_bytes", "snapshot_every"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool):  # 1.5, true and "4" are no counts
                why = f"must be an integer, got {type(v).__name__} {v!r}"
                raise LayoutError(f"LayerGroup({self.kind!r}) {name}: {why}", "groups", v, f"{name} {why}")

    def to_list(self) -> list[object]:
        return [self.kind, list(self.layers), self.window, self.state_bytes, self.snapshot_every]

    @classmethod
    def of(cls, g: "LayerGroup | Sequence") -> "LayerGroup":
        """A group from itself or from ``to_list``'s form (config files, handshakes)."""
        if isinstance(g, LayerGroup):
            return g
        try:
            kind, layers, *rest = g
            if len(rest) > 3 or isinstance(layers, (str, bytes)):
                raise TypeError
            return cls(kind, tuple(layers), *rest)
        except LayoutError:
            raise
        except (TypeError, ValueError):
            shown = repr(g)
            shown = shown if len(shown) <= 80 else shown[:80] + "..."
            why = "expected [kind, [layers...], window, state_bytes, snapshot_every] (the last three optional)"
            raise LayoutError(f"KVLayout.groups: a group {shown}: {why}", "groups", shown, why) from None

    def window_pages(self, page_size: int) -> int:
        """Pages an SWA group must hold before a page-aligned boundary (past the first window)."""
        return -(-(self.window - 1) // page_size)


def validate_groups(groups: tuple[LayerGroup, ...], num_layers: int) -> None:
    """Raise ``LayoutError`` naming the group unless ``groups`` is a valid description
    of a layout with ``num_layers`` KV layers (an empty tuple is valid: not hybrid)."""
    def bad(i: int, why: str) -> LayoutError:
        return LayoutError(f"KVLayout.groups[{i}]={groups[i].to_list()!r}: {why}", "groups", groups, why)

    if not groups:
        return
    if len(groups) > MAX_GROUPS:
        raise LayoutError(f"KVLayout.groups: at most {MAX_GROUPS} groups, got {len(groups)}", "groups", groups)
    seen: list[int] = []
    for i, g in enumerate(groups):
        if not isinstance(g.kind, str) or g.kind not in ("full", "swa", "state"):
            raise bad(i, "kind must be 'full', 'swa' or 'state'")
        if not g.layers or any(not isinstance(x, int) or isinstance(x, bool) for x in g.layers):
            raise bad(i, "needs a non-empty tuple of integer layer indices")
        if g.kind == "state":
            if g.layers != tuple(range(len(g.layers))):
                raise bad(i, "a state group's layers are 0 .. n-1 (they have no KV planes)")
            if not 1 <= g.state_bytes <= MAX_STATE_BYTES or not 1 <= g.snapshot_every <= MAX_SNAPSHOT_EVERY:
                raise bad(i, f"a state group needs state_bytes in [1, {MAX_STATE_BYTES}] and snapshot_every "
                          f"in [1, {MAX_SNAPSHOT_EVERY}]")
            if g.window:
                raise bad(i, "window is for swa groups")
            continue
        if g.state_bytes or g.snapshot_every:
            raise bad(i, "state_bytes / snapshot_every are for state groups")
        if g.kind == "swa" and not 1 <= g.window <= MAX_WINDOW:
            raise bad(i, f"an swa group needs window in [1, {MAX_WINDOW}]")
        if g.kind == "full" and g.window:
            raise bad(i, "a full group has no window")
        seen += g.layers
    if sorted(seen) != list(range(num_layers)):
        raise LayoutError(f"KVLayout.groups: the full and swa groups must cover layers 0 .. {num_layers - 1} "
                          f"exactly once, got {sorted(seen)}", "groups", groups)
    if sum(g.kind == "state" for g in groups) > 1:
        raise LayoutError("KVLayout.groups: at most one state group", "groups", groups)


# ----------------------------------------------------------------- the floor
class HybridFloor(NamedTuple):
    """Where a request can resume on a matched prefix."""

    pages: int  # resumable boundary, in pages of the match
    tokens: int  # pages * page_size, or the request's own exact tokens (see resumable_floor)
    limited_by: int | None  # index of the first group that pulled the floor below the match; None if none


def _missing_prefix(holds: Sequence[bool]) -> list[int]:
    return [0, *accumulate(0 if h else 1 for h in holds)]


def resumable_floor(groups: Sequence[LayerGroup], page_size: int, holds: Sequence[Sequence[bool]], *,
                    exact_tokens: int = 0, live_state_tokens: int = 0) -> HybridFloor:
    """The longest prefix of a match that every group can resume from. Pure.

    ``holds[g][i]`` says what group ``g`` holds for page ``i`` of the match
    (every row has the match's length ``n``): for ``full`` and ``swa`` groups,
    that page's planes; for a ``state`` group, a snapshot at the boundary
    *after* page ``i`` (token ``(i + 1) * page_size``). Boundary 0 is always
    resumable (empty prefix, zero state).

    ``exact_tokens`` (> ``n * page_size``) is the seed contract's exact
    accounting: a RUNNING or PREEMPTED request's own private partial page that
    continues the match. It is kept when the floor reaches the whole match and
    the request holds its own live recurrent state up to it
    (``live_state_tokens >= exact_tokens``; irrelevant without a state group);
    otherwise the result is page-floored. Raises ``ValueError`` when the rows'
    lengths differ or there is not one row per group.
    """
    if len(holds) != len(groups):
        raise ValueError(f"resumable_floor: {len(groups)} groups but {len(holds)} holding rows")
    n = len(holds[0]) if holds else 0
    if any(len(h) != n for h in holds):
        raise ValueError(f"resumable_floor: holding rows of lengths {[len(h) for h in holds]}; one per page")
    miss = [_missing_prefix(h) for h in holds]

    def fails(b: int) -> int | None:
        if b == 0:
            return None
        for gi, g in enumerate(groups):
            m = miss[gi]
            if g.kind == "full":
                lo = 0
            elif g.kind == "swa":
                lo = max(0, b * page_size - g.window + 1) // page_size
            else:
                lo = b - 1
            if m[b] - m[lo]:
                return gi
        return None

    first = fails(n)
    b = n
    while b > 0 and fails(b) is not None:
        b -= 1
    tokens = b * page_size
    if b == n and exact_tokens > tokens:
        has_state = any(g.kind == "state" for g in groups)
        if not has_state or live_state_tokens >= exact_tokens:
            tokens = exact_tokens
    return HybridFloor(b, tokens, first)


def swa_needed_pages(boundaries: Iterable[int], window: int, page_size: int) -> set[int]:
    """Pages an SWA group must keep so that every boundary in ``boundaries`` (in pages)
    stays resumable: the union of each boundary's last window. Pure."""
    out: set[int] = set()
    for b in boundaries:
        out.update(range(max(0, b * page_size - window + 1) // page_size, b))
    return out


# ------------------------------------------------------------------ accounting
class StoredBytes(NamedTuple):
    """Bytes one cached prefix costs in a hybrid layout versus full storage."""

    hybrid: int  # full groups every page, swa groups their windows, state groups their snapshots
    every_layer_full: int  # every KV layer every page (what hicache stores without groups)
    snapshots: int  # state snapshots kept (at every ``snapshot_every``-th boundary)
    state_every_page: int  # the bytes a snapshot at every page boundary would take instead

    @property
    def saved(self) -> float:
        """Fraction of ``every_layer_full + state_every_page`` not stored."""
        base = self.every_layer_full + self.state_every_page
        return 1.0 - self.hybrid / base if base else 0.0


def _layer_page_bytes(layout: _Layout, layers: Iterable[int]) -> int:
    want = set(layers)
    return sum(p.page_bytes for p in layout.planes if not p.draft and p.layer in want)


def snapshot_boundaries(num_pages: int, every: int) -> list[int]:
    """Boundaries (in pages, > 0) where a state group keeps snapshots for a prefix of ``num_pages``."""
    return list(range(every, num_pages + 1, every))


def stored_bytes(layout: _Layout, num_pages: int, boundaries: Iterable[int] | None = None) -> StoredBytes:
    """What one prefix of ``num_pages`` pages costs in ``layout`` (draft planes excluded).

    ``boundaries``: where the prefix must stay resumable, so where SWA groups keep
    their windows. Default, as ``HybridCache`` keeps them: without a state group
    the prefix's end; with one only its snapshot boundaries (a boundary without a
    snapshot cannot resume, so no window is kept for it; the end too when it is a
    snapshot boundary). Snapshots are counted at the snapshot boundaries. Pure.
    """
    groups = layout.groups
    state = next((g for g in groups if g.kind == "state"), None)
    snaps = snapshot_boundaries(num_pages, state.snapshot_every) if state else []
    if boundaries is None:
        boundaries = snaps if state else ([num_pages] if num_pages else [])
    bset = list(boundaries)
    full = _layer_page_bytes(layout, range(layout.num_layers)) * num_pages
    hybrid = 0
    for g in groups:
        if g.kind == "full":
            hybrid += _layer_page_bytes(layout, g.layers) * num_pages
        elif g.kind == "swa":
            hybrid += _layer_page_bytes(layout, g.layers) * len(swa_needed_pages(bset, g.window, layout.page_size))
    if not groups:
        hybrid = full
    one = state.state_bytes * len(state.layers) if state else 0
    return StoredBytes(hybrid + one * len(snaps), full, len(snaps), one * num_pages)


def workload_bytes(layout: _Layout, sequences: Iterable[tuple[Sequence[int], str]], *,
                   end_snapshots: bool = False) -> StoredBytes:
    """``stored_bytes`` for a whole workload: every distinct page of ``sequences``
    (token ids, namespace) once, as a prefix tree would hold them. Each sequence
    stays resumable at its snapshot boundaries and, without a state group or with
    ``end_snapshots`` (a state group also keeps a snapshot at each sequence's last
    full page), at its page-floored end; an SWA page is kept when some sequence's
    boundary needs it (as ``HybridCache`` keeps them: with a state group, only
    boundaries with a snapshot). Pure."""
    ps = layout.page_size
    state = next((g for g in layout.groups if g.kind == "state"), None)
    pages: set[bytes] = set()
    snaps: set[bytes] = set()
    swa_keep: dict[int, set[bytes]] = {}
    for tokens, namespace in sequences:
        hashes = page_hashes(list(tokens), ps, namespace)
        n = len(hashes)
        pages.update(hashes)
        every = snapshot_boundaries(n, state.snapshot_every) if state else []
        snaps.update(hashes[b - 1] for b in every)
        if state and end_snapshots and n:
            snaps.add(hashes[n - 1])
        ends = {n} if n and (end_snapshots or not state) else set()
        for gi, g in enumerate(layout.groups):
            if g.kind == "swa":
                keep = swa_keep.setdefault(gi, set())
                keep.update(hashes[p] for p in swa_needed_pages(ends | set(every), g.window, ps))
    full = _layer_page_bytes(layout, range(layout.num_layers)) * len(pages)
    hybrid = full if not layout.groups else 0
    for gi, g in enumerate(layout.groups):
        if g.kind == "full":
            hybrid += _layer_page_bytes(layout, g.layers) * len(pages)
        elif g.kind == "swa":
            hybrid += _layer_page_bytes(layout, g.layers) * len(swa_keep.get(gi, ()))
    one = state.state_bytes * len(state.layers) if state else 0
    return StoredBytes(hybrid + one * len(snaps), full, len(snaps), one * len(pages))


# -------------------------------------------------------------- real shapes
# Gated DeltaNet facts of Qwen3-Next (its config.json: linear_num_key_heads 16,
# linear_num_value_heads 32, linear_key_head_dim 128, linear_value_head_dim 128,
# linear_conv_kernel_dim 4). The shapes table has no fields for them yet.
QWEN3_NEXT_LINEAR = dict(num_k_heads=16, num_v_heads=32, k_dim=128, v_dim=128, conv_kernel=4)


def gdn_state_bytes(num_k_heads: int, num_v_heads: int, k_dim: int, v_dim: int, conv_kernel: int,
                    dtype_bytes: int) -> int:
    """One Gated DeltaNet layer's state: the recurrent ``[v_heads, k_dim, v_dim]`` matrix
    plus the causal conv's last ``conv_kernel - 1`` inputs of ``q, k, v`` channels."""
    conv_dim = 2 * num_k_heads * k_dim + num_v_heads * v_dim
    return (num_v_heads * k_dim * v_dim + (conv_kernel - 1) * conv_dim) * dtype_bytes


def hybrid_groups(shape: _Shape, *, snapshot_every: int = 8,
                  state_dtype_bytes: int = 2) -> tuple[LayerGroup, ...]:
    """The layer groups of a published hybrid shape (``gqa+swa`` or ``hybrid``).

    ``gqa+swa`` (gpt-oss): layers alternate sliding (even) and full (odd).
    ``hybrid`` (Qwen3-Next): the KV layers are the full-attention ones; the
    other ``layers - attention_layers`` keep a Gated DeltaNet state of
    ``state_dtype_bytes`` per element (2: bf16 as vLLM's default ``auto``;
    pass 4 for SGLang's float32 ``mamba_ssm_dtype``). Raises ``LayoutError``
    for a shape that is not hybrid.
    """
    if not isinstance(snapshot_every, int) or isinstance(snapshot_every, bool) \
            or not 1 <= snapshot_every <= MAX_SNAPSHOT_EVERY:
        why = f"must be an integer in [1, {MAX_SNAPSHOT_EVERY}] (pages between recurrent-state snapshots)"
        raise LayoutError(f"snapshot_every={snapshot_every!r}: {why}", "snapshot_every", snapshot_every, why)
    if shape.kind == "gqa+swa":
        n = shape.layers
        return (LayerGroup("swa", tuple(range(0, n, 2)), window=shape.sliding_window),
                LayerGroup("full", tuple(range(1, n, 2))))
    if shape.kind == "hybrid" and shape.name.startswith("qwen3-next"):
        recurrent = shape.layers - shape.attention_layers
        sb = gdn_state_bytes(**QWEN3_NEXT_LINEAR, dtype_bytes=state_dtype_bytes)
        return (LayerGroup("full", tuple(range(shape.attention_layers))),
                LayerGroup("state", tuple(range(recurrent)), state_bytes=sb, snapshot_every=snapshot_every))
    raise LayoutError(f"model shape {shape.name!r} (kind {shape.kind!r}) has no hybrid layer groups")


def hybrid_layout(shape: _Shape, page_size: int, *, snapshot_every: int = 8,
                  state_dtype_bytes: int = 2, **extra) -> _Layout:
    """``shape.kv_layout(page_size)`` with its layer groups (see ``hybrid_groups``)."""
    groups = hybrid_groups(shape, snapshot_every=snapshot_every, state_dtype_bytes=state_dtype_bytes)
    return shape.kv_layout(page_size, groups=groups, **extra)
