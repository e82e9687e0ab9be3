"""Page copies of a hybrid layout: what moves for a resumable boundary, and by which kernel.

A boundary ``b`` (in pages) of a prefix is resumable on a tier when every layer
group has there what ``hicache.core.groups`` says it needs. Making it resumable on
the destination therefore moves, per group:

* ``full``: every page ``0 .. b - 1``, on the group's layers' planes (and the
  draft planes, which travel with the target's full-attention pages: a page is
  complete only with both);
* ``swa``: only the pages of the last window before ``b``
  (``hybrid.swa_needed_pages({b}, ...)``), on the group's layers' planes;
* ``state``: the one snapshot taken at ``b``.

Snapshots are fixed-size blobs. A *state pool* holds one snapshot per page: a
``KVLayout`` of kind ``rows`` (``state_layout``) whose one row is every state
layer's state back to back, so that ``DevicePool`` / ``HostPool`` hold it and
the same page-copy kernel (``hicache.kernels.copy_pages``) moves it, pinned
host memory and both host layouts included.

What each tier holds is given in the shape ``hybrid.resumable_floor`` reads:
per group, one entry per page of the prefix; for ``full`` / ``swa`` groups the
page id of that page on the tier, for the state group the snapshot slot (a page
id of the state pool) of the boundary *after* that page; ``None`` where the
tier holds nothing. ``plan_load`` turns (layout, boundary, source ids,
destination ids) into a ``HybridCopyPlan``; ``run_plan`` executes one at once;
``hicache.transfer.hybrid_load`` runs one layer by layer with a wait per group. Pure
except ``run_plan``.
"""
from __future__ import annotations

from typing import Mapping, NamedTuple, Sequence

from hicache.core.errors import InvalidArgument, LayoutError
from hicache.core.groups import GroupKind, LayerGroup, swa_needed_pages
from hicache.kernels.page_copy import Backend, PageCopier, default_copier
from hicache.core.layout import KVLayout
from hicache.memory.pools import DevicePool, HostPool

Pool = DevicePool | HostPool
Ids = Sequence[int | None]
STATE_PLANE = 0  # the state pool's only plane (kind="rows")


class NotResumable(InvalidArgument):
    """The source tier lacks something a group needs at the boundary."""


def state_group(layout: KVLayout) -> tuple[int, LayerGroup] | None:
    """``(index, group)`` of ``layout``'s state group, or ``None`` without one."""
    return next(((i, g) for i, g in enumerate(layout.groups) if g.kind == "state"), None)


def state_layout(layout: KVLayout) -> KVLayout:
    """The layout of ``layout``'s snapshot pool: one snapshot per page (kind ``rows``, page 1),
    its row every state layer's ``state_bytes`` back to back. Its fingerprint names the KV
    layout's, so a snapshot never pairs with another model's pages. Raises ``LayoutError``
    when ``layout`` has no state group."""
    sg = state_group(layout)
    if sg is None:
        raise LayoutError(f"layout {layout.model_id!r} has no state group (groups: "
                          f"{[g.kind for g in layout.groups]}); it keeps no snapshots")
    g = sg[1]
    desc = {"hybrid_state_of": layout.fingerprint(), "state_layers": len(g.layers), "state_bytes": g.state_bytes,
            "snapshot_every": g.snapshot_every}
    return KVLayout.rows(layout.model_id, g.state_bytes * len(g.layers), desc,
                         tp_rank=layout.tp_rank, tp_size=layout.tp_size)


def state_layer_offset(layout: KVLayout, layer: int) -> int:
    """Byte offset of state layer ``layer`` inside one snapshot (a row of ``state_layout``)."""
    sg = state_group(layout)
    if sg is None or not 0 <= layer < len(sg[1].layers):
        raise InvalidArgument(f"state layer {layer}: layout {layout.model_id!r} has "
                              f"{len(sg[1].layers) if sg else 0} state layers")
    return layer * sg[1].state_bytes


class GroupCopy(NamedTuple):
    """What one group moves: ``src[k]`` -> ``dst[k]`` on each plane set of ``steps``."""

    group: int  # index in layout.groups
    kind: GroupKind
    steps: tuple[tuple[int, ...], ...]  # plane sets, one per layer in load order (state: ((STATE_PLANE,),))
    layers: tuple[int, ...]  # the layer of each step (KV layer; -1: draft planes; state: -1)
    src: tuple[int, ...]  # source page ids (KV pool pages, or state pool slots)
    dst: tuple[int, ...]  # destination page ids, one per source id
    nbytes: int  # bytes this copy moves

    @property
    def planes(self) -> tuple[int, ...]:
        return tuple(p for s in self.steps for p in s)


class HybridCopyPlan(NamedTuple):
    """Every group's copy for one boundary, in ``layout.groups`` order."""

    boundary: int  # pages
    copies: tuple[GroupCopy, ...]
    nbytes: int  # bytes moved in all
    every_layer_full: int  # bytes a layout without groups moves for the same pages: every KV plane every page


def needed(group: LayerGroup, boundary: int, page_size: int) -> list[int]:
    """Entries (page indices of the prefix) ``group`` needs to resume at ``boundary``. Pure."""
    if boundary <= 0:
        return []
    if group.kind == "full":
        return list(range(boundary))
    if group.kind == "swa":
        return sorted(swa_needed_pages((boundary,), group.window, page_size))
    return [boundary - 1]  # the snapshot at the boundary after page b - 1


def _steps(layout: KVLayout, group: LayerGroup, with_draft: bool) -> tuple[tuple[tuple[int, ...], ...],
                                                                        tuple[int, ...]]:
    if group.kind == "state":
        return ((STATE_PLANE,),), (-1,)
    steps = [tuple(s.index for s in layout.planes_of_layer(i)) for i in group.layers]
    layers = list(group.layers)
    draft = tuple(s.index for s in layout.planes if s.draft)
    if with_draft and draft:
        steps.append(draft)
        layers.append(-1)
    return tuple(steps), tuple(layers)


def _check_rows(layout: KVLayout, boundary: int, rows: Sequence[Ids] | Sequence[Sequence[bool]], name: str) -> None:
    n = len(layout.groups)
    if len(rows) != n:
        raise InvalidArgument(f"{name}: {len(rows)} rows for {n} layer groups; pass one row per group "
                              "(layout.groups order)")
    short = [(gi, len(r)) for gi, r in enumerate(rows) if len(r) < boundary]
    if short:
        raise InvalidArgument(f"{name}: rows of groups {[g for g, _ in short]} have {[m for _, m in short]} "
                              f"entries; boundary {boundary} needs {boundary} per group")


def plan_load(layout: KVLayout, boundary: int, src: Sequence[Ids], dst: Sequence[Ids],
              resident: Sequence[Sequence[bool]] | None = None) -> HybridCopyPlan:
    """The copies that make ``boundary`` (pages) resumable on the destination tier. Pure.

    ``src`` / ``dst``: per group (``layout.groups`` order), per prefix page, the id on the
    source / destination tier (module docstring; ``None``: not held / no slot). ``resident``
    (same shape, bools): entries the destination already holds, which do not move. Raises
    ``NotResumable`` naming the group and page when the source lacks a needed entry, and
    ``InvalidArgument`` when a needed destination id is missing, repeated, or the rows are
    malformed. A layout without groups is one ``full`` group over every layer.
    """
    if not layout.groups:
        raise InvalidArgument(f"layout {layout.model_id!r} declares no layer groups; use copy_pages directly")
    if boundary < 0:
        raise InvalidArgument(f"boundary={boundary}: a number of pages >= 0")
    for name, rows in (("src", src), ("dst", dst), ("resident", resident)):
        if rows is not None:
            _check_rows(layout, boundary, rows, name)
    first_full = next((i for i, g in enumerate(layout.groups) if g.kind == "full"), None)
    if first_full is None and layout.draft_layers:
        raise InvalidArgument(f"layout {layout.model_id!r} has {layout.draft_layers} draft layers but no full "
                              "group: draft planes travel with the full group's pages; declare one")
    copies = []
    for gi, g in enumerate(layout.groups):
        want = [i for i in needed(g, boundary, layout.page_size) if resident is None or not resident[gi][i]]
        miss = [i for i in want if src[gi][i] is None]
        if miss:
            what = "snapshot at boundary" if g.kind == "state" else "page"
            at = [i + 1 for i in miss] if g.kind == "state" else miss
            raise NotResumable(f"group {gi} ({g.kind}): the source holds no {what} {at[:8]}"
                               f"{'...' if len(at) > 8 else ''}; boundary {boundary} is not resumable from it "
                               "(floor it with hybrid.resumable_floor first)")
        no_dst = [i for i in want if dst[gi][i] is None]
        d = tuple(int(dst[gi][i]) for i in want if dst[gi][i] is not None)  # type: ignore[arg-type]
        if no_dst or len(set(d)) != len(d):
            raise InvalidArgument(f"group {gi} ({g.kind}): destination ids for entries {want[:8]} are "
                                  f"{[dst[gi][i] for i in want[:8]]}; each needed entry needs its own id")
        steps, layers = _steps(layout, g, gi == first_full)
        per = (g.state_bytes * len(g.layers) if g.kind == "state"
               else sum(layout.planes[p].page_bytes for s in steps for p in s))
        copies.append(GroupCopy(gi, g.kind, steps, layers, tuple(int(src[gi][i]) for i in want),  # type: ignore[arg-type]
                                d, per * len(want)))
    full = layout.page_bytes * boundary
    return HybridCopyPlan(boundary, tuple(copies), sum(c.nbytes for c in copies), full)


def on_group_pools(plan: HybridCopyPlan, layout: KVLayout, pool_layouts: Mapping[int, KVLayout]) -> HybridCopyPlan:
    """``plan`` (in ``layout``'s planes) for groups kept in pools of their own: group ``g``'s
    pool has ``pool_layouts[g]``, whose layers are the group's in order, numbered from 0
    (``hybrid_cache.group_layout``); each step's planes become the same layer's planes
    there. State copies (``STATE_PLANE`` of a state pool) and groups not in
    ``pool_layouts`` stay as they are. Raises ``LayoutError`` when a pool layout's layers
    or plane sizes do not match the group's. Pure."""
    copies = []
    for c in plan.copies:
        pl = pool_layouts.get(c.group)
        g = layout.groups[c.group]
        if pl is None or c.kind == "state":
            copies.append(c)
            continue
        steps = tuple(tuple(s.index for s in pl.planes_of_layer(k)) for k in range(pl.num_layers))
        sizes = [[layout.planes[p].page_bytes for p in s] for s in c.steps]
        if c.layers != tuple(g.layers) or sizes != [[pl.planes[p].page_bytes for p in s] for s in steps]:
            raise LayoutError(f"group {c.group} ({c.kind}): its pool's layout {pl.model_id!r} has {pl.num_layers} "
                              f"layers of planes {[[pl.planes[p].page_bytes for p in s] for s in steps]} bytes; "
                              f"the group's layers {g.layers} have {sizes}: build it with group_layout")
        copies.append(c._replace(steps=steps))
    return plan._replace(copies=tuple(copies))


def run_plan(plan: HybridCopyPlan, kv_src: Pool, kv_dst: Pool, state_src: Pool | None = None,
             state_dst: Pool | None = None, *, backend: Backend = "auto", copier: PageCopier | None = None,
             layerwise: bool = False) -> None:
    """Execute every copy of ``plan`` (one kernel launch per group, or per step with
    ``layerwise``) on the current stream. Mutates the destination pools only; on a GPU
    asynchronous like ``copy_pages``. Raises ``InvalidArgument`` when the plan has a state
    copy and no state pools are given."""
    cp = copier or default_copier()
    for c in plan.copies:
        if not c.src:
            continue
        s, d = _pools(c, kv_src, kv_dst, state_src, state_dst)
        for planes in (c.steps if layerwise else (c.planes,)):
            cp.copy_pages(s, d, list(c.src), list(c.dst), planes=planes, backend=backend)


def _pools(c: GroupCopy, kv_src: Pool, kv_dst: Pool, state_src: Pool | None,
           state_dst: Pool | None) -> tuple[Pool, Pool]:
    if c.kind != "state":
        return kv_src, kv_dst
    if state_src is None or state_dst is None:
        raise InvalidArgument(f"the plan moves {len(c.src)} snapshot(s) of group {c.group}; pass state_src and "
                              "state_dst (pools over hybrid_copy.state_layout(layout))")
    return state_src, state_dst
