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

from hicache.config import HiCacheConfig  # noqa: E402
from hicache.errors import ContractMismatch, HiCacheError  # noqa: E402
from hicache.hicache import Admission, HiCache  # noqa: E402
from hicache.layout import BytePlane, KVLayout  # noqa: E402

__all__ = ["Admission", "BytePlane", "ContractMismatch", "HiCache", "HiCacheConfig", "HiCacheError",
           "KVLayout", "__version__"]
