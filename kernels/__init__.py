"""Triton page-copy kernels (installed as ``hicache.kernels``)."""
