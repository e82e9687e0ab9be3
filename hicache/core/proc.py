"""How long this process has existed, for wall times that include start-up."""
from __future__ import annotations

import os
import time


def process_age_s() -> float | None:
    """Seconds since this process started (the kernel's start time, so interpreter
    start-up and imports count), or None where ``/proc`` does not say (not Linux).
    Resolution: one clock tick (10 ms); never less than the true age."""
    try:
        with open("/proc/self/stat") as f:
            after_comm = f.read().rsplit(")", 1)[1].split()  # the command name may hold spaces
        start_s = int(after_comm[19]) / os.sysconf("SC_CLK_TCK")  # field 22, starttime since boot
        return time.clock_gettime(time.CLOCK_BOOTTIME) - start_s
    except (OSError, ValueError, IndexError, AttributeError):
        return None
