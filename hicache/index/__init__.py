"""The prefix index: radix tree nodes, the tree and its checks, eviction policies and
their candidate index, draft completeness. Imports nothing above ``hicache.index.prefix_cache``."""
