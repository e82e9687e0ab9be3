"""An engine's paged KV tensors as hicache's L1 ``DevicePool``, without a copy.

vLLM 0.33 hands a connector one tensor per layer, a view ``[B, H, N, C]`` of
one int8 allocation (``vllm/v1/worker/utils.py`` ``allocate_kv_cache`` ->
``vllm/v1/kv_cache_interface.py`` ``create_kv_cache_views``): B blocks, H KV
heads (1 for MLA), N tokens per block, C one (head, token) cell: K then V
(``AttentionSpec.state_content_size_bytes``), or MLA's latent + rope. Its
strides follow the resolved ``KVCacheLayout`` (``vllm/v1/kv_cache_layout.py``):
any order of L (layer), B, H, N with C innermost. ``adopt_paged_kv`` cuts each
cell into hicache's planes (k, v; latent and byte planes) as strided page views,
page id == block id; ``vllm_kv_caches`` builds tensors exactly as vLLM would,
for tests and benches on machines without vLLM.
"""
from __future__ import annotations

from typing import Mapping, Sequence

import torch

from hicache.core.errors import LayoutError
from hicache.core.layout import KVLayout, PlaneSpec
from hicache.memory.pools import DevicePool

__all__ = ["VLLM_LAYOUTS", "adopt_paged_kv", "cell_bytes", "vllm_kv_caches"]

# vLLM 0.33's KVCacheLayout members: stride order of logical [L, B, H, N, C]
# (vllm/v1/kv_cache_layout.py). Which backend picks which (supported_kv_cache_layouts):
# FlashAttention, Triton: none declared -> LBNHC (utils._DEFAULT_LAYOUT_PREFERENCE);
# FlashInfer on SM100: LBHNC / BLHNC, else LBNHC; CPU_ATTN: LBHNC; FlexAttention: LBNHC;
# MLA indexer / DeepSeek-V4 packing: BLHNC / BLNHC; ROCm backends: LHBNC / LBHNC.
VLLM_LAYOUTS: dict[str, tuple[int, ...]] = {
    "LBHNC": (0, 1, 2, 3, 4), "LBNHC": (0, 1, 3, 2, 4), "LHBNC": (0, 2, 1, 3, 4),
    "BLHNC": (1, 0, 2, 3, 4), "BLNHC": (1, 0, 3, 2, 4), "BHLNC": (1, 2, 0, 3, 4),
}
_BYTE_DTYPES = (torch.uint8, torch.int8, torch.float8_e4m3fn, torch.float8_e5m2)


def cell_heads(layout: KVLayout) -> int:
    """H of vLLM's ``[B, H, N, C]`` view: KV heads (MHA) or 1 (MLA, byte planes)."""
    return layout.num_kv_heads if layout.kind == "mha" else 1


def cell_bytes(layout: KVLayout) -> int:
    """Bytes of one (head, token) cell C: the layer's planes side by side, in plane order."""
    return sum(s.row_bytes for s in layout.planes_of_layer(0)) // cell_heads(layout)


def _expected(layout: KVLayout, num_blocks: int | str, esz: int) -> tuple:
    return (num_blocks, cell_heads(layout), layout.page_size, cell_bytes(layout) // esz)


def _bad(name: str, t: torch.Tensor, layout: KVLayout, why: str) -> LayoutError:
    want = _expected(layout, "num_blocks", max(1, t.element_size()))
    return LayoutError(f"KV tensor {name!r}: shape {tuple(t.shape)} dtype {t.dtype}: {why}; layout "
                       f"{layout.model_id!r} expects vLLM's [B, H, N, C] = [{', '.join(map(str, want))}] "
                       f"{layout.dtype} (or [2, B, N, H, D] K/V, or MLA [B, N, C])", "kv_caches",
                       tuple(t.shape), why)


def _check_dtype(name: str, t: torch.Tensor, layout: KVLayout) -> None:
    """The model dtype (bf16, fp8, ...) or its storage dtype; raw bytes where the layout stores
    bytes (fp8 caches are uint8 views in vLLM) or mixes dtypes in one cell (byte planes)."""
    storage = layout.planes[0].dtype
    raw_ok = storage == torch.uint8 or bool(layout.extra_planes)
    if t.dtype not in (getattr(torch, layout.dtype), storage) and not (raw_ok and t.dtype in _BYTE_DTYPES):
        raise _bad(name, t, layout, f"dtype {t.dtype} is not the layout's {layout.dtype}")


def _cells(name: str, t: torch.Tensor, layout: KVLayout) -> list[torch.Tensor]:
    """uint8 ``[B, N, H, bytes]`` views (any strides) of the layer's cell, one per source tensor
    part: one for ``[B, H, N, C]`` and MLA ``[B, N, C]``, two (K, V) for ``[2, B, N, H, D]``."""
    _check_dtype(name, t, layout)
    if t.dim() == 0 or t.stride(-1) != 1:
        raise _bad(name, t, layout, "the last dim must be contiguous")
    u = t.view(torch.uint8)
    h, n = cell_heads(layout), layout.page_size
    if t.dim() == 4 and tuple(u.shape[1:]) == (h, n, cell_bytes(layout)):
        return [u.permute(0, 2, 1, 3)]
    if t.dim() == 3 and h == 1 and tuple(u.shape[1:]) == (n, cell_bytes(layout)):
        return [u.unsqueeze(2)]
    if (t.dim() == 5 and layout.kind == "mha" and not layout.extra_planes and u.shape[0] == 2
            and tuple(u.shape[2:]) == (n, h, cell_bytes(layout) // 2)):
        return [u[0], u[1]]
    raise _bad(name, t, layout, "not a layout vLLM allocates for it")


def _plane_view(parts: list[torch.Tensor], spec: PlaneSpec, at: int, layout: KVLayout) -> torch.Tensor:
    """Typed page view ``[B, page_size, *row_shape]`` of plane ``spec`` at cell byte ``at``."""
    h = cell_heads(layout)
    width = spec.row_bytes // h
    part = parts[0]
    if len(parts) == 2:  # [2, B, N, H, D]: k (cell byte 0) is part 0, v (cell byte D) part 1
        part, at = parts[at // width], 0
    v = part[..., at:at + width].view(spec.dtype)
    return v if len(spec.row_shape) == 2 else v.squeeze(2)  # MHA k/v keep [.., H, D], also H = 1


def _cpu_attn_views(name: str, t: torch.Tensor, layout: KVLayout, layer: int) -> dict:
    """``k``/``v`` page views ``[B, N, H, D]`` of vLLM's CPU_ATTN block interior: per (block,
    head), K transposed ``[D, N]`` then V ``[N, D]`` (``engine_cells="cpu_attn"``; the
    engine's ``cpu_attn_reshape_and_cache`` writes it so, checked by the tests)."""
    _check_dtype(name, t, layout)
    h, n, d = layout.num_kv_heads, layout.page_size, layout.head_dim
    if t.dim() != 4 or tuple(t.shape[1:]) != (h, n, 2 * d) or t.stride(3) != 1 or t.stride(2) != 2 * d:
        raise _bad(name, t, layout, "CPU_ATTN keeps [B, H, N, 2 * head_dim] with each (block, head) contiguous")
    kspec, vspec = layout.planes_of_layer(layer)
    u = t.view(kspec.dtype)
    sb, sh, at = u.stride(0), u.stride(1), u.storage_offset()
    k = u.as_strided((u.shape[0], n, h, d), (sb, 1, sh, n), at)
    v = u.as_strided((u.shape[0], n, h, d), (sb, d, sh, 1), at + n * d)
    return {(kspec.name, layer): k, (vspec.name, layer): v}


def adopt_paged_kv(layout: KVLayout, kv_caches: Mapping[str, torch.Tensor] | Sequence[torch.Tensor]) -> DevicePool:
    """A ``DevicePool`` over the engine's per-layer KV tensors: no copy, page id == block id.

    ``kv_caches``: one tensor per layer in model order, target layers then draft
    layers (vLLM's ``register_kv_caches`` dict, in its order), each in a shape
    vLLM 0.33 allocates (see the module docstring; any ``VLLM_LAYOUTS`` stride
    order). Layers of different cache groups may alias the same bytes (vLLM's
    hybrid allocator): copy one group's planes with that group's block ids.
    The pool views the tensors; keep them alive and never reallocate them while
    the pool is used. Raises ``LayoutError`` naming the tensor's shape and dtype
    and the expected ones.
    """
    items = list(kv_caches.items()) if isinstance(kv_caches, Mapping) else \
        [(f"layer {i}", t) for i, t in enumerate(kv_caches)]
    want = layout.num_layers + layout.draft_layers
    if len(items) != want:
        raise LayoutError(f"{len(items)} KV tensors for layout {layout.model_id!r} with {layout.num_layers} "
                          f"layers + {layout.draft_layers} draft layers; pass one tensor per layer",
                          "kv_caches", len(items), f"need {want}")
    if layout.kind == "rows":
        raise LayoutError("kind='rows' layouts describe opaque engine rows, not per-layer KV tensors",
                          "kind", layout.kind, "use kind='mha' or 'mla'")
    blocks = {(t.shape[1] if t.dim() == 5 else t.shape[0]) for _, t in items if t.dim()}
    devices = {t.device for _, t in items}
    if len(blocks) != 1 or len(devices) != 1:
        raise LayoutError(f"KV tensors disagree on blocks {sorted(blocks)} or devices {sorted(map(str, devices))}; "
                          "every layer must have the same number of blocks on one device",
                          "kv_caches", sorted(blocks), "one block count, one device")
    num_blocks = blocks.pop()
    views: dict[tuple[str, int], torch.Tensor] = {}
    for (name, t), layer in zip(items, range(want)):
        if layout.engine_cells:
            views.update(_cpu_attn_views(name, t, layout, layer))
            continue
        draft = layer >= layout.num_layers
        parts = _cells(name, t, layout)
        at = 0
        for spec in layout.planes_of_layer(layer - layout.num_layers if draft else layer, draft):
            views[(spec.name, spec.layer)] = _plane_view(parts, spec, at, layout)
            at += spec.row_bytes // cell_heads(layout)
    return DevicePool(layout, num_blocks, devices.pop(), buffers=views)


def vllm_state_cells(t: torch.Tensor, layout: KVLayout) -> torch.Tensor:
    """vLLM 0.33's cache of one Mamba / linear-attention layer (``[B, 1, 1, C]`` int8 pages:
    ``MambaBase.bind_kv_cache`` slices conv and SSM states out of each) as the ``[B, 1, N, C/N]``
    uint8 cells of ``layout`` (an MLA-shaped byte plane of ``N`` rows: the same bytes, block
    stride kept, padded or not). Raises ``LayoutError`` naming the shape."""
    n, c = layout.page_size, layout.page_size * layout.kv_lora_rank
    if t.dim() != 4 or tuple(t.shape[1:]) != (1, 1, c) or t.element_size() != 1 or t.stride(-1) != 1:
        raise LayoutError(f"a state layer's KV tensor is {tuple(t.shape)} {t.dtype} (strides {t.stride()}); layout "
                          f"{layout.model_id!r} expects vLLM 0.33's [blocks, 1, 1, {c}] int8 state pages",
                          "kv_caches", tuple(t.shape), f"[blocks, 1, 1, {c}] int8")
    return t.view(torch.uint8).unflatten(-1, (n, c // n)).squeeze(2)


def vllm_kv_caches(layout: KVLayout, num_blocks: int, kv_layout: str = "LBNHC", *, groups: int = 1,
                   device: str | torch.device = "cpu", dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """Per-layer KV tensors exactly as vLLM 0.33 allocates them (``allocate_kv_cache``).

    One zeroed int8 allocation; layer ``i`` belongs to cache group ``i % groups`` (gpt-oss
    alternates sliding and full layers); each group is one ``KVCacheTensor`` over its layers
    at byte 0, so groups alias (``vllm/v1/core/kv_cache_planning.py``). Strides follow
    ``compute_layout_strides`` without page padding or kernel-block splits. ``dtype``: the
    view's dtype (vLLM's spec dtype; ``torch.uint8`` for fp8 caches, the default for them).
    """
    if kv_layout not in VLLM_LAYOUTS:
        raise LayoutError(f"kv_layout={kv_layout!r}; vLLM 0.33 allocates {sorted(VLLM_LAYOUTS)}",
                          "kv_layout", kv_layout, "unknown")
    order = VLLM_LAYOUTS[kv_layout]
    n_layers = layout.num_layers + layout.draft_layers
    members = [list(range(g, n_layers, groups)) for g in range(groups)]
    h, c = cell_heads(layout), cell_bytes(layout)
    page = h * layout.page_size * c
    per_group = max(len(m) for m in members)
    raw = torch.zeros(per_group * page * num_blocks, dtype=torch.int8, device=device)
    if dtype is None:
        st = layout.planes[0].dtype
        dtype = torch.uint8 if layout.extra_planes or st == torch.uint8 else st
    out: dict[str, torch.Tensor] = {}
    for layers in members:
        shape = (len(layers), num_blocks, h, layout.page_size, c)
        strides, cur = [0] * 5, 1
        for dim in reversed(order):
            strides[dim] = cur
            cur *= shape[dim]
        view5 = raw.as_strided(shape, strides, raw.storage_offset())
        for i, layer in enumerate(layers):
            out[f"model.layers.{layer}.self_attn.attn"] = view5[i].view(dtype)
    return dict(sorted(out.items(), key=lambda kv: int(kv[0].split(".")[2])))
