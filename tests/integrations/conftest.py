"""Engine integration tests run inside each engine's own environment
(``bash scripts/setup-engines.sh``); ``test_<engine>_suite*.py`` here drives them
from the main ``.venv``. Where an engine is not importable, its folder is not
collected (the folder itself: its conftest imports the engine)."""
import importlib.util

collect_ignore_glob = [folder for folder, engine in (("vllm", "vllm"), ("vllm_connector", "vllm"), ("sglang", "sglang"))
                       if importlib.util.find_spec(engine) is None]
