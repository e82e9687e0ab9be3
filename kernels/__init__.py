"""Triton page-copy kernels (installed as ``hicache.kernels``).

``copy_pages`` gathers/scatters pages between any two pools (device<->pinned
host, device<->device; all layers or one layer per launch); ``store_rows``
writes VALID K/V rows into device pages by slot id. Both fall back to plain
torch without a GPU and write the same bytes either way.
"""

if __name__ != "hicache.kernels":  # imported as bare `kernels` (the checkout on sys.path): one module per file
    import importlib as _importlib
    import sys as _sys
    _sys.modules[__name__] = _importlib.import_module("hicache.kernels")
else:
    from hicache.kernels.page_copy import PageCopier, copy_pages, default_copier, store_rows
    from hicache.kernels.plan import CopyPlan, TileConfig

    __all__ = ["CopyPlan", "PageCopier", "TileConfig", "copy_pages", "default_copier", "store_rows"]
