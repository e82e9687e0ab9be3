"""REST statistics service and local engine API (installed as ``hicache.api``).

The core library never imports this package, so ``import hicache`` works
without FastAPI or uvicorn installed.
"""
