"""Gates that hold copies in flight, whatever the machine's speed."""
from __future__ import annotations

import threading

from hicache.kernels.page_copy import PageCopier


class GroupGate(PageCopier):
    """A page copier whose copies into ``held`` (a group store's L1 pool) wait for ``event``."""

    def __init__(self):
        super().__init__()
        self.event, self.held = threading.Event(), None

    def copy_pages(self, src, dst, *a, **kw):
        if dst is self.held:
            assert self.event.wait(60), "gate never opened"
        return super().copy_pages(src, dst, *a, **kw)
