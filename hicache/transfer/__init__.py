"""The worker side: the transfer engine that runs the scheduler side's plans on a CUDA
stream or a CPU thread, one mover per (source, destination) medium (``engine``), what
it reads of a plan (``media``), the CUDA-graph layer-wise load (``load_graph``) and CP
row assembly. Imports ``core``, ``memory`` and ``hicache.kernels``: never the index."""
