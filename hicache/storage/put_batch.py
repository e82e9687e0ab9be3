"""``PutBatch``: the pages of one put as a backend's ``_raw_put`` sees them, and
``put_rows``, which checks a put's items and builds its rows."""
from __future__ import annotations

from typing import Callable, Sequence

from hicache.storage import codec
from hicache.storage.codec import Buffer

# A page put: (page hash, payload in canonical plane order, plane sizes).
PutItem = tuple[bytes, Buffer, Sequence[int]]
Row = tuple[bytes, bytes, memoryview, codec.PlaneSizes]  # (full key, page hash, payload, plane sizes)


def put_rows(items: Sequence[PutItem], full: Callable[[bytes], bytes]) -> list[Row]:
    """One row per item, its key made full by ``full`` (which checks it). Raises
    ``ValueError`` for a bad key or a payload whose length is not the sum of its plane sizes."""
    rows = []
    last: tuple[object, codec.PlaneSizes | None] = (None, None)
    for key, payload, sizes in items:
        if sizes is not last[0]:  # callers pass one plane-sizes list for a whole batch
            last = (sizes, codec.plane_sizes(sizes))
        mv = codec.as_bytes_view(payload)
        codec.check_length(mv, last[1])
        rows.append((full(key), key, mv, last[1]))
    return rows


class PutBatch(Sequence[tuple[bytes, bytes, memoryview]]):
    """``(full key, header, payload)`` per page, the header built on first access.

    Building a header reads the whole payload (checksum); a backend that
    handles pages one by one (file) builds it just before writing the payload,
    while the payload is still in cache. Headers are kept once built.
    """

    __slots__ = ("_fingerprint", "_rows", "_headers", "_auth_key", "_templates")

    def __init__(self, fingerprint: str, rows: list[Row], auth_key: bytes = b""):
        self._fingerprint = fingerprint
        self._auth_key = auth_key
        self._rows = rows  # (full key, page hash, payload, plane sizes), lengths already checked
        self._headers: list[bytes | None] = [None] * len(rows)
        self._templates: dict[int, codec.HeaderTemplate] = {}  # per plane-sizes object (one per batch, usually)

    def __len__(self) -> int:
        return len(self._rows)

    def payload_bytes(self, i: int) -> int:
        """Payload size of page ``i`` (builds no header)."""
        return self._rows[i][2].nbytes

    def __getitem__(self, i):  # type: ignore[override]
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        row = self._rows[i]
        return row[0], self.header(i), row[2]

    def key_payload(self, i: int) -> tuple[bytes, memoryview]:
        """Full key and payload of page ``i`` (builds no header)."""
        row = self._rows[i]
        return row[0], row[2]

    def header_ahead(self, i: int, nbytes: int) -> bytes:
        """Page ``i``'s header; if it is not built yet, the headers of the pages
        after it are built with it, up to ``nbytes`` of payload in all (a group
        that the send following it still finds in cache)."""
        if self._headers[i] is None:
            acc, j = 0, i
            while j < len(self._rows) and acc < nbytes:
                self.header(j)
                acc += self._rows[j][2].nbytes
                j += 1
        return self.header(i)

    def header(self, i: int) -> bytes:
        """Page ``i``'s header, built (checksum over the payload) on the first call."""
        hdr = self._headers[i]
        if hdr is None:
            _, key, mv, sizes = self._rows[i]
            t = self._templates.get(id(sizes))
            if t is None:
                t = self._templates[id(sizes)] = codec.header_template(self._fingerprint, sizes)
            hdr = self._headers[i] = codec.encode_header(self._fingerprint, key, sizes, mv, self._auth_key, t)
        return hdr
