"""Adapters that let real engines load hicache by module path.

* :mod:`hicache.integrations.vllm` — a ``SecondaryTierManager`` under vLLM's
  CPU offload tier (``OffloadingConnector`` + ``TieringOffloadingSpec``).
* :mod:`hicache.integrations.sglang` — a ``HiCacheStorage`` backend that
  SGLang loads as ``--hicache-storage-backend dynamic``.

Each module imports its engine lazily at class-definition time, so importing
``hicache`` never imports an engine.
"""
