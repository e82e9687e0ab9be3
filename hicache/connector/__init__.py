"""An engine KV connector over hicache, for an engine that owns L1 (vLLM's paged
blocks): the scheduler half (``scheduler``: the index, floors, the cost model; its
shared-L2 variant in ``shared``), the worker half (``worker``: page copies, L3 I/O)
and the plain data that crosses between them (``plan``). No engine imports; the vLLM
adapter over it is ``hicache.integrations.vllm_connector``."""
