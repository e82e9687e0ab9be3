"""Engine suites run inside the engines' own environments (scripts/setup-engines.sh);
where an engine does not import, its folder is not collected and
test_<engine>_suite.py runs it in that environment instead."""
import importlib.util

collect_ignore_glob = []
if importlib.util.find_spec("sglang") is None:
    collect_ignore_glob.append("sglang")  # the folder: its conftest imports sglang
