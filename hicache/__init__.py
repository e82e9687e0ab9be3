"""hicache: page-granular tiered KV cache manager for LLM inference engines."""
from __future__ import annotations

# Imported before the finder below is installed: its find_spec imports it, and a first
# import from inside find_spec would ask the finder again (RecursionError in a bare image).
import importlib.util as _importlib_util  # noqa: F401
import os as _os
import sys as _sys

__version__ = "0.1.0"

# In a source checkout, kernels/ and api/ sit beside hicache/ and import as
# hicache.kernels / hicache.api (an installed wheel has them inside hicache/).
# A finder maps exactly those two names; nothing else of the checkout
# (bench/, tests/, scripts/, docker/) becomes importable as hicache.*.
_here = _os.path.dirname(_os.path.abspath(__file__))
_top = _os.path.dirname(_here)
_REMAPPED = ("kernels", "api")


class _CheckoutFinder:
    """Finds ``hicache.kernels`` and ``hicache.api`` in a source checkout, and makes a
    bare ``api.x`` / ``kernels.x`` (the checkout on sys.path) the same module object
    as ``hicache.api.x`` / ``hicache.kernels.x``, never a second copy."""

    @staticmethod
    def find_spec(fullname, path=None, target=None):  # noqa: ARG004 (finder protocol)
        import importlib.util
        head, _, rest = fullname.partition(".")
        if head in _REMAPPED and rest:
            return importlib.util.spec_from_loader(fullname, _Alias("hicache." + fullname))
        sub = fullname[len("hicache."):] if head == "hicache" else ""
        if sub not in _REMAPPED:
            return None
        init = _os.path.join(_top, sub, "__init__.py")
        if _os.path.isdir(_os.path.join(_here, sub)) or not _os.path.isfile(init):
            return None
        return importlib.util.spec_from_file_location(
            fullname, init, submodule_search_locations=[_os.path.join(_top, sub)])


class _Alias:
    """Loader that hands back an already importable module under a second name."""

    def __init__(self, target: str):
        self.target = target

    def create_module(self, spec):  # noqa: ARG002
        import importlib
        return importlib.import_module(self.target)

    def exec_module(self, module):  # noqa: ARG002 (already executed under its own name)
        pass


if not any(isinstance(f, _CheckoutFinder) for f in _sys.meta_path):
    _sys.meta_path.insert(0, _CheckoutFinder())

# The public names resolve on first use (PEP 562) so that ``import hicache``,
# the configuration and ``hicache --help`` / ``info`` never import torch.
_EXPORTS = {
    "Admission": "hicache.cache.hicache", "HiCache": "hicache.cache.hicache",
    "HiCacheConfig": "hicache.core.config",
    "ContractMismatch": "hicache.core.errors", "HiCacheError": "hicache.core.errors",
    "BytePlane": "hicache.core.layout", "KVLayout": "hicache.core.layout",
}
__all__ = sorted([*_EXPORTS, "__version__"])


def __getattr__(name: str):
    if name in _EXPORTS:
        import importlib
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'hicache' has no attribute {name!r}")
