"""Page-addressed memory: the whole-page allocator, the L1 device pool and L2 host
pool buffers for every plane, and the POSIX shared-memory segment of the node's L2.

Imports only ``hicache.core``."""
