"""Run tests/integrations/vllm_connector (HiCacheConnector through vLLM's own scheduler)
inside ``.venv-vllm``, from the main test run; a missing engine environment fails.
Its docs tests run from tests/test_readme.py (test_vllm_connector_serve_line,
test_pd_docs_serve_lines), not twice."""
from __future__ import annotations

from tests.integrations.test_vllm_suites import _run, ROOT


def test_hicache_vllm_connector():
    _run(["tests/integrations/vllm_connector",
          "--ignore=tests/integrations/vllm_connector/test_docs_serve_line.py",
          "--deselect=tests/integrations/vllm_connector/test_pd.py::test_pd_docs_serve_lines"], ROOT, timeout=900)
