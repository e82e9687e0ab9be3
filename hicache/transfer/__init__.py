"""The worker side: plans of page copies (``plans``), the transfer engine that runs
them on a CUDA stream or a CPU thread (``engine``), the CUDA-graph layer-wise load
(``load_graph``), the registry of in-flight jobs (``inflight``), and CP row assembly.

Imports ``core``, ``memory``, ``index`` (node types in plans) and ``hicache.kernels``."""
