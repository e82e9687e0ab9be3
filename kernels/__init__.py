"""Triton page-copy kernels (installed as ``hicache.kernels``).

``copy_pages`` gathers/scatters pages between any two pools (device<->pinned
host, device<->device; all layers or one layer per launch); ``store_rows``
writes VALID K/V rows into device pages by slot id. Both fall back to plain
torch without a GPU and write the same bytes either way.
"""

if __name__ != "hicache.kernels":  # one module per file: never both kernels.x and hicache.kernels.x
    raise ImportError(f"import hicache.kernels, not {__name__} (run from a checkout with hicache installed)")

from hicache.kernels.page_copy import PageCopier, copy_pages, default_copier, store_rows
from hicache.kernels.plan import CopyPlan, TileConfig

__all__ = ["CopyPlan", "PageCopier", "TileConfig", "copy_pages", "default_copier", "store_rows"]
