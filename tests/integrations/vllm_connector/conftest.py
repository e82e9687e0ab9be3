"""vLLM's test helpers (tests/v1/kv_connector/unit/utils.py) importable as ``tests.v1...``,
set up exactly as tests/integrations/vllm does (its conftest, loaded by path, not copied).

transformers (imported by vLLM's config) probes for a top-level ``kernels`` package
(``importlib.util.find_spec``, then imports it for its version); from the repository
root that finds hicache's own ``kernels/`` folder, which refuses to load under its bare
name (it installs as ``hicache.kernels``). A placeholder without a file tells
transformers the package is absent, as it is in an installed hicache."""
import importlib.machinery
import importlib.util
import pathlib
import sys
import types

if "kernels" not in sys.modules:
    _absent = types.ModuleType("kernels")
    _absent.__spec__ = importlib.machinery.ModuleSpec("kernels", None)
    sys.modules["kernels"] = _absent

_spec = importlib.util.spec_from_file_location(
    "_hicache_vllm_conftest", pathlib.Path(__file__).resolve().parents[1] / "vllm" / "conftest.py")
_mod = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_mod)

import torch  # noqa: E402

# Many small tensor ops on a shared 2-core machine: two intra-op threads spin against
# each other (see tests/conftest.py one_torch_thread); the transfer thread runs beside.
torch.set_num_threads(1)
