"""hicache: page-granular tiered KV cache manager for LLM inference engines."""
from __future__ import annotations

import os as _os

__version__ = "0.1.0"

# In a source checkout, kernels/ and api/ sit beside hicache/ and are imported
# as hicache.kernels / hicache.api (an installed wheel has them inside
# hicache/). Extending __path__ is the standard namespace mechanism for this.
_here = _os.path.dirname(_os.path.abspath(__file__))
_top = _os.path.dirname(_here)
if not _os.path.isdir(_os.path.join(_here, "kernels")) and _os.path.isfile(
        _os.path.join(_top, "kernels", "__init__.py")):
    __path__.append(_top)  # type: ignore[name-defined]

# The public names resolve on first use (PEP 562) so that ``import hicache``,
# the configuration and ``hicache --help`` / ``info`` never import torch.
_EXPORTS = {
    "Admission": "hicache.hicache", "HiCache": "hicache.hicache",
    "HiCacheConfig": "hicache.config",
    "ContractMismatch": "hicache.errors", "HiCacheError": "hicache.errors",
    "BytePlane": "hicache.layout", "KVLayout": "hicache.layout",
}
__all__ = sorted([*_EXPORTS, "__version__"])


def __getattr__(name: str):
    if name in _EXPORTS:
        import importlib
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'hicache' has no attribute {name!r}")
