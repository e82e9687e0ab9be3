"""The vocabulary every plane shares: typed ids, the exception tree, ``KVLayout`` and
its fingerprint, layer groups, CP page ownership and row order, page hashes, the
configuration, statistics types, row provenance, published shapes, size parsing and
the one redactor.

Imports nothing of hicache outside ``core`` (the configuration validates eviction
policy names against ``hicache.index.eviction`` at validation time)."""
