"""REST statistics service and local engine API (installed as ``hicache.api``).

The core library never imports this package, so ``import hicache`` works
without FastAPI or uvicorn installed.
"""

if __name__ != "hicache.api":  # one module per file: never both api.x and hicache.api.x
    raise ImportError(f"import hicache.api, not {__name__} (run from a checkout with hicache installed)")

