"""vLLM's own test helpers come from its 0.33.0 source distribution, unpacked by
``scripts/engines/vllm.sh`` into ``.engines/vllm-0.33.0`` (never committed).
Putting that folder first on ``sys.path`` makes ``import tests.v1...`` resolve
to vLLM's ``tests`` package, as in vLLM's own runs; vLLM's top-level
``tests/conftest.py`` (model fixtures) is not loaded, only the modules named."""
import os
import pathlib
import sys
import types

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[3]
VLLM_TESTS = ROOT / ".engines" / "vllm-0.33.0"
if not (VLLM_TESTS / "tests" / "v1" / "kv_offload").is_dir():
    raise pytest.UsageError(f"vLLM's tests are missing under {VLLM_TESTS}; run bash scripts/setup-engines.sh vllm")
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HOME", str(ROOT / ".engines" / "hf"))  # local facebook/opt-125m config.json
# pytest (importlib mode) registers this checkout's test folder as the package
# ``tests``; vLLM's test modules import their helpers as ``tests.v1...``. One
# package spanning both folders serves both (names do not overlap: ``v1`` is vLLM's).
_pkg = sys.modules.get("tests")
if _pkg is None:
    _pkg = types.ModuleType("tests")
    sys.modules["tests"] = _pkg
_pkg.__path__ = [str(ROOT / "tests"), str(VLLM_TESTS / "tests")]

# vLLM's kv_connector unit conftest: CPU attention declares MultipleOf(32) block
# sizes, which RequestRunner's block_size=16 workers would fail on (vLLM #54042).
from tests.v1.kv_connector.unit.conftest import _mock_cpu_backend_block_sizes  # noqa: E402,F401


@pytest.fixture(autouse=True)
def _no_leaked_offload_region():
    """A scheduler-only vLLM harness (no worker) creates ``/dev/shm/vllm_offload_*.mmap``
    (the CPU tier's shared region, 2 GiB for the README's line) but only a worker
    unlinks it: remove the ones a test created, so runs do not fill /dev/shm."""
    before = set(pathlib.Path("/dev/shm").glob("vllm_offload_*.mmap"))
    yield
    for path in set(pathlib.Path("/dev/shm").glob("vllm_offload_*.mmap")) - before:
        path.unlink(missing_ok=True)
