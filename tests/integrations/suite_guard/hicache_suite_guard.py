"""A pytest plugin that ``tests/helpers/suite_run.py`` loads into every subprocess suite
(``-p hicache_suite_guard``; this folder is put on the child's ``PYTHONPATH``, beside no
``tests`` package, so it loads in vLLM's tree too).

- It writes the node id of each test as it starts to ``$SUITE_GUARD_RUNNING_FILE``: when the
  suite's deadline kills it, the parent names the test that was running.
- At the end of the session it kills the ``multiprocessing`` children still alive: a test
  that timed out can leave non-daemon children blocked on a queue, and Python's exit then
  joins them forever.
"""
from __future__ import annotations

import multiprocessing
import os


def pytest_runtest_logstart(nodeid: str, location: object) -> None:
    path = os.environ.get("SUITE_GUARD_RUNNING_FILE")
    if path:
        with open(path, "w") as f:
            f.write(nodeid)


def pytest_unconfigure(config: object) -> None:
    left = multiprocessing.active_children()
    for p in left:
        p.kill()
    for p in left:
        p.join(10)
    if left:
        print(f"hicache_suite_guard: killed {len(left)} multiprocessing child(ren) left running at exit "
              f"({', '.join(p.name for p in left)})")
