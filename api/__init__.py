"""REST statistics service and local engine API (installed as ``hicache.api``).

The core library never imports this package, so ``import hicache`` works
without FastAPI or uvicorn installed.
"""

if __name__ != "hicache.api":  # imported as bare `api` (the checkout on sys.path): one module per file
    import importlib as _importlib
    import sys as _sys
    _sys.modules[__name__] = _importlib.import_module("hicache.api")
