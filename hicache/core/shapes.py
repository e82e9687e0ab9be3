"""Published model shapes (``hicache/data/real_models.json``) as ``KVLayout`` s.

The table is a copy of ``shared/shapes/real_models.json``: each model's KV
shape from its ``config.json`` (layers, KV heads per rank, head dim, dtype,
MLA ranks, sliding windows). Tests and benches use it so that row and page
sizes are the real ones; ``hicache replay --simulate --shape NAME`` accounts
bytes with it.

Byte sizes (per token, per layer): MHA/GQA ``2 x kv_heads x head_dim x dtype``;
MLA ``(kv_lora_rank + qk_rope_head_dim) x dtype``. ``llama-3.1-70b-tp8`` is
one TP rank's share (``kv_heads / tp``). Hybrid models (``gqa+swa``,
``hybrid``) are described here by their attention layers as if every one
kept full KV; what a hybrid-aware layout saves is not modelled yet.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cache
from importlib import resources

from hicache.core.errors import ConfigError
from hicache.core.layout import _DTYPES, KVLayout

__all__ = ["ModelShape", "model_shapes", "model_shape", "shape_names"]


@dataclass(frozen=True, slots=True)
class ModelShape:
    """One row of the shapes table (per TP rank where the row names ``tp``)."""

    name: str  # short name, e.g. "llama-3.1-8b"
    hf: str  # the Hugging Face model id the facts come from
    kind: str  # "mha", "gqa", "mla", "gqa+swa", "hybrid"
    layers: int  # layers that keep KV as full attention would (see attention_layers)
    dtype: str
    kv_heads: int = 0  # total KV heads (before TP)
    head_dim: int = 0
    kv_lora_rank: int = 0  # MLA
    qk_rope_head_dim: int = 0  # MLA
    draft_layers: int = 0  # NextN / MTP layers with their own KV
    tp: int = 1
    sliding_window: int = 0  # gqa+swa: window of the sliding layers
    full_attention_every: int = 0  # hybrid: one full-attention layer in this many
    note: str = ""

    @property
    def is_mla(self) -> bool:
        return self.kind == "mla"

    @property
    def attention_layers(self) -> int:
        """Layers that keep per-token KV (the full-attention layers of a ``hybrid``)."""
        if self.kind == "hybrid" and self.full_attention_every:
            return self.layers // self.full_attention_every
        return self.layers

    @property
    def kv_heads_per_rank(self) -> int:
        return max(1, self.kv_heads // self.tp) if self.kv_heads else 0

    @property
    def layer_token_bytes(self) -> int:
        """KV bytes of one token in one layer (one TP rank)."""
        size = _DTYPES[self.dtype][1]
        if self.is_mla:
            return (self.kv_lora_rank + self.qk_rope_head_dim) * size
        return 2 * self.kv_heads_per_rank * self.head_dim * size

    @property
    def token_bytes(self) -> int:
        """KV bytes of one token across every KV-keeping layer, draft layers included."""
        return self.layer_token_bytes * (self.attention_layers + self.draft_layers)

    def page_bytes(self, page_size: int) -> int:
        """Bytes of one page (``page_size`` tokens) of every layer: vLLM's per-block row."""
        return self.token_bytes * page_size

    def kv_layout(self, page_size: int, *, layers: int | None = None, draft: bool = True,
                  host_layout: str = "layer_first", **extra) -> KVLayout:
        """The ``KVLayout`` of this model at ``page_size`` (``layers`` fewer where memory
        requires: per-layer and per-page-per-layer sizes stay the real ones). A row with
        ``tp`` gives TP rank 0 of ``tp`` (pass ``tp_rank=`` for another): the rank is in
        the fingerprint, so ranks holding different heads never share L3 objects."""
        n = self.attention_layers if layers is None else layers
        extra.setdefault("tp_size", self.tp)
        common = dict(model_id=self.hf, num_layers=n, dtype=self.dtype, page_size=page_size,
                      draft_layers=self.draft_layers if draft else 0, host_layout=host_layout, **extra)
        if self.is_mla:
            return KVLayout(kind="mla", kv_lora_rank=self.kv_lora_rank, rope_dim=self.qk_rope_head_dim, **common)
        return KVLayout(kind="mha", num_kv_heads=self.kv_heads_per_rank, head_dim=self.head_dim, **common)


@cache
def model_shapes() -> tuple[ModelShape, ...]:
    """Every model of the table, in its order."""
    raw = json.loads(resources.files("hicache.data").joinpath("real_models.json").read_text())
    return tuple(ModelShape(**m) for m in raw["models"])


def shape_names() -> list[str]:
    return [m.name for m in model_shapes()]


def model_shape(name: str) -> ModelShape:
    """The shape named ``name``; ``ConfigError`` listing the names otherwise."""
    for m in model_shapes():
        if m.name == name:
            return m
    raise ConfigError(f"unknown model shape {name!r}; known: {', '.join(shape_names())}")
