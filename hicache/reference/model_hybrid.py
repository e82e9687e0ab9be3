"""A tiny hybrid reference model: sliding-window, full-attention and recurrent layers.

``HybridSpec.pattern`` names every layer: ``"swa"`` (causal attention over the
last ``window`` tokens, itself included), ``"full"`` (causal attention over
every token) or ``"linear"`` (a recurrent linear-attention layer: per head a
``[head_dim, head_dim]`` state ``S <- g * S + k^T v``, output ``q S``, with a
fixed per-head decay ``g``). The attention layers keep KV in a
``hicache.memory.pools.DevicePool`` exactly as ``ReferenceModel`` does (the pool's
layer ``i`` is the ``i``-th attention layer of the pattern); the linear layers
keep their state in a ``HybridState`` the caller owns, one per request.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.nn.functional as F

from hicache.reference import model_layers as ml
from hicache.reference.model import ChunkOutput, LayerHook, ReferenceModel, StoreFn, _Stack
from hicache.reference.model_kv import gather_context, write_kv
from hicache.reference.model_spec import ModelSpec
from hicache.core.errors import IntegrityError, InvalidArgument, LayoutError, PoolError
from hicache.core.groups import LayerGroup
from hicache.cache.hybrid import group_layout
from hicache.core.types import Row
from hicache.core.layout import HostLayout, KVLayout
from hicache.memory.pools import DevicePool

LayerKind = Literal["swa", "full", "linear"]


@dataclass(frozen=True, slots=True)
class HybridSpec:
    """``base`` describes the attention layers (``base.num_layers`` of them, MHA);
    ``pattern`` the whole stack in order."""

    base: ModelSpec
    pattern: tuple[LayerKind, ...]
    window: int = 6  # swa layers: tokens a query sees, itself included
    snapshot_every: int = 2  # linear layers: a state snapshot every this many pages

    def __post_init__(self) -> None:
        attn = sum(k != "linear" for k in self.pattern)
        if any(k not in ("swa", "full", "linear") for k in self.pattern) or attn != self.base.num_layers:
            raise LayoutError(f"HybridSpec.pattern={self.pattern!r}: layers must be 'swa', 'full' or 'linear' "
                              f"with base.num_layers={self.base.num_layers} attention layers")
        if self.base.kind != "mha" or self.window < 1 or self.snapshot_every < 1:
            raise LayoutError(f"HybridSpec: needs an MHA base, window >= 1 and snapshot_every >= 1, got "
                              f"kind={self.base.kind!r} window={self.window} snapshot_every={self.snapshot_every}")

    @property
    def num_linear(self) -> int:
        return sum(k == "linear" for k in self.pattern)

    @property
    def state_shape(self) -> tuple[int, int, int]:
        """One linear layer's state: ``[heads, head_dim, head_dim]`` float32."""
        b = self.base
        return (b.num_q_heads, b.head_dim, b.head_dim)

    def groups(self) -> tuple[LayerGroup, ...]:
        kv = [k for k in self.pattern if k != "linear"]
        out = [LayerGroup(kind, tuple(i for i, k in enumerate(kv) if k == kind),
                          window=self.window if kind == "swa" else 0) for kind in ("swa", "full") if kind in kv]
        if self.num_linear:
            out.append(LayerGroup("state", tuple(range(self.num_linear)),
                                  state_bytes=4 * math.prod(self.state_shape), snapshot_every=self.snapshot_every))
        return tuple(out)

    def kv_layout(self, page_size: int, host_layout: HostLayout = "layer_first") -> KVLayout:
        """The attention layers' pages, with this model's layer groups (a hybrid fingerprint)."""
        lay = self.base.kv_layout(page_size, host_layout, model_id=self.model_id)
        return lay.replace(groups=self.groups())

    @property
    def model_id(self) -> str:
        tag = f"{''.join(k[0] for k in self.pattern)}-w{self.window}-s{self.snapshot_every}"
        return f"{self.base.model_id}-hybrid-{tag}"


@dataclass
class HybridState:
    """One request's recurrent state: mutated by every ``forward_chunk`` that runs it.

    ``pos`` is the number of tokens consumed; ``snapshots`` maps a boundary
    (in pages) to copies of every linear layer's state there, taken since the
    caller last cleared it: at every ``snapshot_every``-th page and at the
    boundaries in ``marks`` (e.g. the last full page of a request's sequence).
    """

    layers: list[torch.Tensor]
    pos: int = 0
    snapshots: dict[int, list[torch.Tensor]] = field(default_factory=dict)
    marks: set[int] = field(default_factory=set)

    @classmethod
    def zeros(cls, spec: HybridSpec, device: torch.device | str = "cpu") -> "HybridState":
        return cls([torch.zeros(spec.state_shape, dtype=torch.float32, device=device)
                    for _ in range(spec.num_linear)])

    @classmethod
    def at(cls, pos: int, layers: list[torch.Tensor]) -> "HybridState":
        """A state resumed from a snapshot at token ``pos`` (copies the tensors)."""
        return cls([t.clone() for t in layers], pos)

    def check_integrity(self, spec: HybridSpec) -> None:
        if len(self.layers) != spec.num_linear or any(tuple(t.shape) != spec.state_shape for t in self.layers):
            raise IntegrityError(f"HybridState: {len(self.layers)} layers of shapes "
                                 f"{[tuple(t.shape) for t in self.layers]}, spec wants {spec.num_linear} x "
                                 f"{spec.state_shape}")
        if self.pos < 0 or not all(bool(torch.isfinite(t).all()) for t in self.layers):
            raise IntegrityError(f"HybridState: pos={self.pos} or a non-finite state")


@dataclass(slots=True)
class _LinearWeights:
    norm: torch.Tensor  # [h]
    w_qkv: torch.Tensor  # [3 * H * d, h]
    decay: torch.Tensor  # [H] in (0, 1)
    w_o: torch.Tensor  # [h, H * d]
    mlp: ml.LayerWeights  # its mlp_norm / w_gate_up / w_down


class HybridModel(ReferenceModel):
    """The reference model over a ``HybridSpec`` (exact attention only, no draft head).

    Call ``forward_chunk(pool, tokens, start, slots, state=...)``: the state
    must be at ``start`` (``state.pos == start``) and is advanced to the
    chunk's end. ``replay=True`` computes the chunk only to advance the state
    (its KV is already in the pool at those slots and is not written).

    Split pools (``swa=(swa_pool, swa_slots)``, how ``hicache.cache.hybrid``
    keeps a hybrid): ``pool`` holds the full layers only (its layer ``j`` is
    the ``j``-th full layer) and ``swa_pool`` the sliding-window layers, at
    their own slot ids (``-1`` for pages outside every window the chunk
    reads: never read). ``replay=True`` then skips only the full layers'
    writes: the SWA layers' KV of the replayed span is written again (the
    same bytes the cold run wrote).

    Bit-exact reuse follows ``hicache.reference.model``: every tile has the fixed
    shape ``page_size`` rows, attention reduces over ``ceil_to_page(p + 1)`` keys
    whatever the path; an SWA layer masks keys at or before ``p - window`` and
    zeroes every context row older than its tile's first window, so pages outside
    the window are never read (they may be freed, or hold anything). The
    recurrence consumes the tile's valid rows one by one in position order (the
    same per-row ops whatever the chunking), and records a *snapshot* of every
    linear layer's state at each boundary that is a multiple of
    ``snapshot_every`` pages. Resuming from a snapshot at boundary ``t`` therefore
    continues exactly as the cold run did.
    """

    def __init__(self, spec: HybridSpec, *, device: str | torch.device = "cpu"):
        super().__init__(spec.base, device=device, attention="exact", draft=False)
        self.hspec = spec
        init = ml._Init(spec.base.replace(seed=spec.base.seed + 7919), self.device)
        b, hd = spec.base, spec.base.num_q_heads * spec.base.head_dim
        self.linear = []
        for _ in range(spec.num_linear):
            decay = torch.linspace(0.80, 0.98, b.num_q_heads, dtype=torch.float32, device=self.device)
            self.linear.append(_LinearWeights(init.ones(b.hidden), init.linear(3 * hd, b.hidden), decay,
                                              init.linear(b.hidden, hd, 1 / math.sqrt(2 * len(spec.pattern))),
                                              ml._layer(b, init)))
        self._state: HybridState | None = None
        self._end = 0
        self._replay = False
        self._swa: tuple[DevicePool, torch.Tensor] | None = None

    def check_pool(self, pool: DevicePool, *, draft: bool = False) -> None:
        want = self.hspec.kv_layout(pool.layout.page_size, pool.layout.host_layout)
        full = group_layout(want, ("full",))  # split pools: the full layers' part of the layout
        if self._swa is not None or not pool.layout.diff(full):
            if self._swa is None and "swa" in self.hspec.pattern:
                raise PoolError(f"pool holds only the full layers of {want.model_id}: pass the SWA layers' "
                                "pool and slot ids as swa=(pool, slot_ids)")
            want = full
        diff = pool.layout.diff(want)
        if diff or draft:
            raise PoolError(f"pool layout does not fit {want.model_id} (draft={draft}): " +
                            "; ".join(f"{f}: pool={a!r} model={b!r}" for f, a, b in diff))

    def forward_chunk(self, pool: DevicePool, tokens, start_pos: int, slot_ids: torch.Tensor, *,
                      state: HybridState, replay: bool = False, all_logits: bool = False,
                      swa: tuple[DevicePool, torch.Tensor] | None = None,
                      before_layer: LayerHook | None = None) -> ChunkOutput:
        """See the class docstring. ``before_layer(i)`` runs before attention layer ``i`` (the
        hybrid layout's KV layer ``i``, either pool) reads or writes it: pass
        ``HybridAdmission.wait_layer``. Raises ``ValueError`` when ``state`` is not at
        ``start_pos``, ``PoolError`` when ``swa``'s pool is not this model's SWA group."""
        if state.pos != start_pos:
            raise ValueError(f"HybridModel.forward_chunk: state is at token {state.pos}, the chunk starts at "
                             f"{start_pos}; resume the state from a snapshot at {start_pos} first")
        n = len(tokens) if not isinstance(tokens, torch.Tensor) else int(tokens.numel())
        if swa is not None:
            self._check_swa_pool(swa[0])
        self._state, self._end, self._replay, self._swa = state, start_pos + n, replay, swa
        try:
            return super().forward_chunk(pool, tokens, start_pos, slot_ids, draft=False, all_logits=all_logits,
                                         before_layer=before_layer)
        finally:
            self._state, self._replay, self._swa = None, False, None

    def _check_swa_pool(self, pool: DevicePool) -> None:
        full = self.hspec.kv_layout(pool.layout.page_size)
        gi = next((i for i, g in enumerate(full.groups) if g.kind == "swa"), None)
        want = None if gi is None else group_layout(full, ("swa",), gi)
        if want is None or pool.layout.fingerprint() != want.fingerprint():
            raise PoolError(f"swa pool layout {pool.layout.model_id!r} is not the SWA group of "
                            f"{self.hspec.model_id} (want {None if want is None else want.model_id!r})")

    def decode_step(self, pool: DevicePool, token: int, pos: int, slot_ids: torch.Tensor, *,
                    state: HybridState, swa: tuple[DevicePool, torch.Tensor] | None = None) -> ChunkOutput:
        return self.forward_chunk(pool, [token], pos, slot_ids, state=state, swa=swa)

    # ------------------------------------------------------------------ core
    def _tile(self, pool: DevicePool, stack: _Stack, inputs: tuple[torch.Tensor, ...], t0: int, T: int,
              store: StoreFn, ctx_slots: torch.Tensor, before_layer) -> torch.Tensor:
        s, w, hs = self.spec, self.weights, self.hspec
        st = self._state
        if st is None:
            raise InvalidArgument("HybridModel computes through forward_chunk(..., state=HybridState) only")
        pos = torch.arange(t0, t0 + T, device=self.device)
        rpos = pos.clamp(max=s.max_seq_len - 1)
        cos, sin = w.rope_cos[rpos], w.rope_sin[rpos]
        a, b = max(t0, st.pos), min(t0 + T, self._end)  # this tile's valid rows
        x = stack.embed(*inputs)
        kv_i = lin_i = 0
        at = {"full": 0, "swa": 0}  # split pools: the layer's index in its own pool
        for kind in hs.pattern:
            if kind == "linear":
                lw = self.linear[lin_i]
                x = x + self._recur(st, lin_i, ml.rms_norm(x, lw.norm, s.norm_eps), t0, a, b, pool.page_size)
                x = x + ml.mlp(lw.mlp, ml.rms_norm(x, lw.mlp.mlp_norm, s.norm_eps))
                lin_i += 1
                continue
            lw = w.layers[kv_i]
            q, kv = ml.project(s, lw, ml.rms_norm(x, lw.attn_norm, s.norm_eps), cos, sin)
            if before_layer is not None:
                before_layer(kv_i)  # its pages (full or SWA pool) are on L1 from here on
            old = max(0, t0 - hs.window + 1) if kind == "swa" else 0  # no query of this tile sees a key before
            if self._swa is not None and kind == "swa":
                ctx = self._swa_context(at["swa"], kv, t0, T, a, b, old, x.dtype)
            else:
                li = at[kind] if self._swa is not None else kv_i
                if not self._replay:
                    store(li, kv)
                ctx = gather_context(pool, li, ctx_slots, t0 + T, x.dtype)
                for t in ctx.values():
                    t[:old] = 0
            x = x + F.linear(_attend(q, ctx["k"], ctx["v"], pos, hs.window if kind == "swa" else 0), lw.w_o)
            x = x + ml.mlp(lw, ml.rms_norm(x, lw.mlp_norm, s.norm_eps))
            kv_i += 1
            at[kind] += 1
        st.pos = max(st.pos, b)
        return x

    def _swa_context(self, layer: int, kv: dict, t0: int, T: int, a: int, b: int, old: int,
                     dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """Split pools: write rows ``[a, b)`` of this tile into the SWA pool (always, replay
        too) and read back keys ``[old, b)`` (older ones are zeros, as on one pool)."""
        assert self._swa is not None, "split pools: the SWA context needs the SWA pool attached"
        spool, sslots = self._swa
        sslots = sslots.to(self.device)
        tslots = torch.full((T,), -1, dtype=torch.int64, device=self.device)
        tslots[a - t0:b - t0] = sslots[a:b]
        prov = torch.full((T,), int(Row.STATIC_PAD), dtype=torch.int8, device=self.device)
        prov[a - t0:b - t0] = int(Row.VALID)
        write_kv(spool, layer, kv, tslots, prov)
        ctx = gather_context(spool, layer, sslots[old:b], b - old, dtype)
        out = {}
        for name, t in ctx.items():
            full = torch.zeros((t0 + T, *t.shape[1:]), dtype=dtype, device=t.device)
            full[old:b] = t
            out[name] = full
        return out

    def _recur(self, st: HybridState, li: int, h: torch.Tensor, t0: int, a: int, b: int,
               page_size: int) -> torch.Tensor:
        """Rows ``[a, b)`` of the tile at ``t0`` through linear layer ``li``'s recurrence
        (mutates its state in ``st``; records its snapshots); other rows output zeros."""
        lw = self.linear[li]
        S = st.layers[li]
        H, d = S.shape[0], S.shape[1]
        qkv = F.linear(h, lw.w_qkv).float().view(h.shape[0], 3, H, d)
        q, k = F.normalize(qkv[:, 0], dim=-1), F.normalize(qkv[:, 1], dim=-1)
        v = qkv[:, 2]
        out = torch.zeros((h.shape[0], H, d), dtype=torch.float32, device=h.device)
        every = self.hspec.snapshot_every * page_size
        for p in range(a, b):
            r = p - t0
            S.mul_(lw.decay[:, None, None]).add_(k[r][:, :, None] * v[r][:, None, :])
            out[r] = torch.bmm(q[r][:, None, :], S)[:, 0]
            if (p + 1) % every == 0 or ((p + 1) % page_size == 0 and (p + 1) // page_size in st.marks):
                st.snapshots.setdefault((p + 1) // page_size, [S] * len(st.layers))[li] = S.clone()
        return F.linear(out.view(h.shape[0], H * d).to(h.dtype), lw.w_o)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, window: int) -> torch.Tensor:
    """``model_layers.attend``'s exact path with an optional sliding window (0: none):
    key ``j`` is visible to the query at ``p`` when ``p - window < j <= p``."""
    T, H, d = q.shape
    L, Hk, dv = v.shape
    G = H // Hk
    kpos = torch.arange(L, device=q.device)[None, :]
    masked = kpos > q_pos[:, None]
    if window:
        masked |= kpos <= q_pos[:, None] - window
    qg = q.view(T, Hk, G, d).permute(1, 2, 0, 3).reshape(Hk, G * T, d)
    s = torch.bmm(qg, k.permute(1, 2, 0)).view(Hk, G, T, L) * (1.0 / math.sqrt(d))
    p = s.masked_fill(masked, float("-inf")).softmax(dim=-1, dtype=torch.float32).to(v.dtype)
    o = torch.bmm(p.view(Hk, G * T, L), v.permute(1, 0, 2))
    return o.view(Hk, G, T, dv).permute(2, 0, 1, 3).reshape(T, H * dv)
