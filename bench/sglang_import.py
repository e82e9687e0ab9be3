"""Import SGLang's ``RadixCache`` on a CPU-only box, for side-by-side benchmarks.

SGLang 0.5.23's import chain for ``sglang.srt.mem_cache.radix_cache`` reaches a
multimodal module (``sglang.srt.multimodal.internvl_utils``) that imports
torchvision at module level; there is no CPU torchvision wheel for torch 2.13 in
this box's package mirror, and the CUDA wheel cannot load its operators here.
``radix_cache`` never calls torchvision, so ``load()`` serves ``torchvision``
and its submodules as empty placeholder modules while SGLang is imported, after
transformers has recorded torchvision as absent. SGLang's radix code runs
unmodified. Point ``HICACHE_BENCH_SGLANG`` at a directory holding sglang==0.5.23
and its import-time dependencies (``pip install --no-deps --target DIR ...``).
"""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
import types


class _Placeholder(types.ModuleType):
    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Placeholder(f"{self.__name__}.{name}")

    def __call__(self, *args, **kwargs):
        return _Placeholder("call")


class _TorchvisionPlaceholder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path, target=None):
        if fullname == "torchvision" or fullname.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        m = _Placeholder(spec.name)
        m.__path__ = []
        return m

    def exec_module(self, module) -> None:
        pass


def load():
    """``(RadixCache, RadixKey, MatchPrefixParams, InsertParams)``, or ``None`` if not installed."""
    where = os.environ.get("HICACHE_BENCH_SGLANG")
    if where and where not in sys.path:
        sys.path.append(where)
    try:
        import transformers.image_utils  # noqa: F401  (records torchvision as absent first)
        import transformers.models.auto.processing_auto  # noqa: F401
    except ImportError:
        return None
    finder = None
    try:
        import torchvision  # noqa: F401
    except Exception:
        finder = _TorchvisionPlaceholder()
        sys.meta_path.insert(0, finder)
    try:
        from sglang.srt.mem_cache.base_prefix_cache import InsertParams, MatchPrefixParams
        from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey
    except ImportError as e:
        print(f"# sglang not importable: {e}", file=sys.stderr)
        return None
    finally:
        if finder is not None:
            sys.meta_path.remove(finder)
    return RadixCache, RadixKey, MatchPrefixParams, InsertParams
