"""The README's SGLang launch line, parsed and built the way SGLang builds it, on CPU.

Shared by ``test_launch.py`` (in process) and ``launch_child.py`` (a process of its
own, as SGLang's scheduler is: logging and the multiprocess metrics directory).
What runs is SGLang 0.5.23's own code: ``prepare_server_args`` (the
``launch_server`` argument parser), ``HybridCacheController.
parse_storage_backend_extra_config`` (how SGLang reads the extra-config flag),
its device and host pools for the model's shape, ``HiCacheController`` and
``StorageBackendFactory``. Not run: argument resolution and model loading, which
need the model's files and a GPU.
"""
from __future__ import annotations

import importlib.util
import pathlib
import re
import shlex
import sys
import threading

if importlib.util.find_spec("torchvision") is None:  # see conftest.py
    sys.path.insert(0, str(pathlib.Path(__file__).parent / "_shims"))

import torch  # noqa: E402
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool  # noqa: E402

from hicache.core.shapes import ModelShape, model_shapes  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[3]
README = ROOT / "README.md"
MARK = "tests/integrations/sglang/test_launch.py"
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}


def readme_argv() -> list[str]:
    """The arguments of the README's ``python -m sglang.launch_server`` line."""
    text = README.read_text()
    at = text.index(MARK)
    body = re.search(r"```bash\n(.*?)```", text[at:], re.S).group(1)
    argv = shlex.split(body.replace("\\\n", " "))
    assert argv[:3] == ["python", "-m", "sglang.launch_server"], argv[:3]
    return argv[3:]


def real_pools(m: ModelShape, page: int, layout: str, dev_pages: int = 4):
    """SGLang's device pool and host pool for model ``m`` (all its KV layers) on CPU,
    the host pool filled with random bytes. The device pool holds ``dev_pages``; the
    host pool twice that (SGLang's default --hicache-ratio 2). An MLA
    ``page_first_direct`` host pool needs more pages than layers: SGLang 0.5.23's
    ``MLATokenToKVPoolHost._initialize_transfer_views`` indexes its page axis by
    layer there (an IndexError below that; real pools are far larger)."""
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
    from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost
    layers, dtype = m.attention_layers, DTYPES[m.dtype]
    if m.is_mla and layout == "page_first_direct":
        dev_pages = max(dev_pages, layers // 2 + 1)
    tokens = dev_pages * page
    if m.is_mla:
        dev = MLATokenToKVPool(tokens, page, dtype, m.kv_lora_rank, m.qk_rope_head_dim, layers, "cpu", False,
                               start_layer=0, end_layer=layers)
    else:
        dev = MHATokenToKVPool(tokens, page, dtype, m.kv_heads_per_rank, m.head_dim, layers, "cpu", False,
                               start_layer=0, end_layer=layers)
    info = dev.get_device_pool_infos()[0].buffer_info
    common = dict(pin_memory=False, device_capacity_tokens=dev.size, start_layer=0, end_layer=layers)
    if m.is_mla:
        host = MLATokenToKVPoolHost(info, 2.0, 0, page, layout, target_layer_num=layers, **common)
    else:
        host = MHATokenToKVPoolHost(info, 2.0, 0, page, layout, **common)
    raw = host.kv_buffer.view(-1).view(torch.uint8)
    gen = torch.Generator().manual_seed(page * 1000 + layers)
    raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=gen))
    return dev, host


def page_bytes(host, idx: torch.Tensor) -> list[torch.Tensor]:
    """Copies of the host pool's pages at ``idx``, as raw bytes."""
    return [host.get_data_page(int(idx[i]), flat=True).clone().view(torch.uint8)
            for i in range(0, len(idx), host.page_size)]


def shape_of(model_path: str) -> ModelShape:
    """The shapes-table row of a Hugging Face model id."""
    for m in model_shapes():
        if m.hf == model_path:
            return m
    raise LookupError(f"{model_path!r} is not in hicache/data/real_models.json")


def server_args(argv: list[str]):
    """SGLang's ``ServerArgs`` from ``launch_server`` arguments, by its own parser."""
    from sglang.srt.server_args import prepare_server_args
    return prepare_server_args(argv)


def build(args, url: str):
    """SGLang's HiCacheController for the launch arguments' model and flags, its
    storage backend made by SGLang's factory from their extra config with ``url``
    in place of their L3 (a test's own store)."""
    from sglang.srt.managers.cache_controller import HiCacheController
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import HybridCacheController
    from sglang.srt.runtime_context import get_parallel

    extra = HybridCacheController.parse_storage_backend_extra_config(args.hicache_storage_backend_extra_config)[0]
    extra["url"] = url
    page = args.page_size or 1  # SGLang's default page size (see test_real_shapes.py)
    dev, host = real_pools(shape_of(args.model_path), page, args.hicache_mem_layout, dev_pages=8)
    alloc = PagedTokenToKVPoolAllocator(dev.size, page, dev.dtype, "cpu", dev, False)
    with get_parallel().override(tp_rank=0, tp_size=args.tp_size, pp_rank=0, pp_size=1, attn_dcp_size=1,
                                 attn_dcp_rank=0):
        ctrl = HiCacheController(alloc, host, page, None, threading.Event(),
                                 storage_backend=args.hicache_storage_backend, model_name=args.model_path,
                                 storage_backend_extra_config=extra)
    return ctrl
