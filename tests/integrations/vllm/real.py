"""The README's ``vllm serve`` line through vLLM's own parser and config code, for
the models of ``hicache/data/real_models.json``.

``serve_args()`` parses the README's line with vLLM's ``vllm serve`` argument
parser; ``vllm_config()`` turns it into a ``VllmConfig`` with vLLM's
``EngineArgs`` (the model swapped for facebook/opt-125m, the one model whose
``config.json`` is on disk offline: the kv-transfer settings are the README's).
``offloading_config(shape)`` is vLLM's ``build_offloading_config`` over a
``KVCacheConfig`` of the shape's layers at block 16, described by vLLM's own KV
cache spec classes, so the primary row is the byte count vLLM computes.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import pathlib
import re
import shlex

import torch
from vllm.config import VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.config import build_offloading_config
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, MLAAttentionSpec
from vllm.v1.kv_offload.config import OffloadingConfig, OffloadingModelConfig

from hicache.core.shapes import ModelShape

ROOT = pathlib.Path(__file__).resolve().parents[3]
BLOCK = 16  # vLLM's default block size (the CUDA attention backends')
OFFLINE_MODEL = "facebook/opt-125m"


def serve_line() -> str:
    """The one ``vllm serve`` line of the README's "Use with vLLM" section."""
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Use with vLLM"):]
    (line,) = re.findall(r"^vllm serve .*$", section[:section.index("\n## ")], re.M)
    return line


@functools.cache
def serve_args():
    """``vllm serve``'s own parser over the README's line (argv after ``vllm``)."""
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.utils.argparse_utils import FlexibleArgumentParser
    parser = FlexibleArgumentParser(prog="vllm")
    ServeSubcommand().subparser_init(parser.add_subparsers(dest="subparser"))
    argv = shlex.split(serve_line())
    assert argv[:2] == ["vllm", "serve"], argv
    return parser.parse_args(argv[1:])


@functools.cache
def vllm_config() -> VllmConfig:
    from vllm.engine.arg_utils import EngineArgs
    args = argparse.Namespace(**vars(serve_args()))
    args.model = OFFLINE_MODEL  # vllm serve's cmd sets model from model_tag; this one is on disk
    return EngineArgs.from_cli_args(args).create_engine_config()


def kv_spec(shape: ModelShape):
    """vLLM's per-layer KV cache spec of one TP rank of ``shape`` at block 16."""
    dtype = getattr(torch, shape.dtype)
    if shape.is_mla:
        return MLAAttentionSpec(block_size=BLOCK, num_kv_heads=1,
                                head_size=shape.kv_lora_rank + shape.qk_rope_head_dim, dtype=dtype)
    return FullAttentionSpec(block_size=BLOCK, num_kv_heads=shape.kv_heads_per_rank, head_size=shape.head_dim,
                             dtype=dtype)


def offloading_config(shape: ModelShape, primary_rows: int = 4) -> OffloadingConfig:
    """vLLM's ``build_offloading_config`` for ``shape`` (every KV layer, draft layers
    included, in one group as vLLM groups same-spec layers), with the README's
    extra config but room for ``primary_rows`` chunks in the CPU tier."""
    layers = [f"model.layers.{i}.self_attn.attn" for i in range(shape.attention_layers + shape.draft_layers)]
    kv = KVCacheConfig(num_blocks=64, kv_cache_tensors=[],
                       kv_cache_groups=[KVCacheGroupSpec(layers, kv_spec(shape))])
    base = vllm_config()
    cfg = build_offloading_config(base, kv)
    row = cfg.worker_kv_bytes_per_block * cfg.cache.blocks_per_chunk
    extra = {**cfg.extra_config, "cpu_bytes_to_use": primary_rows * row}  # the README asks 10 GiB
    return dataclasses.replace(cfg, extra_config=extra,
                               model=OffloadingModelConfig(name=shape.hf, dtype=shape.dtype,
                                                           max_model_len=cfg.model.max_model_len))
