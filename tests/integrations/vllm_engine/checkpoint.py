"""Small seeded checkpoints for vLLM's CPU engine (no Hub, no dummy weights).

``load_format="dummy"`` fills every weight with the same small values and every
logprob comes out as -ln(vocab), so a wrong KV would go unseen. These
checkpoints are written with seeded random weights large enough that the
top-k logprobs depend on every K and V row (the negative control in the tests
shows it), in vLLM's real architectures at small real shapes:

* ``llama-gqa``: LlamaForCausalLM, 4 layers, 8 query heads over 2 KV heads, head dim 64;
* ``opt-mha``: OPTForCausalLM at opt-125m's attention shape (12 heads of 64), 2 layers;
* ``qwen3-next``: Qwen3NextForCausalLM, 4 layers (3 Gated DeltaNet, then 1 full attention
  with 2 KV heads of 64), 4 experts of which 2 per token plus a shared one, bf16
  (vLLM's CPU Gated DeltaNet kernel needs bf16). Written through transformers' own
  class from a seed, so its tensor names are the architecture's.

Each comes with a word-level tokenizer (``t0`` .. ``t{vocab-1}``), so that
``vllm serve`` and the OpenAI API work as with a Hub model. Writing one takes
well under a second; the directory is the model path vLLM is given.
"""
from __future__ import annotations

import json
import pathlib

import torch
from safetensors.torch import save_file

VOCAB = 512

SHAPES = {
    "llama-gqa": dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=512,
                      intermediate_size=1024, num_hidden_layers=4, num_attention_heads=8,
                      num_key_value_heads=2, head_dim=64, rms_norm_eps=1e-5, rope_theta=10000.0,
                      max_position_embeddings=4096, tie_word_embeddings=False, hidden_act="silu"),
    "opt-mha": dict(architectures=["OPTForCausalLM"], model_type="opt", hidden_size=768, ffn_dim=1536,
                    num_hidden_layers=2, num_attention_heads=12, word_embed_proj_dim=768,
                    do_layer_norm_before=True, activation_function="relu", max_position_embeddings=2048,
                    enable_bias=True, layer_norm_elementwise_affine=True),
}


def _llama_weights(c: dict, g: torch.Generator) -> dict[str, torch.Tensor]:
    h, hd, inter = c["hidden_size"], c["head_dim"], c["intermediate_size"]
    q, kv = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd

    def w(*shape, std=0.08):
        return torch.randn(*shape, generator=g) * std

    out = {"model.embed_tokens.weight": w(VOCAB, h, std=1.0), "model.norm.weight": 1 + w(h, std=0.1),
           "lm_head.weight": w(VOCAB, h, std=0.2)}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out.update({p + "self_attn.q_proj.weight": w(q, h), p + "self_attn.k_proj.weight": w(kv, h),
                    p + "self_attn.v_proj.weight": w(kv, h), p + "self_attn.o_proj.weight": w(h, q),
                    p + "mlp.gate_proj.weight": w(inter, h), p + "mlp.up_proj.weight": w(inter, h),
                    p + "mlp.down_proj.weight": w(h, inter), p + "input_layernorm.weight": 1 + w(h, std=0.1),
                    p + "post_attention_layernorm.weight": 1 + w(h, std=0.1)})
    return out


def _opt_weights(c: dict, g: torch.Generator) -> dict[str, torch.Tensor]:
    h, ffn = c["hidden_size"], c["ffn_dim"]

    def w(*shape, std=0.06):
        return torch.randn(*shape, generator=g) * std

    out = {"model.decoder.embed_tokens.weight": w(VOCAB, h, std=1.0),
           "model.decoder.embed_positions.weight": w(c["max_position_embeddings"] + 2, h, std=0.3),
           "model.decoder.final_layer_norm.weight": 1 + w(h, std=0.1),
           "model.decoder.final_layer_norm.bias": w(h, std=0.02)}
    for i in range(c["num_hidden_layers"]):
        p = f"model.decoder.layers.{i}."
        for proj in ("q_proj", "k_proj", "v_proj", "out_proj"):
            out[p + f"self_attn.{proj}.weight"] = w(h, h)
            out[p + f"self_attn.{proj}.bias"] = w(h, std=0.02)
        out.update({p + "fc1.weight": w(ffn, h), p + "fc1.bias": w(ffn, std=0.02), p + "fc2.weight": w(h, ffn),
                    p + "fc2.bias": w(h, std=0.02), p + "self_attn_layer_norm.weight": 1 + w(h, std=0.1),
                    p + "self_attn_layer_norm.bias": w(h, std=0.02), p + "final_layer_norm.weight": 1 + w(h, std=0.1),
                    p + "final_layer_norm.bias": w(h, std=0.02)})
    return out


def _tokenizer(path: pathlib.Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders
    vocab = {f"t{i}": i for i in range(VOCAB)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins with spaces
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "t1", "eos_token": "t2", "unk_token": "t0",
        "pad_token": "t0", "model_max_length": 4096, "clean_up_tokenization_spaces": False}))


QWEN3_NEXT = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=64, linear_num_value_heads=4, linear_num_key_heads=2,
                  linear_key_head_dim=64, linear_value_head_dim=64, linear_conv_kernel_dim=4,
                  full_attention_interval=4, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=128,
                  shared_expert_intermediate_size=128, decoder_sparse_step=1, max_position_embeddings=4096,
                  tie_word_embeddings=False)


def _qwen3_next(path: pathlib.Path, seed: int) -> None:
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM
    cfg = Qwen3NextConfig(vocab_size=VOCAB, bos_token_id=1, eos_token_id=2, pad_token_id=0, **QWEN3_NEXT)
    torch.manual_seed(seed)
    m = Qwen3NextForCausalLM(cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # matrices large enough that the top-5 logprobs depend on every state
        for _, w in m.named_parameters():
            if w.dim() >= 2:
                w.copy_(torch.randn(w.shape, generator=g) * 0.08)
        m.model.embed_tokens.weight.copy_(torch.randn(m.model.embed_tokens.weight.shape, generator=g))
    m.to(torch.bfloat16).save_pretrained(path, safe_serialization=True)


def write_checkpoint(path: str | pathlib.Path, shape: str = "llama-gqa", *, seed: int = 0,
                     dtype: str = "float32", revision: str = "") -> pathlib.Path:
    """Write checkpoint ``shape`` (a key of ``SHAPES``) with seed ``seed`` into ``path``
    (created); ``revision`` is recorded in config.json's ``_hicache_revision`` only, so
    two revisions differ in their weights (seed) and nothing else a model path shows."""
    path = pathlib.Path(path)
    path.mkdir(parents=True, exist_ok=True)
    if shape == "qwen3-next":
        _qwen3_next(path, seed)
        _tokenizer(path)
        return path
    c = dict(SHAPES[shape], vocab_size=VOCAB, torch_dtype=dtype, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    if revision:
        c["_hicache_revision"] = revision
    g = torch.Generator().manual_seed(seed)
    weights = (_llama_weights if c["model_type"] == "llama" else _opt_weights)(c, g)
    save_file({k: v.to(getattr(torch, dtype)).contiguous() for k, v in weights.items()},
              str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(c, indent=1))
    (path / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))
    _tokenizer(path)
    return path
