"""Engine integration tests run inside each engine's own environment
(``bash scripts/setup-engines.sh``); ``test_*_suites.py`` here drives them from
the main ``.venv``. Where an engine is not importable, its folder is not collected."""
import importlib.util

collect_ignore_glob = [f"{engine}*" for engine in ("vllm",) if importlib.util.find_spec(engine) is None]
