"""``ModelSpec``: the shapes and seed of the reference transformer, and its KV layout.

A spec fully decides the model's weights (seeded random init, see
``hicache.reference.model``) and therefore the bytes of every KV page it writes.
``ModelSpec.model_id`` folds a digest of every field into the name, so two specs
that differ in anything (vocab, seed, ...) never share L3 keys even when their
``KVLayout`` shapes agree.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from typing import Literal

import torch

from hicache.core.errors import LayoutError
from hicache.core.layout import HostLayout, KVLayout

_COMPUTE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """Frozen shapes of a decoder-only transformer (Llama-style MHA/GQA or MLA).

    MHA/GQA uses ``num_kv_heads`` x ``head_dim`` (``head_dim`` is also the query
    head dim). MLA caches one latent row of ``kv_lora_rank + rope_dim`` per token
    and up-projects it inside attention to ``num_q_heads`` keys of
    ``qk_nope_dim + rope_dim`` and values of ``v_head_dim``.
    """

    vocab: int = 128
    hidden: int = 32
    num_layers: int = 2
    num_q_heads: int = 4
    mlp: int = 64
    kind: Literal["mha", "mla"] = "mha"
    num_kv_heads: int = 2  # MHA only
    head_dim: int = 8  # MHA only
    kv_lora_rank: int = 0  # MLA only
    rope_dim: int = 0  # MLA only: decoupled rope dim of q and k
    qk_nope_dim: int = 0  # MLA only: per-head no-rope q/k dim
    v_head_dim: int = 0  # MLA only: per-head value dim
    dtype: str = "float32"  # weights, activations and KV pages
    seed: int = 0
    tie_embeddings: bool = False
    rope_theta: float = 10000.0
    max_seq_len: int = 4096  # size of the RoPE table
    norm_eps: float = 1e-6
    name: str = "hicache-ref"

    def __post_init__(self) -> None:
        def bad(field: str, why: str) -> LayoutError:
            return LayoutError(f"ModelSpec.{field}={getattr(self, field)!r}: {why}")

        for f in ("vocab", "hidden", "num_layers", "num_q_heads", "mlp", "max_seq_len"):
            if not isinstance(getattr(self, f), int) or getattr(self, f) < 1:
                raise bad(f, "must be an integer >= 1")
        if self.dtype not in _COMPUTE_DTYPES:
            raise bad("dtype", f"the reference model computes in one of {sorted(_COMPUTE_DTYPES)}")
        if self.kind == "mha":
            if self.num_kv_heads < 1 or self.head_dim < 2 or self.head_dim % 2:
                raise bad("head_dim", "MHA needs num_kv_heads >= 1 and an even head_dim >= 2")
            if self.num_q_heads % self.num_kv_heads:
                raise bad("num_q_heads", f"must be a multiple of num_kv_heads={self.num_kv_heads} (GQA)")
            if self.kv_lora_rank or self.rope_dim or self.qk_nope_dim or self.v_head_dim:
                raise bad("kind", "MLA fields (kv_lora_rank, rope_dim, qk_nope_dim, v_head_dim) must be 0 "
                          "for kind='mha'")
        elif self.kind == "mla":
            if min(self.kv_lora_rank, self.qk_nope_dim, self.v_head_dim) < 1:
                raise bad("kv_lora_rank", "MLA needs kv_lora_rank, qk_nope_dim, v_head_dim >= 1")
            if self.rope_dim < 2 or self.rope_dim % 2:
                raise bad("rope_dim", "MLA needs an even rope_dim >= 2")
            if self.num_kv_heads or self.head_dim:
                raise bad("kind", "num_kv_heads/head_dim are MHA-only; set them to 0 for kind='mla'")
        else:
            raise bad("kind", "must be 'mha' or 'mla'")

    # ------------------------------------------------------------------ derived
    @property
    def torch_dtype(self) -> torch.dtype:
        return _COMPUTE_DTYPES[self.dtype]

    @property
    def q_head_dim(self) -> int:
        return self.head_dim if self.kind == "mha" else self.qk_nope_dim + self.rope_dim

    @property
    def attn_out_dim(self) -> int:
        """Width of the concatenated attention output fed to the output projection."""
        return self.num_q_heads * (self.head_dim if self.kind == "mha" else self.v_head_dim)

    @property
    def rotary_dim(self) -> int:
        return self.head_dim if self.kind == "mha" else self.rope_dim

    @property
    def model_id(self) -> str:
        """``name`` plus a digest of every field: the weights' identity."""
        blob = json.dumps(dataclasses.asdict(self), sort_keys=True, separators=(",", ":"))
        return f"{self.name}-{hashlib.blake2b(blob.encode(), digest_size=6).hexdigest()}"

    def num_params(self, draft_layers: int = 0) -> int:
        """Parameter count (target plus ``draft_layers`` draft layers with their fusion fc)."""
        h = self.hidden
        if self.kind == "mha":
            attn = h * self.num_q_heads * self.head_dim + 2 * h * self.num_kv_heads * self.head_dim
        else:
            attn = (h * self.num_q_heads * self.q_head_dim + h * (self.kv_lora_rank + self.rope_dim)
                    + self.kv_lora_rank * self.num_q_heads * (self.qk_nope_dim + self.v_head_dim)
                    + self.kv_lora_rank)
        layer = attn + self.attn_out_dim * h + 3 * h * self.mlp + 2 * h
        emb = self.vocab * h * (1 if self.tie_embeddings else 2) + h
        return emb + self.num_layers * layer + draft_layers * (layer + 2 * h * h + 3 * h)

    def kv_layout(self, page_size: int, host_layout: HostLayout = "layer_first", *,
                  draft_layers: int = 0, model_id: str | None = None) -> KVLayout:
        """The ``KVLayout`` whose pages hold this model's KV (MHA: ``k``/``v``;
        MLA: ``latent``; plus the same planes for ``draft_layers`` draft layers)."""
        if draft_layers not in (0, 1):
            raise LayoutError(f"draft_layers={draft_layers!r}: the reference model has one draft "
                              "(NextN) layer; pass 0 or 1")
        shape = (dict(num_kv_heads=self.num_kv_heads, head_dim=self.head_dim) if self.kind == "mha"
                 else dict(kv_lora_rank=self.kv_lora_rank, rope_dim=self.rope_dim))
        return KVLayout(model_id=model_id or self.model_id, num_layers=self.num_layers, kind=self.kind,
                        dtype=self.dtype, page_size=page_size, draft_layers=draft_layers,
                        host_layout=host_layout, **shape)

    def replace(self, **changes) -> "ModelSpec":
        return dataclasses.replace(self, **changes)

    # ------------------------------------------------------------------ presets
    @classmethod
    def tiny(cls, kind: Literal["mha", "mla"] = "mha", **changes) -> "ModelSpec":
        """A model small enough for bit-exact CPU tests (milliseconds per page)."""
        base = cls() if kind == "mha" else cls(kind="mla", num_kv_heads=0, head_dim=0, kv_lora_rank=12,
                                               rope_dim=4, qk_nope_dim=6, v_head_dim=8)
        return base.replace(**changes)

    @classmethod
    def for_layout(cls, layout: KVLayout, **changes) -> "ModelSpec":
        """A spec whose KV shapes and dtype match ``layout`` (e.g. the config's model
        section); other fields take the ``tiny`` defaults unless given."""
        if layout.kind == "mha":
            base = cls(kind="mha", num_kv_heads=layout.num_kv_heads, head_dim=layout.head_dim,
                       num_q_heads=layout.num_kv_heads * 2, hidden=max(32, layout.num_kv_heads * layout.head_dim))
        else:
            base = cls.tiny("mla", kv_lora_rank=layout.kv_lora_rank, rope_dim=layout.rope_dim)
        return base.replace(num_layers=layout.num_layers, dtype=layout.dtype, **changes)

    @classmethod
    def llama3_8b(cls, **changes) -> "ModelSpec":
        """Llama-3-8B shapes (random weights), bf16: for GPU timing runs only."""
        return cls(vocab=128256, hidden=4096, num_layers=32, num_q_heads=32, num_kv_heads=8, head_dim=128,
                   mlp=14336, dtype="bfloat16", rope_theta=500000.0, max_seq_len=32768,
                   name="llama3-8b-shape").replace(**changes)
