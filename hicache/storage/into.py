"""Reads straight into the caller's buffer: the pieces of ``StorageBackend.get_into``.

A backend's ``_raw_get_into`` answers, per key, what ``_raw_get`` answers (``None``,
an exception, or the whole object, which the base decodes and copies into the
destination once), or ``InPlace(header)``: the payload was read into the destination
itself and ``header`` holds everything before it (file:// reads both with one
``preadv``). Verification happens in place, in the backend's thread right after each
read (``Verifier``, ``verify_into``), while the bytes are still in that core's cache.

Contract: a destination whose page is reported missing (absent, unreadable, corrupt,
another layout's, a bad MAC, L3 down) may hold garbage; after a call that timed out,
a file:// worker may still finish the one page it was reading. Callers treat such a
page as free space and never expose it; the adapters report it as not loaded and
zero it (``wipe_unloaded``), and the engines recompute it over that memory.
"""
from __future__ import annotations

import hmac
from typing import NamedTuple, Sequence

import numpy as np

from hicache.storage import codec
from hicache.storage.codec import Buffer, Decoded, ReadStatus

# Beyond this, what precedes the payload is not a header of ours (a header is
# ~100 bytes plus a few per plane): the object is read whole and rejected by decode.
MAX_SPLIT_HEADER = 64 << 10


class InPlace(NamedTuple):
    """The payload lies in the destination; ``header`` is the object's bytes before it."""

    header: Buffer


Dest = Buffer | Sequence[Buffer]  # one buffer, or the payload's segments in order (scatter)


def dest_views(dests: Sequence[Dest], nbytes: int, n_keys: int) -> list[list[memoryview]]:
    """Per destination, its flat writable byte views (segments, in payload order),
    ``nbytes`` in all. Raises ``ValueError`` naming the offending destination
    (misuse, never data)."""
    if len(dests) != n_keys:
        raise ValueError(f"get_into: {n_keys} keys but {len(dests)} destinations")
    out = []
    for i, d in enumerate(dests):
        segs = [codec.as_bytes_view(x) for x in d] if isinstance(d, (list, tuple)) else [codec.as_bytes_view(d)]
        if any(mv.readonly for mv in segs):
            raise ValueError(f"get_into: destination {i} is read-only; pass a writable buffer (a row, a bytearray)")
        got = sum(mv.nbytes for mv in segs)
        if got != nbytes:
            raise ValueError(f"get_into: destination {i} has {got} bytes, the page payload {nbytes}")
        out.append(segs)
    return out


def scatter(payload: memoryview, segs: list[memoryview]) -> None:
    """Copy a verified payload into a destination's segments."""
    pos = 0
    for mv in segs:
        mv[:] = payload[pos:pos + mv.nbytes]
        pos += mv.nbytes


def header_of(fingerprint: str, page_hash: bytes, t: codec.HeaderTemplate, segs: list[memoryview],
              auth_key: bytes = b"") -> bytes:
    """``codec.encode_header`` of the payload that ``segs`` hold in order (no join)."""
    return codec.header_of_segments(t, page_hash, segs, auth_key)


def verify_into(header: Buffer, segs: list[memoryview], page_hash: bytes, fingerprint: str,
                template: codec.HeaderTemplate, auth_key: bytes = b"") -> ReadStatus | Decoded:
    """Verify an object split as ``header`` + the payload already in ``segs``.

    Fast path: the header is byte for byte what our writer builds for this
    page and these payload bytes (checksum and, with a key, MAC computed over
    the destination); compared in constant time. Anything else (an object of an
    older writer, damage, another layout) is judged by ``codec.decode`` over a
    joined copy, so statuses and reasons are exactly those of ``get``. Returns
    ``ReadStatus.OK`` or the failed ``Decoded``. Never raises on bad data;
    mutates nothing.
    """
    if hmac.compare_digest(header, codec.header_of_segments(template, page_hash, segs, auth_key)):
        return ReadStatus.OK
    d = codec.decode(bytes(header) + b"".join(segs), page_hash, fingerprint, template.sizes, auth_key, template)
    # OK here means decode found the payload at the split point, so ``segs`` hold it.
    return ReadStatus.OK if d.status is ReadStatus.OK else d


def wipe_unloaded(direct_io: bool, dests: Sequence[Buffer | Sequence[Buffer]], got: Sequence[object]) -> int:
    """Zero the destination of each page ``get_into`` did not load (``got[i]`` falsy), so
    what a refused read left there (a bad MAC's payload, a partial object) is not kept.
    Only a ``DIRECT_IO`` store (``direct_io``) reads into destinations before verifying;
    the others copy verified payloads only, so nothing is wiped for them (an outage
    leaves the memory as it was). ``dests``: per page, one writable buffer or a list
    of them. Mutates them; returns the pages wiped."""
    if not direct_io:
        return 0
    n = 0
    for dest, ok in zip(dests, got):
        if ok:
            continue
        for buf in dest if isinstance(dest, (list, tuple)) else (dest,):
            np.frombuffer(buf, dtype=np.uint8)[:] = 0
        n += 1
    return n


class Verifier:
    """Judges what a backend read for page ``i`` of one ``get_into`` call: ``ReadStatus.OK``
    (the payload is in ``views[i]``), the failed ``Decoded``, or what was read when it is
    ``None`` or an exception. Called by the backend's workers, any thread; it writes
    only into ``views[i]`` (the copy of an object read whole)."""

    __slots__ = ("keys", "views", "fingerprint", "template", "auth_key")

    def __init__(self, keys: list[bytes], views: list[list[memoryview]], fingerprint: str,
                 template: codec.HeaderTemplate, auth_key: bytes):
        self.keys, self.views, self.fingerprint = keys, views, fingerprint
        self.template, self.auth_key = template, auth_key

    def __call__(self, i: int, obj: object) -> ReadStatus | Decoded | BaseException | None:
        if obj is None or isinstance(obj, BaseException):
            return obj
        segs = self.views[i]
        if isinstance(obj, InPlace):
            return verify_into(obj.header, segs, self.keys[i], self.fingerprint, self.template, self.auth_key)
        # The whole object (too short or too odd to split): decoded, then one copy.
        d = codec.decode(obj, self.keys[i], self.fingerprint, self.template.sizes, self.auth_key, self.template)
        if d.status is not ReadStatus.OK:
            return d
        scatter(d.payload, segs)  # type: ignore[arg-type]
        return ReadStatus.OK
