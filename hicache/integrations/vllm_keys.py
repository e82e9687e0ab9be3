"""What a page is keyed by under vLLM: everything vLLM keys its own blocks by.

vLLM's block hash chains a block's token ids with extra keys: multimodal items
(hash and offset), prompt embeddings, LoRA (name and path) and the cache salt
(``vllm/v1/core/kv_cache_utils.py`` ``generate_block_hash_extra_keys``). The
connector's index is keyed by token ids under a namespace, so:

* ``namespace``: LoRA name and path and cache salt (every page of the request);
* ``index_key``: pages whose extra keys carry more (images, audio, prompt
  embeddings) get their ids replaced by values derived from those keys
  (``hicache.core.hashing.content_key``); None for text-only requests;
* ``model_identity``: the layout's model id names what decides the KV besides
  the layout: revision, quantization, dtype, rope settings, ``hf_overrides``,
  the attention backend, and for a local checkpoint its config and a sample
  of its weight files;
* ``attention_backend``: the backend vLLM selects for the KV cache spec.
"""
from __future__ import annotations

import hashlib
import json
import os
import pathlib

from hicache.core.errors import ConfigError
from hicache.core.hashing import content_key, tokens_to_bytes

__all__ = ["ENGINE_CELLS_OF", "attention_backend", "index_key", "model_identity", "namespace"]

# vLLM backends whose block interior is not (head, token) cells of K then V.
ENGINE_CELLS_OF = {"CPU_ATTN": "cpu_attn"}
# Extra-key tags already in the namespace (they apply to every page alike).
_IN_NAMESPACE = ("lora", "cache_salt")
_SAMPLE = 1 << 16  # bytes read from each end of each weight file for a local checkpoint's identity


def namespace(request) -> str:
    """Pages of different LoRA adapters (name and path) or cache salts never share."""
    lora = request.lora_request
    name = f"{lora.lora_name}\0{lora.lora_path}" if lora is not None else ""
    salt = request.cache_salt or ""
    return f"{name}\0{salt}" if name or salt else ""


def index_key(request, page_size: int, tokens=None) -> bytes | None:
    """The index key of ``request`` (its ``all_token_ids``, or ``tokens``) when pages carry
    content beyond their token ids; None when they do not (the ids are the key). Pure."""
    if not request.mm_features and getattr(request, "prompt_embeds", None) is None:
        return None
    from vllm.v1.core.kv_cache_utils import generate_block_hash_extra_keys
    ids = request.all_token_ids if tokens is None else tokens
    content, mm_idx = {}, 0
    for page, start in enumerate(range(0, len(ids), page_size)):
        extra, mm_idx = generate_block_hash_extra_keys(request, start, min(len(ids), start + page_size), mm_idx)
        own = [k for k in (extra or ()) if not (isinstance(k, tuple) and k and k[0] in _IN_NAMESPACE)]
        if own:
            content[page] = hashlib.sha256(repr(own).encode()).digest()
    return content_key(tokens_to_bytes(list(ids)), page_size, content)


def attention_backend(vllm_config, spec) -> str:
    """The attention backend's name (``CPU_ATTN``, ``FLASH_ATTN``, ...): the one configured
    (``--attention-backend``), else the one vLLM's selector picks for ``spec`` on this platform."""
    chosen = getattr(getattr(vllm_config, "attention_config", None), "backend", None)
    if chosen is not None:
        return str(getattr(chosen, "name", chosen))
    from vllm.config import set_current_vllm_config
    from vllm.platforms import current_platform
    from vllm.v1.attention.selector import get_attn_backend
    from vllm.v1.kv_cache_interface import MLAAttentionSpec
    try:
        with set_current_vllm_config(vllm_config):
            cls = get_attn_backend(spec.head_size, spec.dtype, vllm_config.cache_config.cache_dtype,
                                   use_mla=isinstance(spec, MLAAttentionSpec))
        return cls.get_name()
    except (ImportError, ValueError, NotImplementedError, RuntimeError) as e:  # no backend fits here
        raise ConfigError(f"HiCacheConnector: vLLM selects no attention backend for {type(spec).__name__} "
                          f"(head size {spec.head_size}, {spec.dtype}) on {current_platform.device_name}: {e}; "
                          "name one with --attention-backend") from e


def model_identity(model_config, backend: str) -> str:
    """``<model>#<16 hex>``: the model path and a digest of what else decides its KV."""
    hf = getattr(model_config, "hf_config", None)
    rope = {k: _jsonable(getattr(hf, k, None)) for k in ("rope_scaling", "rope_parameters", "rope_theta")}
    facts = {"revision": model_config.revision, "code_revision": getattr(model_config, "code_revision", None),
             "quantization": model_config.quantization, "dtype": str(model_config.dtype),
             "hf_overrides": _jsonable(getattr(model_config, "hf_overrides", None)), "rope": rope,
             "backend": backend, "files": _checkpoint_sample(model_config.model)}
    digest = hashlib.blake2b(json.dumps(facts, sort_keys=True, default=str).encode(), digest_size=8).hexdigest()
    return f"{model_config.model[:200]}#{digest}"


def _checkpoint_sample(model: str) -> list:
    """For a local checkpoint directory: config.json's digest and each weight file's name, size
    and a digest of its first and last 64 KiB (two revisions of one architecture differ there);
    [] for a Hub id (its revision names it)."""
    root = pathlib.Path(model)
    if not root.is_dir():
        return []
    out = []
    for f in sorted(root.iterdir()):
        if f.name == "config.json" or f.suffix in (".safetensors", ".bin", ".pt", ".gguf"):
            out.append([f.name, f.stat().st_size, _ends_digest(f)])
    return out


def _ends_digest(f: pathlib.Path) -> str:
    h = hashlib.blake2b(digest_size=16)
    with open(f, "rb") as fh:
        h.update(fh.read(_SAMPLE))
        size = os.fstat(fh.fileno()).st_size
        if size > 2 * _SAMPLE:
            fh.seek(size - _SAMPLE)
            h.update(fh.read(_SAMPLE))
    return h.hexdigest()


def _jsonable(v):
    if v is None or isinstance(v, (str, int, float, bool)):
        return v
    if isinstance(v, dict):
        return {str(k): _jsonable(x) for k, x in sorted(v.items(), key=lambda kv: str(kv[0]))}
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    if callable(v):  # hf_overrides may be a function: its name, never its address
        return f"{getattr(v, '__module__', '')}.{getattr(v, '__qualname__', type(v).__name__)}"
    return repr(v)
