"""The service's L2 segment: header, page table and host pool in one shared-memory
segment, and the write marks that refuse commits of pages never written (``WriteMarks``).

Byte layout (little-endian)::

    [0, 4096)               header: magic, format version, pages, page bytes,
                            table and pool offsets, pool bytes, layout
                            fingerprint, host layout
    [TABLE, +32 * pages)    page table, one 32-byte entry per host page:
                            state (0 free, 1 committed, 3 committed with
                            valid draft rows), 15 pad bytes, page hash (16)
    [POOL, +pool bytes)     the ``HostPool`` (``HostPool.nbytes_for``), 4 KiB aligned
"""
from __future__ import annotations

import struct
from typing import NamedTuple

import numpy as np

from hicache.core.errors import ServiceError
from hicache.core.hashing import HASH_BYTES
from hicache.core.layout import KVLayout
from hicache.core.types import PageHash
from hicache.memory.pools import HostPool
from hicache.memory.shm import SharedSegment


MARK_BYTES = 16
# Below this, one plane's mark surviving a write is too likely to refuse on it alone.
_PER_PLANE_MIN = 8


class WriteMarks:
    """Refuse commits of reserved pages that were never written.

    Engines write page bytes into the shared segment themselves, so the server
    cannot see a write happen. Instead, ``stamp`` writes a fresh random mark
    (``MARK_BYTES`` bytes, the same for every plane of one page, different per
    page and per reservation) at the start of every plane of each reserved page;
    ``check`` at commit refuses a page on which a plane still carries its mark.
    A real write replaces the mark with KV bytes; the chance that it reproduces
    16 random bytes is 2**-128. With planes smaller than the mark (tiny test
    layouts) the mark is shorter and a page is refused only when *every* plane
    still carries it.

    Marks live in two arrays indexed by page id, so stamping and checking a
    batch is a handful of numpy operations on the segment (no per-page Python
    loop over planes): bounded work on the event loop.
    """

    def __init__(self, pool: HostPool):
        lay = pool.layout
        self.m = min(MARK_BYTES, min(p.page_bytes for p in lay.planes))
        self.capacity = pool.allocator.capacity
        self._buf = pool.buffer.numpy()  # shares the segment's memory
        self._offset = np.asarray(pool.plane_offset, dtype=np.int64)[:, None, None]
        self._stride = np.asarray(pool.page_stride, dtype=np.int64)[:, None, None]
        self._within = np.arange(self.m, dtype=np.int64)[None, None, :]
        self._marks = np.zeros((self.capacity, self.m), dtype=np.uint8)
        self._stamped = np.zeros(self.capacity, dtype=bool)
        self._rng = np.random.default_rng()

    def _index(self, pages: np.ndarray) -> np.ndarray:
        # [planes, pages, m] byte offsets of every plane's mark
        return self._offset + pages[None, :, None] * self._stride + self._within

    def stamp(self, pages: list[int]) -> None:
        """Mark freshly reserved ``pages`` (valid page ids). Mutates the segment."""
        if not pages:
            return
        p = np.asarray(pages, dtype=np.int64)
        marks = self._rng.integers(0, 256, size=(len(pages), self.m), dtype=np.uint8)
        self._marks[p] = marks
        self._stamped[p] = True
        self._buf[self._index(p)] = marks[None, :, :]

    def check(self, pages: object) -> None:
        """Raise ``ServiceError('not_written')`` when a stamped page in ``pages`` was not written.

        Entries that are not valid page ids are left to the index's own checks.
        Mutates nothing.
        """
        if not isinstance(pages, (list, tuple)):
            return
        valid = [x for x in pages if type(x) is int and 0 <= x < self.capacity]
        p = np.asarray(valid, dtype=np.int64)
        p = p[self._stamped[p]] if len(p) else p
        if not len(p):
            return
        same = (self._buf[self._index(p)] == self._marks[p][None, :, :]).all(axis=2)  # [planes, pages]
        bad = same.any(axis=0) if self.m >= _PER_PLANE_MIN else same.all(axis=0)
        if bad.any():
            unwritten = p[bad].tolist()
            raise ServiceError("not_written", f"page(s) {unwritten[:8]}{' ...' if len(unwritten) > 8 else ''} "
                               "were reserved but not (fully) written: write every plane of a page into "
                               "the segment before committing it, or cancel it")

    def clear(self, pages: object) -> None:
        """Forget the marks of committed or cancelled ``pages``."""
        if isinstance(pages, (list, tuple)):
            valid = [x for x in pages if type(x) is int and 0 <= x < self.capacity]
            if valid:
                self._stamped[np.asarray(valid, dtype=np.int64)] = False


MAGIC = b"HICACHE\x00"
FORMAT_VERSION = 1
HEADER_BYTES = 4096
ENTRY_BYTES = 32
ALIGN = 4096
_HEADER = struct.Struct("<8sIIQQQQQ64s16s")
COMMITTED, DRAFT = 1, 2  # state bits


def _up(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


class Geometry(NamedTuple):
    num_pages: int
    page_bytes: int
    table_offset: int
    pool_offset: int
    pool_bytes: int
    fingerprint: str
    host_layout: str

    @property
    def size(self) -> int:
        return self.pool_offset + self.pool_bytes

    @classmethod
    def of(cls, layout: KVLayout, num_pages: int) -> "Geometry":
        pool_offset = _up(HEADER_BYTES + ENTRY_BYTES * num_pages)
        return cls(num_pages, layout.page_bytes, HEADER_BYTES, pool_offset, HostPool.nbytes_for(layout, num_pages),
                   layout.fingerprint(), layout.host_layout)

    def pack(self) -> bytes:
        return _HEADER.pack(MAGIC, FORMAT_VERSION, 0, self.num_pages, self.page_bytes, self.table_offset,
                            self.pool_offset, self.pool_bytes, self.fingerprint.encode(), self.host_layout.encode())

    @classmethod
    def unpack(cls, raw: bytes) -> tuple[bytes, int, "Geometry"]:
        magic, version, _, n, pb, to, po, pbytes, fp, hl = _HEADER.unpack(raw[:_HEADER.size])
        return magic, version, cls(n, pb, to, po, pbytes, fp.rstrip(b"\0").decode(errors="replace"),
                                   hl.rstrip(b"\0").decode(errors="replace"))


class SegmentOpen(NamedTuple):
    segment: "L2Segment"
    action: str  # "created", "adopted" or "recreated"
    reason: str  # why (empty for "created")
    restored: int  # committed pages found in an adopted segment's table


class L2Segment:
    """A mapped service segment. ``pool`` is the ``HostPool`` over its pool
    region; as ``PageJournal`` it keeps the page table. Close with ``close()``.

    The page table mirrors the server's L2 index (it is the index's
    ``PageJournal``): on commit the hash is written before the state byte, and
    the state is cleared before a page is freed, so at any instant an entry that
    says "committed" names bytes an engine wrote and committed. That is what
    lets a server that starts after a crash adopt the segment with its pages.

    ``open_for_server`` decides what to do with a segment of the same name:

    * none: create it;
    * not a file this user made (another owner, another mode, a symlink, a
      hard link, not a regular file): refuse (``PoolError`` saying how to remove
      it), since another local user could have planted it;
    * a live server owns it: refuse (``PoolError``, unchanged message);
    * left behind by a dead server: adopt it when its header matches this
      layout and no other process still maps it (a client of the dead server
      could otherwise still be writing a page the new server hands out again);
      else recreate it. ``SegmentOpen`` says which, and why.
    """

    def __init__(self, shm: SharedSegment, layout: KVLayout, geo: Geometry):
        assert shm.tensor is not None and shm.size >= geo.size, (shm.size, geo)
        self.shm, self.layout, self.geometry = shm, layout, geo
        self.pool = HostPool(layout, geo.num_pages, buffer=shm.tensor[geo.pool_offset:geo.size])
        self._table = memoryview(shm.tensor[geo.table_offset:geo.pool_offset].numpy())

    # --------------------------------------------------------------- opening
    @classmethod
    def open_for_server(cls, name: str, layout: KVLayout, num_pages: int, gid: int | None = None) -> SegmentOpen:
        """Create, adopt or recreate segment ``name`` for a server (see the class docstring);
        ``gid``: the group that may map it too (``service.socket_group``).

        Raises ``PoolError`` when a live server owns it, when the file under
        the name is not one this user made (``hicache.memory.shm.check_trusted``), or
        when /dev/shm has no room.
        """
        geo = Geometry.of(layout, num_pages)
        orphan = SharedSegment.take_orphan(name, gid)
        if orphan is None:
            return SegmentOpen(cls._create(name, layout, geo, gid), "created", "", 0)
        why = cls._unadoptable(orphan, geo)
        if not why:
            seg = cls(orphan, layout, geo)
            entries = seg.entries()
            return SegmentOpen(seg, "adopted", f"left by a server that is gone; header and fingerprint "
                               f"{geo.fingerprint} match", len(entries))
        orphan.close()  # owner: unlinks it (processes that still map it keep their old pages)
        return SegmentOpen(cls._create(name, layout, geo, gid), "recreated", why, 0)

    @classmethod
    def _create(cls, name: str, layout: KVLayout, geo: Geometry, gid: int | None) -> "L2Segment":
        shm = SharedSegment.create(name, geo.size, gid)
        try:
            assert shm.tensor is not None
            shm.tensor[:_HEADER.size].copy_(_bytes_tensor(geo.pack()))
            return cls(shm, layout, geo)
        except BaseException:
            shm.close()
            raise

    @staticmethod
    def _unadoptable(orphan: SharedSegment, want: Geometry) -> str:
        """Why ``orphan`` cannot be adopted, or "" when it can."""
        if orphan.mapped_elsewhere:
            return "left by a server that is gone, but other processes still map it (clients of that server)"
        assert orphan.tensor is not None
        if orphan.size < _HEADER.size:
            return f"left by a server that is gone; {orphan.size} bytes cannot hold a header"
        magic, version, have = Geometry.unpack(orphan.tensor[:_HEADER.size].numpy().tobytes())
        if magic != MAGIC or version != FORMAT_VERSION:
            return (f"left by a server that is gone; header magic/version {magic!r}/{version}, "
                    f"expected {MAGIC!r}/{FORMAT_VERSION}")
        diffs = [f"{f}: found {a!r}, need {b!r}" for f, a, b in zip(Geometry._fields, have, want) if a != b]
        if orphan.size != want.size:
            diffs.append(f"size: found {orphan.size}, need {want.size}")
        if diffs:
            return "left by a server that is gone, for another layout or size (" + "; ".join(diffs) + ")"
        return ""

    # ------------------------------------------------------------ page table
    def committed(self, page: int, h: PageHash, draft: bool) -> None:
        o = page * ENTRY_BYTES
        t = self._table
        t[o + ENTRY_BYTES - HASH_BYTES:o + ENTRY_BYTES] = h  # the hash before the state that vouches for it
        t[o] = COMMITTED | (DRAFT if draft else 0)

    def dropped(self, page: int) -> None:
        self._table[page * ENTRY_BYTES] = 0

    def entries(self) -> list[tuple[int, PageHash, bool]]:
        """``(page, hash, draft complete)`` of every committed entry, by page."""
        t, out = self._table, []
        for p in range(self.geometry.num_pages):
            o = p * ENTRY_BYTES
            st = t[o]
            if st & COMMITTED:
                out.append((p, PageHash(bytes(t[o + ENTRY_BYTES - HASH_BYTES:o + ENTRY_BYTES])), bool(st & DRAFT)))
        return out

    def check_against(self, committed: dict[int, tuple[PageHash, bool]]) -> list[str]:
        """Differences between the table and ``{page: (hash, draft complete)}``."""
        have = {p: (h, d) for p, h, d in self.entries()}
        return [f"page {p}: table {have.get(p)!r}, index {committed.get(p)!r}"
                for p in sorted(set(have) | set(committed)) if have.get(p) != committed.get(p)][:8]

    @property
    def size(self) -> int:
        return self.geometry.size

    @property
    def info(self) -> dict[str, object]:
        """What a client's handshake needs to map the pool."""
        return {"shm_name": self.shm.name, "shm_size": self.geometry.size, "pool_offset": self.geometry.pool_offset,
                "num_pages": self.geometry.num_pages}

    def close(self) -> None:
        self._table.release()
        self.pool = None  # type: ignore[assignment]  # drop the views before unmapping
        self.shm.close()


def _bytes_tensor(b: bytes):
    import torch
    return torch.frombuffer(bytearray(b), dtype=torch.uint8)
