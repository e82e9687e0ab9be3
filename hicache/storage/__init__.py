"""L3 storage: page objects in memory, files, Redis or Redis Cluster, chosen by URL.

Entry point: ``open_storage(url, fingerprint=layout.fingerprint())``.
"""
from hicache.core.stats import StorageStats
from hicache.storage.base import StorageBackend
from hicache.storage.capacity import StorageOptions
from hicache.storage.registry import StorageRegistry, default_registry, open_storage

__all__ = ["StorageBackend", "StorageOptions", "StorageStats", "StorageRegistry", "default_registry",
           "open_storage"]
