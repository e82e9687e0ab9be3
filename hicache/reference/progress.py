"""Progress bars and expectations for the long ``hicache replay`` modes.

``Progress`` prints on stderr (the report goes to stdout): a line saying what
is ahead before a long run starts (``note``), and a tqdm bar per run
(``wrap``). ``logs_above_bars`` routes the root logger's console output
through ``tqdm.write`` while bars are drawn, so a warning prints on a line of
its own above the bar instead of through it; the redaction filters of the
handlers it replaces move to the new ones, so no secret reaches the terminal.
"""
from __future__ import annotations

import contextlib
import logging
import sys
from typing import Iterable, Iterator, TextIO, TypeVar

from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

T = TypeVar("T")


@contextlib.contextmanager
def logs_above_bars() -> Iterator[None]:
    """While inside, root-logger console records print above any tqdm bar (``tqdm.write``)."""
    root = logging.getLogger()
    before = list(root.handlers)
    filters = [f for h in before for f in h.filters]
    with logging_redirect_tqdm():
        for h in root.handlers:
            if h not in before:  # tqdm's handler: give it the filters (redaction) of those it replaced
                for f in filters:
                    h.addFilter(f)
        yield


def _duration(s: float) -> str:
    s = int(round(s))
    return f"{s} s" if s < 60 else f"{s // 60} min {s % 60:02d} s" if s < 3600 else f"{s // 3600} h {s % 3600 // 60:02d} min"


def point_text(k: int, total: int, elapsed_s: float, finished: int) -> str:
    """``point 3 of 12, 41 s so far, about 2 min 03 s left``: point ``k`` (from 1) of ``total``,
    the time left estimated from the ``finished`` points that took ``elapsed_s`` (none: no estimate)."""
    head = f"point {k} of {total}, {_duration(elapsed_s)} so far"
    if not finished:
        return head
    return f"{head}, about {_duration(elapsed_s / finished * (total - finished))} left"


class Progress:
    """Bars and notes on ``stream`` (stderr), or nothing when ``enabled`` is False."""

    def __init__(self, enabled: bool, total: int | None = None, *, stream: TextIO | None = None,
                 unit: str = "req"):
        self.enabled, self.total, self.unit = enabled, total, unit
        self.stream = stream

    def note(self, text: str) -> None:
        """One line about what is ahead (above any bar)."""
        if self.enabled:
            tqdm.write(text, file=self.stream or sys.stderr)

    def bar(self, desc: str, total: int | None = None) -> tqdm:
        return tqdm(total=self.total if total is None else total, desc=desc, unit=self.unit, leave=False,
                    disable=not self.enabled, file=self.stream or sys.stderr, dynamic_ncols=True)

    def wrap(self, items: Iterable[T], desc: str, total: int | None = None) -> Iterator[T]:
        """``items`` unchanged, one bar step per item."""
        b = self.bar(desc, total)
        try:
            for x in items:
                yield x
                b.update(1)
        finally:
            b.close()
