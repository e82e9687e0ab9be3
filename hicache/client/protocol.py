"""Frame format of the local engine API, shared by the server and the client.

A frame is a 4-byte big-endian unsigned body length followed by a msgpack map.
Requests carry ``op``; replies carry ``ok`` and either the op's result fields
or ``kind`` + ``message`` (+ ``differences`` for a contract mismatch).

The first request on a connection must be ``hello`` (see ``hello_request``);
anything else is refused. Its reply carries the segment to map (``shm_name``,
``shm_size``, ``pool_offset``, ``num_pages``), ``client_id``, ``fingerprint``
and ``has_l3`` (the service has an L3 of its own for ``fetch``). A hello with
``role: "consensus"`` (and no layout) opens a connection for ``agree``,
``stats``, ``check`` and ``bye`` only.
"""
from __future__ import annotations

import struct
from typing import Any, NamedTuple

import msgpack

from hicache.core.errors import ServiceError

# Bump on any incompatible change of frames, ops or their fields.
# Ops after the handshake, with their fields:
#
# =========  ==========================  ==========================================
# op         request fields              reply fields
# =========  ==========================  ==========================================
# lookup     hashes: [bin16]             pages: [int] (leading present pages)
# fetch      hashes: [bin16], wait_ms    pages: [int], fetched: int (lookup that
#                                        first loads missing pages from the
#                                        service's L3, waiting up to wait_ms)
# reserve    n: int                      pages: [int] (for the client to write)
# commit     hashes: [bin16], pages,     inserted: int, duplicates: int
#            draft_pages: int
# cancel     pages: [int]                (reserved pages given back unwritten)
# acquire    hashes: [bin16]             pages: [int] (leading present, now locked)
# release    hashes: [bin16]             (undoes acquire, one count per hash)
# agree      group, round, rank, world,      values: [int] (element-wise minimum over
#            values: [int], wait_ms          the group's ranks; see hicache.client.consensus)
# stats      -                           stats: map
# report     figures: {str: int}, name   (this engine's own L1/L2 figures, replacing
#                                        its last report; see EngineReport in
#                                        hicache.node.snapshot; dropped on
#                                        disconnect)
# check      -                           (runs the server's check_integrity)
# bye        -                           (server closes after replying)
# =========  ==========================  ==========================================
#
# Draft validity (layouts with draft planes): ``commit``'s optional
# ``draft_pages`` counts the leading pages whose draft rows are valid (absent:
# all pages for a layout without draft planes, none for one with them);
# ``lookup``, ``fetch`` and ``acquire`` take an optional ``need_draft: bool``
# (default false) that stops the answer at the first page without valid draft
# rows, as an embedded cache's ``match(need_draft=True)`` does.
#
# This module does no I/O: the server reads with asyncio, the client with a
# blocking socket, and both use these helpers for the bytes.
PROTOCOL_VERSION = 2

HEADER = struct.Struct(">I")
HEADER_BYTES = HEADER.size
# Largest frame a connection may send before its handshake. A real hello is a
# KVLayout of at most 16 extra planes, under 4 KiB; anything bigger (an 800K
# plane layout is 7.5 MiB) is refused from its 4-byte header, before the
# server reads or decodes a byte of it.
MAX_HELLO_BYTES = 64 << 10

OPS = frozenset({"lookup", "fetch", "reserve", "commit", "cancel", "acquire", "release", "agree", "stats",
                 "report", "check", "bye"})

# Error kinds a server may send (the client also uses ``closed``).
ERROR_KINDS = ("bad_frame", "too_large", "bad_request", "unknown_op", "not_handshaken", "version",
               "bad_layout", "contract", "bad_args", "foreign_page", "not_reserved", "not_acquired",
               "out_of_pages", "integrity", "internal", "not_written", "forbidden", "busy", "timeout")


class CommitResult(NamedTuple):
    """The ``commit`` op's answer (``L2Index.commit`` on the server, ``ServiceClient.commit``)."""

    inserted: int  # pages that became lookup-able
    duplicates: int  # pages whose hash was already present; their reserved page went back to free


def pack(obj: dict[str, Any]) -> bytes:
    """One whole frame (header + body) for ``obj``."""
    body = msgpack.packb(obj, use_bin_type=True)
    return HEADER.pack(len(body)) + body


def body_length(header: bytes, max_bytes: int, *, hello: bool = False) -> int:
    """Length announced by a 4-byte header; raises ``ServiceError`` when out of range.

    ``too_large`` when above ``max_bytes`` (``hello``: the frame before the
    handshake, above ``min(max_bytes, MAX_HELLO_BYTES)``); ``bad_frame`` for an
    empty body or a header that is not ``HEADER_BYTES`` long.
    """
    if len(header) != HEADER_BYTES:
        raise ServiceError("bad_frame", f"frame header must be {HEADER_BYTES} bytes, got {len(header)}")
    (n,) = HEADER.unpack(header)
    if hello and n > min(max_bytes, MAX_HELLO_BYTES):
        raise ServiceError("too_large", f"first frame of {n} bytes exceeds the handshake limit of "
                           f"{min(max_bytes, MAX_HELLO_BYTES)}; a hello carries one KVLayout (at most 16 "
                           "extra planes) and is a few KiB")
    if n > max_bytes:
        raise ServiceError("too_large", f"frame body of {n} bytes exceeds the limit of {max_bytes} "
                           "(service.max_request_bytes); split the request")
    if n == 0:
        raise ServiceError("bad_frame", "empty frame body; every frame carries a msgpack map")
    return n


def unpack(body: bytes) -> dict[str, Any]:
    """Decode a frame body into a map with string keys; ``ServiceError`` otherwise."""
    try:
        obj = msgpack.unpackb(body, raw=False, strict_map_key=True, use_list=True)
    except Exception as e:  # msgpack raises several unrelated types on garbage
        raise ServiceError("bad_frame", f"body is not valid msgpack ({type(e).__name__}: {e})") from None
    if not isinstance(obj, dict):
        raise ServiceError("bad_request", f"frame body must be a msgpack map, got {type(obj).__name__}")
    return obj


def hello_request(layout_dict: dict[str, Any], fingerprint: str, pid: int) -> dict[str, Any]:
    return {"op": "hello", "protocol": PROTOCOL_VERSION, "layout": layout_dict,
            "fingerprint": fingerprint, "pid": pid}


def error_reply(kind: str, message: str, **extra: Any) -> dict[str, Any]:
    assert kind in ERROR_KINDS, f"error kind {kind!r} is not in protocol.ERROR_KINDS"
    return {"ok": False, "kind": kind, "message": message, **extra}


def plain(value: Any) -> Any:
    """``value`` made msgpack-safe for error details (tuples and dataclasses become lists)."""
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if hasattr(value, "__dataclass_fields__"):
        return [plain(getattr(value, f)) for f in value.__dataclass_fields__]
    if value is None or isinstance(value, (bool, int, float, str, bytes)):
        return value
    return repr(value)
