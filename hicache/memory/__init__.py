"""Page-addressed memory: the whole-page allocator, the L1 device pool and L2 host
pool buffers for every plane (an engine's paged KV tensors adopted in place: ``paged_kv``),
and the POSIX shared-memory segment of the node's L2.

Imports only ``hicache.core``."""
