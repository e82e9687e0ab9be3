"""Run tests/integrations/vllm_connector (HiCacheConnector through vLLM's own scheduler)
inside ``.venv-vllm``, from the main test run; a missing engine environment fails."""
from __future__ import annotations

from tests.integrations.test_vllm_suites import _run, ROOT


def test_hicache_vllm_connector():
    _run(["tests/integrations/vllm_connector"], ROOT, timeout=900)
