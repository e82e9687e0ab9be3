"""Triton page-copy kernels (installed as ``hicache.kernels``).

``copy_pages`` gathers/scatters pages between any two pools (device<->pinned
host, device<->device; all layers or one layer per launch); ``store_rows``
writes VALID K/V rows into device pages by slot id. Both fall back to plain
torch without a GPU and write the same bytes either way.
"""
from hicache.kernels.page_copy import PageCopier, copy_pages, default_copier, store_rows
from hicache.kernels.plan import CopyPlan, TileConfig

__all__ = ["CopyPlan", "PageCopier", "TileConfig", "copy_pages", "default_copier", "store_rows"]
