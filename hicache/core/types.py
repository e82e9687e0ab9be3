"""Typed ids that prevent mixing device pages, host pages and page hashes."""
from __future__ import annotations

from typing import NewType

DevicePageId = NewType("DevicePageId", int)
HostPageId = NewType("HostPageId", int)
# A submitted transfer (``TransferController.submit``): the one key of in-flight work.
JobId = NewType("JobId", int)
# 16-byte chained digest of a page: H(parent_hash, namespace, token ids).
PageHash = NewType("PageHash", bytes)
