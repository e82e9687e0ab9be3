"""Reads straight into the caller's buffer: the pieces of ``StorageBackend.get_into``.

A backend's ``_raw_get_into`` answers, per key, what ``_raw_get`` answers
(``None``, an exception, or the whole object, which the base then decodes and
copies into the destination once: the default, and what ``redis://`` does with
its reply), or ``InPlace(header)``: the object's payload bytes were read into
the destination itself and ``header`` holds everything before them (file://
reads both with one ``preadv``).

Verification happens in place, over the destination's bytes (``verify_into``).

Contract: a destination whose page is reported missing (absent, unreadable,
corrupt, another layout's, a bad MAC, L3 down) may have been written: it holds
garbage (a partial object, unverified bytes). Callers must treat it as free
space and never expose it; the adapters report such a page as not loaded, and
the engines then recompute it over that memory.
"""
from __future__ import annotations

import hmac
from typing import NamedTuple, Sequence

from hicache.storage import codec
from hicache.storage.codec import Buffer, Decoded, ReadStatus

# Beyond this, what precedes the payload is not a header of ours (a header is
# ~100 bytes plus a few per plane): the object is read whole and rejected by decode.
MAX_SPLIT_HEADER = 64 << 10


class InPlace(NamedTuple):
    """The payload lies in the destination; ``header`` is the object's bytes before it."""

    header: Buffer


def dest_views(dests: Sequence[Buffer], nbytes: int, n_keys: int) -> list[memoryview]:
    """Flat writable byte views of the destinations, each exactly ``nbytes``.

    Raises ``ValueError`` naming the offending destination (misuse, never data).
    """
    if len(dests) != n_keys:
        raise ValueError(f"get_into: {n_keys} keys but {len(dests)} destinations")
    out = []
    for i, d in enumerate(dests):
        mv = codec.as_bytes_view(d)
        if mv.readonly:
            raise ValueError(f"get_into: destination {i} is read-only; pass a writable buffer (a row, a bytearray)")
        if mv.nbytes != nbytes:
            raise ValueError(f"get_into: destination {i} has {mv.nbytes} bytes, the page payload {nbytes}")
        out.append(mv)
    return out


def verify_into(header: Buffer, dest: memoryview, page_hash: bytes, fingerprint: str,
                template: codec.HeaderTemplate, auth_key: bytes = b"") -> Decoded:
    """Verify an object split as ``header`` + the payload already in ``dest``.

    Fast path: the header is byte for byte what our writer builds for this
    page and these payload bytes (checksum and, with a key, MAC computed over
    ``dest``); compared in constant time. Anything else (an object of an
    older writer, damage, another layout) is judged by ``codec.decode`` over a
    joined copy, so statuses and reasons are exactly those of ``get``. Never
    raises on bad data; mutates nothing.
    """
    want = codec.encode_header(fingerprint, page_hash, template.sizes, dest, auth_key, template)
    hdr = bytes(header)
    if hmac.compare_digest(hdr, want):
        return Decoded(ReadStatus.OK, dest, "")
    d = codec.decode(hdr + bytes(dest), page_hash, fingerprint, template.sizes, auth_key, template)
    # OK here means decode found the payload at the split point, so ``dest`` holds it.
    return Decoded(ReadStatus.OK, dest, "") if d.status is ReadStatus.OK else d
