"""Weights and the per-layer math of the reference transformer (no KV bookkeeping here).

Every function is row-local except ``attend``: row ``i`` of a result depends
only on row ``i`` of the inputs. Combined with fixed tensor shapes (see
``hicache.reference.model``) that makes the CPU float32 results independent of
which other rows share a batch, bit for bit.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from hicache.reference.model_spec import ModelSpec


@dataclass(slots=True)
class LayerWeights:
    """One decoder layer. Shapes use h=hidden, H=num_q_heads."""

    attn_norm: torch.Tensor  # [h]
    mlp_norm: torch.Tensor  # [h]
    w_q: torch.Tensor  # [H * q_head_dim, h]
    w_kv: torch.Tensor  # MHA: [2 * kv_heads * head_dim, h] (k then v); MLA: [kv_lora_rank + rope_dim, h]
    w_o: torch.Tensor  # [h, attn_out_dim]
    w_gate_up: torch.Tensor  # [2 * mlp, h] (gate then up)
    w_down: torch.Tensor  # [h, mlp]
    kv_norm: torch.Tensor | None = None  # MLA: [kv_lora_rank], applied to the latent before caching
    w_ukv: torch.Tensor | None = None  # MLA: [H * (qk_nope_dim + v_head_dim), kv_lora_rank]


@dataclass(slots=True)
class DraftWeights:
    """The NextN / EAGLE head: fuse (token embedding, target hidden) then one decoder layer."""

    emb_norm: torch.Tensor  # [h]
    hid_norm: torch.Tensor  # [h]
    fc: torch.Tensor  # [h, 2h]
    layer: LayerWeights
    final_norm: torch.Tensor  # [h]


@dataclass(slots=True)
class Weights:
    embed: torch.Tensor  # [vocab, h]
    layers: list[LayerWeights]
    final_norm: torch.Tensor  # [h]
    lm_head: torch.Tensor  # [vocab, h]; the embedding itself when tied
    rope_cos: torch.Tensor  # [max_seq_len, rotary_dim / 2] float32
    rope_sin: torch.Tensor
    draft: DraftWeights | None


# Scale of the draft's random (non-identity) parts; see init_weights.
DRAFT_DAMP = 0.1


class _Init:
    """Seeded draws in a fixed order; on the meta device, shapes only."""

    def __init__(self, spec: ModelSpec, device: torch.device):
        self.device, self.dtype = device, spec.torch_dtype
        self.gen = None if device.type == "meta" else torch.Generator(device=device).manual_seed(spec.seed)

    def normal(self, *shape: int, std: float) -> torch.Tensor:
        if self.gen is None:
            return torch.empty(shape, dtype=self.dtype, device=self.device)
        t = torch.randn(shape, generator=self.gen, device=self.device, dtype=torch.float32)
        return t.mul_(std).to(self.dtype)

    def linear(self, out: int, inp: int, depth_scale: float = 1.0) -> torch.Tensor:
        return self.normal(out, inp, std=depth_scale / math.sqrt(inp))

    def ones(self, n: int) -> torch.Tensor:
        return torch.ones(n, dtype=self.dtype, device=self.device)


def _layer(spec: ModelSpec, init: _Init, damp: float = 1.0) -> LayerWeights:
    h, H = spec.hidden, spec.num_q_heads
    out_scale = damp / math.sqrt(2 * spec.num_layers)
    if spec.kind == "mha":
        w_kv = init.linear(2 * spec.num_kv_heads * spec.head_dim, h)
        mla = {}
    else:
        w_kv = init.linear(spec.kv_lora_rank + spec.rope_dim, h)
        mla = dict(kv_norm=init.ones(spec.kv_lora_rank),
                   w_ukv=init.linear(H * (spec.qk_nope_dim + spec.v_head_dim), spec.kv_lora_rank))
    return LayerWeights(attn_norm=init.ones(h), mlp_norm=init.ones(h), w_q=init.linear(H * spec.q_head_dim, h),
                        w_kv=w_kv, w_o=init.linear(h, spec.attn_out_dim, out_scale),
                        w_gate_up=init.linear(2 * spec.mlp, h), w_down=init.linear(h, spec.mlp, out_scale), **mla)


def init_weights(spec: ModelSpec, device: torch.device, *, draft: bool) -> Weights:
    """Seeded random weights. The same (spec, device type) always gives the same
    tensors; the CPU and CUDA generators differ, so weights differ across them."""
    init = _Init(spec, device)
    embed = init.normal(spec.vocab, spec.hidden, std=1.0)
    layers = [_layer(spec, init) for _ in range(spec.num_layers)]
    lm_head = embed if spec.tie_embeddings else init.linear(spec.vocab, spec.hidden)
    dw = None
    if draft:
        # Random weights cannot be trained, so the draft starts near the one predictor
        # that agrees with a random target: its embedding -> LM head "bigram" path
        # (fc ~ [I | eps], a damped layer). Like a trained NextN head it then proposes
        # the target's next token often (about 30-50% per token on the tiny presets).
        fc = init.linear(spec.hidden, 2 * spec.hidden, DRAFT_DAMP)
        if fc.device.type != "meta":
            fc[:, :spec.hidden] += torch.eye(spec.hidden, dtype=fc.dtype, device=fc.device)
        dw = DraftWeights(emb_norm=init.ones(spec.hidden), hid_norm=init.ones(spec.hidden), fc=fc,
                          layer=_layer(spec, init, DRAFT_DAMP), final_norm=init.ones(spec.hidden))
    rd = spec.rotary_dim
    inv_freq = 1.0 / (spec.rope_theta ** (torch.arange(0, rd, 2, dtype=torch.float64) / rd))
    ang = torch.outer(torch.arange(spec.max_seq_len, dtype=torch.float64), inv_freq)
    return Weights(embed=embed, layers=layers, final_norm=init.ones(spec.hidden), lm_head=lm_head,
                   rope_cos=ang.cos().to(torch.float32).to(device), rope_sin=ang.sin().to(torch.float32).to(device),
                   draft=dw)


# ----------------------------------------------------------------------- math
def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (y * w.float()).to(x.dtype)


def rms_norm_fused(x: torch.Tensor, w32: torch.Tensor, eps: float) -> torch.Tensor:
    """``rms_norm`` through ``F.rms_norm`` (fewer kernel launches; fast path only:
    not bit-identical to ``rms_norm``). ``w32`` is the weight in float32."""
    return F.rms_norm(x.float(), (x.shape[-1],), w32, eps).to(x.dtype)


def project_fast(spec: ModelSpec, w: LayerWeights, a: torch.Tensor, cos: torch.Tensor,
                 sin: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``project`` with one RoPE over queries and keys together (MHA; same values,
    half the launches). MLA uses ``project``."""
    if spec.kind != "mha":
        return project(spec, w, a, cos, sin)
    T, H, Hk = a.shape[0], spec.num_q_heads, spec.num_kv_heads
    q = F.linear(a, w.w_q).view(T, H, spec.q_head_dim)
    kv = F.linear(a, w.w_kv).view(T, 2, Hk, spec.head_dim)
    qk = rope(torch.cat((q, kv[:, 0]), dim=1), cos, sin)
    return qk[:, :H], {"k": qk[:, H:], "v": kv[:, 1]}


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE of ``x`` ``[T, heads, d]`` with ``cos``/``sin`` ``[T, d/2]``."""
    x1, x2 = x.float().chunk(2, dim=-1)
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).to(x.dtype)


def project(spec: ModelSpec, w: LayerWeights, a: torch.Tensor, cos: torch.Tensor,
            sin: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Queries ``[T, H, q_head_dim]`` and the KV rows to cache, keyed by plane name."""
    T, H = a.shape[0], spec.num_q_heads
    q = F.linear(a, w.w_q).view(T, H, spec.q_head_dim)
    kv = F.linear(a, w.w_kv)
    if spec.kind == "mha":
        k, v = kv.view(T, 2, spec.num_kv_heads, spec.head_dim).unbind(1)
        return rope(q, cos, sin), {"k": rope(k, cos, sin), "v": v.contiguous()}
    r, nope = spec.kv_lora_rank, spec.qk_nope_dim
    q = torch.cat((q[..., :nope], rope(q[..., nope:], cos, sin)), dim=-1)
    c = rms_norm(kv[:, :r], w.kv_norm, spec.norm_eps)
    k_rope = rope(kv[:, None, r:], cos, sin)[:, 0]
    return q, {"latent": torch.cat((c, k_rope), dim=-1)}


def expand_kv(spec: ModelSpec, w: LayerWeights, ctx: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Cached context rows -> keys ``[L, Hk, q_head_dim]`` and values ``[L, Hk, dv]``."""
    if spec.kind == "mha":
        return ctx["k"], ctx["v"]
    lat = ctx["latent"]
    L, H, r, nope = lat.shape[0], spec.num_q_heads, spec.kv_lora_rank, spec.qk_nope_dim
    kv = F.linear(lat[:, :r].contiguous(), w.w_ukv).view(L, H, nope + spec.v_head_dim)
    k = torch.cat((kv[..., :nope], lat[:, None, r:].expand(L, H, spec.rope_dim)), dim=-1)
    return k, kv[..., nope:]


def causal_allowed(q_pos: torch.Tensor, L: int) -> torch.Tensor:
    """``[T, L]`` boolean: key ``j`` is visible to the query at ``q_pos[t]``."""
    return torch.arange(L, device=q_pos.device)[None, :] <= q_pos[:, None]


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, *, exact: bool,
           allowed: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of queries at absolute positions ``q_pos`` over keys at
    positions ``0 .. L-1``; returns ``[T, H * dv]``.

    ``exact``: explicit bmm + softmax whose reduction length is ``L`` for every
    query, so a query's result depends only on ``L`` and on the unmasked keys.
    Otherwise ``scaled_dot_product_attention`` (fast, not bit-reproducible).
    """
    T, H, d = q.shape
    L, Hk, dv = v.shape
    G = H // Hk
    scale = 1.0 / math.sqrt(d)
    if not exact and T == L:
        masked = None  # a whole sequence from position 0: plain causal, no [T, L] mask
    elif not exact and allowed is not None:
        masked = False  # the caller built the mask once for every layer
    else:
        masked = torch.arange(L, device=q.device)[None, :] > q_pos[:, None]  # [T, L]
    if not exact:
        kw = (dict(is_causal=True) if masked is None else
              dict(attn_mask=allowed) if masked is False else dict(attn_mask=~masked))
        o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                           v.transpose(0, 1)[None], scale=scale, enable_gqa=G > 1, **kw)
        return o[0].transpose(0, 1).reshape(T, H * dv)
    qg = q.view(T, Hk, G, d).permute(1, 2, 0, 3).reshape(Hk, G * T, d)
    s = torch.bmm(qg, k.permute(1, 2, 0)).view(Hk, G, T, L) * scale
    p = s.masked_fill(masked, float("-inf")).softmax(dim=-1, dtype=torch.float32).to(v.dtype)
    o = torch.bmm(p.view(Hk, G * T, L), v.permute(1, 0, 2))  # [Hk, G*T, dv]
    return o.view(Hk, G, T, dv).permute(2, 0, 1, 3).reshape(T, H * dv)


def mlp(w: LayerWeights, m: torch.Tensor) -> torch.Tensor:
    gate, up = F.linear(m, w.w_gate_up).chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, w.w_down)
