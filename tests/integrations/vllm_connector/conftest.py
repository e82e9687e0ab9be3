"""vLLM's test helpers (tests/v1/kv_connector/unit/utils.py) importable as ``tests.v1...``,
set up exactly as tests/integrations/vllm does (its conftest, loaded by path, not copied)."""
import importlib.util
import pathlib

import torch

_spec = importlib.util.spec_from_file_location(
    "_hicache_vllm_conftest", pathlib.Path(__file__).resolve().parents[1] / "vllm" / "conftest.py")
_mod = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_mod)

# Many small tensor ops on a shared 2-core machine: two intra-op threads spin against
# each other (see tests/conftest.py one_torch_thread); the transfer thread runs beside.
torch.set_num_threads(1)
