"""A shaped hybrid forward for ``bench/ttft_hybrid.py``: the real layer pattern and KV / state
shapes of gpt-oss-120b and Qwen3-Next-80B-A3B, with random bf16 weights (GPU only).

What is real: the layer pattern (gpt-oss: sliding-window 128 and full attention
alternating, 36 layers; Qwen3-Next: 3 linear-attention layers then 1 full, 48
layers), the hidden sizes, the query / KV heads and head dims, the KV rows the
pools hold and the state a linear layer keeps (Gated DeltaNet: 32 value heads
of ``[128, 128]`` plus its conv tail, ``hybrid.gdn_state_bytes``). What is not:
the MoE feed-forward is one dense SwiGLU of the *active* experts' width (the same
matmul FLOPs per token, no routing), the vocabulary is 32000, there is no rope,
and the linear layer is a gated linear attention with a fixed per-head decay
(the DeltaNet's delta rule and conv are left out; the conv tail of a snapshot is
moved but not read). Bit-exactness is not the point here (``tests/reference``
proves it on the reference model): warm and cold logits are compared loosely.

Attention layer ``j`` (the ``j``-th attention layer of the pattern) keeps its K
and V rows in plane ``(k|v, j)`` of a ``DevicePool``; the linear layers' states
are one snapshot row of a state pool (``hicache.cache.hybrid.group_layout(layout, ("state",), gi)``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from hicache.core.groups import QWEN3_NEXT_LINEAR
from hicache.core.layout import KVLayout
from hicache.memory.pools import DevicePool

LINEAR_CHUNK = 512  # tokens per intra-chunk block of the linear attention (cold)
SWA_BLOCK = 512  # queries per masked attention call: an SWA block reads window + block keys, not the prefix


@dataclass(frozen=True)
class Shape:
    name: str
    pattern: tuple[str, ...]  # "swa", "full", "linear" per layer
    hidden: int
    q_heads: int
    kv_heads: int
    head_dim: int
    mlp: int  # dense width = active experts x expert width (+ shared expert)
    window: int = 0


SHAPES = {
    # gpt-oss-120b config.json: hidden 2880, 64 q / 8 kv heads of 64, 128 experts of 2880, 4 active.
    "gpt-oss-120b": Shape("gpt-oss-120b", ("swa", "full") * 18, 2880, 64, 8, 64, 4 * 2880, window=128),
    # Qwen3-Next-80B-A3B: hidden 2048, 16 q / 2 kv heads of 256, 512 experts of 512, 10 active + 1 shared.
    "qwen3-next-80b-a3b": Shape("qwen3-next-80b-a3b", ("linear", "linear", "linear", "full") * 12, 2048, 16, 2,
                                256, 11 * 512),
}


def _w(g: torch.Generator, out: int, inp: int, dev) -> torch.Tensor:
    return (torch.randn(out, inp, generator=g, device=dev) / math.sqrt(inp)).to(torch.bfloat16)


class HybridForward:
    """``forward(...)`` runs positions ``[start, start + T)`` over the pools; see module docstring."""

    def __init__(self, shape: Shape, layout: KVLayout, device: str = "cuda", seed: int = 0):
        self.s, self.layout, self.dev = shape, layout, torch.device(device)
        g = torch.Generator(device=self.dev).manual_seed(seed)
        h, d = shape.hidden, shape.head_dim
        lin = QWEN3_NEXT_LINEAR
        self.embed = _w(g, 32000, h, self.dev)
        self.head = _w(g, 32000, h, self.dev)
        self.layers = []
        for kind in shape.pattern:
            w = {"up": _w(g, 2 * shape.mlp, h, self.dev), "down": _w(g, h, shape.mlp, self.dev)}
            if kind == "linear":
                w["qkv"] = _w(g, 2 * lin["num_k_heads"] * lin["k_dim"] + lin["num_v_heads"] * lin["v_dim"], h, self.dev)
                w["o"] = _w(g, h, lin["num_v_heads"] * lin["v_dim"], self.dev)
                w["decay"] = torch.linspace(0.90, 0.999, lin["num_v_heads"], device=self.dev)
            else:
                w["qkv"] = _w(g, (shape.q_heads + 2 * shape.kv_heads) * d, h, self.dev)
                w["o"] = _w(g, h, shape.q_heads * d, self.dev)
            self.layers.append(w)

    # ------------------------------------------------------------------ forward
    def forward(self, pool: DevicePool, tokens: torch.Tensor, start: int, slots: torch.Tensor,
                state: "LinearState", *, before_layer: Callable[[int], None] | None = None,
                before_state: Callable[[], None] | None = None, snapshot_at: int = -1) -> torch.Tensor:
        """Logits of the last position. ``slots``: the pool slot of every position
        ``0 .. start + T - 1``. ``state`` holds every linear layer's state at ``start`` (mutated
        to ``start + T``); with ``snapshot_at`` in ``(start, start + T)`` it also keeps the
        states there in ``state.snap``. ``before_layer(j)`` runs before attention layer ``j``
        reads the pool, ``before_state()`` before the first linear layer reads its state."""
        x = F.embedding(tokens, self.embed)
        j = lin_i = 0
        for kind, w in zip(self.s.pattern, self.layers):
            hN = F.rms_norm(x, (x.shape[-1],))
            if kind == "linear":
                if lin_i == 0 and before_state is not None:
                    before_state()
                o = self._linear(w, hN, state, lin_i, start, snapshot_at)
                lin_i += 1
            else:
                o = self._attention(w, hN, pool, j, start, slots, kind, before_layer)
                j += 1
            x = x + F.linear(o, w["o"])
            gate, up = F.linear(F.rms_norm(x, (x.shape[-1],)), w["up"]).chunk(2, dim=-1)
            x = x + F.linear(F.silu(gate) * up, w["down"])
        return F.linear(F.rms_norm(x[-1:], (x.shape[-1],)), self.head)[0].float()

    def _attention(self, w, hN, pool: DevicePool, j: int, start: int, slots: torch.Tensor, kind: str,
                   before_layer) -> torch.Tensor:
        s, T = self.s, hN.shape[0]
        d = s.head_dim
        q, k, v = F.linear(hN, w["qkv"]).split([s.q_heads * d, s.kv_heads * d, s.kv_heads * d], dim=-1)
        kb, vb = pool.plane("k", j), pool.plane("v", j)
        if before_layer is not None:
            before_layer(j)  # the load back of this layer's pages has landed (device-side wait)
        new = slots[start:start + T]
        kb.index_copy_(0, new, k.view(T, s.kv_heads, d))
        vb.index_copy_(0, new, v.view(T, s.kv_heads, d))
        lo = max(0, start - s.window + 1) if kind == "swa" else 0  # SWA: never read pages outside the window
        ctx = slots[lo:start + T]
        K, V = kb.index_select(0, ctx), vb.index_select(0, ctx)
        if kind == "full" and start == 0:  # cold: plain causal (the flash kernel)
            o = F.scaled_dot_product_attention(q.view(1, T, s.q_heads, d).transpose(1, 2), _heads(K, s),
                                               _heads(V, s), is_causal=True)
            return o.transpose(1, 2).reshape(T, s.q_heads * d)
        # Masked, in query blocks that read only the keys they can see (SWA: their window).
        outs = []
        for b0 in range(0, T, SWA_BLOCK):
            b1 = min(T, b0 + SWA_BLOCK)
            k0 = max(lo, start + b0 - s.window + 1) if kind == "swa" else lo
            qpos = torch.arange(start + b0, start + b1, device=self.dev)[:, None]
            kpos = torch.arange(k0, start + b1, device=self.dev)[None, :]
            mask = kpos <= qpos
            if kind == "swa":
                mask &= kpos > qpos - s.window
            o = F.scaled_dot_product_attention(q[b0:b1].view(1, b1 - b0, s.q_heads, d).transpose(1, 2),
                                               _heads(K[k0 - lo:start + b1 - lo], s),
                                               _heads(V[k0 - lo:start + b1 - lo], s), attn_mask=mask)
            outs.append(o.transpose(1, 2).reshape(b1 - b0, s.q_heads * d))
        return torch.cat(outs) if len(outs) > 1 else outs[0]

    def _linear(self, w, hN, state: "LinearState", i: int, start: int, snapshot_at: int) -> torch.Tensor:
        """Gated linear attention: per value head ``S <- g S + k^T v``, output ``q S``."""
        lin = QWEN3_NEXT_LINEAR
        T, Hk, Hv, dk, dv = hN.shape[0], lin["num_k_heads"], lin["num_v_heads"], lin["k_dim"], lin["v_dim"]
        q, k, v = F.linear(hN, w["qkv"]).float().split([Hk * dk, Hk * dk, Hv * dv], dim=-1)
        rep = Hv // Hk
        q = F.normalize(q.view(T, Hk, dk), dim=-1).repeat_interleave(rep, 1).transpose(0, 1)  # [Hv, T, dk]
        k = F.normalize(k.view(T, Hk, dk), dim=-1).repeat_interleave(rep, 1).transpose(0, 1)
        v = v.view(T, Hv, dv).transpose(0, 1)
        lg = w["decay"].log()[:, None]  # [Hv, 1]
        S = state.get(i)
        out = torch.empty(Hv, T, dv, device=self.dev)
        for c0 in range(0, T, LINEAR_CHUNK):
            c1 = min(T, c0 + LINEAR_CHUNK)
            if c0 < snapshot_at - start < c1 or snapshot_at - start == c0 > 0:
                state.snap[i] = _advance(S, k[:, c0:snapshot_at - start], v[:, c0:snapshot_at - start], lg)
            out[:, c0:c1], S = _chunk(S, q[:, c0:c1], k[:, c0:c1], v[:, c0:c1], lg)
        if snapshot_at - start == T:
            state.snap[i] = S
        state.put(i, S)
        return out.transpose(0, 1).reshape(T, Hv * dv).to(torch.bfloat16)


def _heads(x: torch.Tensor, s: Shape) -> torch.Tensor:
    """``[L, kv_heads, d]`` -> ``[1, q_heads, L, d]`` (GQA by repeating: masked kernels take no enable_gqa)."""
    return x.repeat_interleave(s.q_heads // s.kv_heads, 1).transpose(0, 1)[None]


def _chunk(S, q, k, v, lg):
    """One block of positions from state ``S``: outputs and the state after it."""
    C = q.shape[1]
    t = torch.arange(C, device=q.device, dtype=torch.float32)
    D = torch.exp((t[:, None] - t[None, :])[None] * lg[:, :, None]).tril()  # [Hv, C, C]: g^(i-j), j <= i
    out = torch.bmm(torch.bmm(q, k.transpose(1, 2)) * D, v) + torch.exp((t + 1)[None, :, None] * lg[:, :, None]) \
        * torch.bmm(q, S)
    return out, _advance(S, k, v, lg)


def _advance(S, k, v, lg):
    """``S`` after positions ``k, v`` (no outputs)."""
    C = k.shape[1]
    t = torch.arange(C, device=k.device, dtype=torch.float32)
    wk = k * torch.exp((C - 1 - t)[None, :, None] * lg[:, :, None])
    return torch.exp(C * lg)[:, :, None] * S + torch.bmm(wk.transpose(1, 2), v)


class LinearState:
    """Every linear layer's ``[Hv, dk, dv]`` float32 state at one position, and snapshots taken on the way.

    A snapshot row (``hicache.cache.hybrid.group_layout``, kind ``rows``) holds each layer's state as bf16 followed by
    the conv tail, ``gdn_state_bytes`` per layer: ``to_row`` / ``from_row`` convert."""

    def __init__(self, n: int, device, row_layer_bytes: int):
        lin = QWEN3_NEXT_LINEAR
        self.shape = (lin["num_v_heads"], lin["k_dim"], lin["v_dim"])
        self.layers = [torch.zeros(self.shape, device=device) for _ in range(n)]
        self.snap: dict[int, torch.Tensor] = {}
        self.layer_bytes = row_layer_bytes

    def get(self, i: int) -> torch.Tensor:
        return self.layers[i]

    def put(self, i: int, S: torch.Tensor) -> None:
        self.layers[i] = S

    def snap_to_row(self, row: torch.Tensor) -> None:
        """Write the snapshots (bf16) into one state-pool row (``uint8 [row_bytes]``)."""
        n = math.prod(self.shape) * 2
        for i, S in self.snap.items():
            row[i * self.layer_bytes:i * self.layer_bytes + n].copy_(S.to(torch.bfloat16).view(-1).view(torch.uint8))

    def from_row(self, row: torch.Tensor) -> None:
        """The states read back from a state-pool row (as the snapshot left them, bf16)."""
        n = math.prod(self.shape) * 2
        for i in range(len(self.layers)):
            b = row[i * self.layer_bytes:i * self.layer_bytes + n]
            self.layers[i] = b.view(torch.bfloat16).view(self.shape).float()
