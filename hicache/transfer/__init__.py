"""The worker side: plans of page copies (``plans``), the transfer engine that runs
them on a CUDA stream or a CPU thread (``engine``), the CUDA-graph layer-wise load
(``load_graph``) and CP row assembly.

Imports ``core``, ``memory``, ``hicache.kernels`` and ``index`` for CP page ownership
(``cp_assemble``); the plans name the index's nodes in annotations only."""
