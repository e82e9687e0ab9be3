"""A second engine process for the shared-segment test: ``python engine_proc.py URL SEED PAGES``
runs vLLM's scheduler with HiCacheConnector over the node service at URL, computes one
request of PAGES pages + 1 token (prompt ``tokens(SEED, ...)``) and exits 0 once its
pages are committed to the shared segment."""
import importlib.util
import pathlib
import sys

_here = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(_here.parents[2]))
_spec = importlib.util.spec_from_file_location("_vllm_connector_conftest", _here / "conftest.py")
_spec.loader.exec_module(importlib.util.module_from_spec(_spec))  # vLLM's test helpers, as in pytest

from tests.integrations.vllm_connector.harness import BLOCK, Engine, tokens  # noqa: E402


def main(url: str, seed: int, pages: int) -> None:
    eng = Engine({"storage": {"url": url}, "model": {"model_id": "facebook/opt-125m"}})
    eng.add("a1", tokens(seed, pages * BLOCK + 1))
    eng.run()
    s = eng.core.stats()
    assert s.saved_pages == pages and s.save_dropped_pages == 0, s
    eng.check_integrity()
    eng.close()
    print("saved", s.saved_pages)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
