"""The L3 object format: one object per page, verified on every read.

Layout of an object (all integers little-endian)::

    magic      4 bytes  b"HCL3"
    hdr_len    4 bytes  uint32, length of the msgpack header
    header     hdr_len  msgpack map: version, fingerprint, hash, plane_sizes,
                        length, checksum (xxh3_64 of the payload), hck
                        (xxh3_64 of the msgpack map of the fields before it)
    payload    length   the page's planes in canonical order, raw bytes

With an authentication key (``storage.auth_key``), the header also carries
``mac``: keyed BLAKE3-256 over the payload followed by the msgpack map of the
fields before it (payload first, so the checksum and the MAC take one pass
over it, block by block from cache). A reader with the key rejects (as
corrupt, so a counted miss) an object without a valid ``mac``: checksums
catch damage, the MAC catches forgery by anyone who can write the store but
lacks the key. A reader without a key ignores ``mac``. Version 1 objects
(MAC: keyed BLAKE2b over fields then payload) are re-verified field by field
without a key and refused with one.

``hck`` makes a damaged header corrupt rather than "another layout": without
it, a bit flip inside the fingerprint read as a well-formed object of some
other layout, which is kept and only warned about. Objects written before
``hck`` existed (same format version) are verified without it.

The header and the payload travel as two buffers (``encode_header`` never
copies the payload); ``decode`` slices a memoryview, so a verified payload is a
zero-copy view of the object it came from.
"""
from __future__ import annotations

import enum
import hmac
import os
import struct
from typing import NamedTuple, Sequence

import blake3
import msgpack
import xxhash

MAGIC = b"HCL3"
# Bump when the object layout or the header's meaning changes; readers treat
# any other version as corrupt (never as data).
FORMAT_VERSION = 2
# Version 1 differs only in its MAC (keyed BLAKE2b, fields first): its objects
# verify by their checksums for a reader without a key, and are refused by one with a key.
OLD_VERSIONS = frozenset({1})
_PREFIX = struct.Struct("<4sI")
PREFIX_BYTES = _PREFIX.size
_FIELDS = frozenset({"version", "fingerprint", "hash", "plane_sizes", "length", "checksum", "mac", "hck"})
MAC_BYTES = 32


_MAC_CONTEXT = "hicache L3 object MAC, format version 2"
# Payload bytes hashed at a time when a checksum and a MAC both read them: a
# block stays in L2 for the second hash (one pass from memory, not two).
HASH_BLOCK = 256 << 10


def mac_key(secret: bytes) -> bytes:
    """The 32-byte BLAKE3 key for a configured secret of any length (BLAKE3's key derivation)."""
    return blake3.blake3(secret, derive_key_context=_MAC_CONTEXT).digest()


def _usable_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


# A MAC over a payload of at least MAC_THREADS_MIN_BYTES is hashed by BLAKE3's own
# threads where there are cores to spare (its tree splits a page among them); on a box of
# fewer than MAC_THREADS_MIN_CPUS the readers' parallel pages already use every core.
MAC_THREADS_MIN_BYTES = 512 << 10
MAC_THREADS_MIN_CPUS = 4
_MAC_THREADS = blake3.blake3.AUTO if _usable_cpus() >= MAC_THREADS_MIN_CPUS else 1


def _mac_state(key: bytes, nbytes: int) -> "blake3.blake3":
    return blake3.blake3(key=key, max_threads=_MAC_THREADS if nbytes >= MAC_THREADS_MIN_BYTES else 1)


def payload_digests(segs: Sequence[memoryview], key: bytes = b"",
                    claimed: int | None = None) -> tuple[int, "blake3.blake3 | None"]:
    """The xxh3_64 checksum of the payload ``segs`` hold in order and, with a MAC
    ``key``, the BLAKE3 MAC state fed with the payload (the fields follow: ``_finish_mac``).
    Both hashes read each block in turn; both release the GIL on large buffers.
    ``claimed`` (with a key only): the checksum a stored header claims, returned as is
    with no xxh3 pass; the MAC, which covers the payload and that claim, judges both."""
    if not key and len(segs) == 1:
        return xxhash.xxh3_64_intdigest(segs[0]), None
    if key and claimed is not None:
        m = _mac_state(key, sum(mv.nbytes for mv in segs))
        for mv in segs:
            m.update(mv)
        return claimed, m
    x = xxhash.xxh3_64()
    m = _mac_state(key, sum(mv.nbytes for mv in segs)) if key else None
    for mv in segs:
        if m is None:
            x.update(mv)
            continue
        for at in range(0, mv.nbytes, HASH_BLOCK):
            b = mv[at:at + HASH_BLOCK]
            x.update(b)
            m.update(b)
    return x.intdigest(), m


def _finish_mac(m: "blake3.blake3", fields_packed: bytes) -> bytes:
    m.update(fields_packed)
    return m.digest(MAC_BYTES)


def _mac(key: bytes, fields_packed: bytes, payload: memoryview) -> bytes:
    _, m = payload_digests([payload], key)
    return _finish_mac(m, fields_packed)
# A header is ~100 bytes plus 1-5 per plane; anything far beyond is garbage.
_MAX_HEADER = 1 << 20

Buffer = bytes | bytearray | memoryview


class ReadStatus(enum.Enum):
    OK = "ok"
    CORRUPT = "corrupt"  # framing, version, hash, sizes, length or checksum wrong
    FINGERPRINT = "fingerprint_mismatch"  # a well-formed object of another layout


class Decoded(NamedTuple):
    status: ReadStatus
    payload: memoryview | None  # set only when status is OK; a view of the object
    why: str  # empty when OK; names the field and both values otherwise


class PlaneSizes(NamedTuple):
    """Plane sizes validated once per batch (a layout has up to hundreds of planes)."""

    sizes: list[int]
    total: int


def plane_sizes(sizes: Sequence[int] | PlaneSizes) -> PlaneSizes:
    if isinstance(sizes, PlaneSizes):
        return sizes
    out = [int(s) for s in sizes]
    if any(s < 0 for s in out):
        raise ValueError(f"plane sizes {out} must be >= 0")
    return PlaneSizes(out, sum(out))


def checksum(payload: Buffer) -> int:
    return xxhash.xxh3_64_intdigest(payload)


def as_bytes_view(payload: Buffer) -> memoryview:
    """A flat byte view of ``payload`` (no copy); raises if it is not contiguous."""
    mv = memoryview(payload)
    if mv.format != "B" or mv.ndim != 1:
        mv = mv.cast("B")
    return mv


def check_length(payload: memoryview, sizes: PlaneSizes) -> None:
    """Raise ``ValueError`` unless the payload is exactly the planes' bytes."""
    if payload.nbytes != sizes.total:
        raise ValueError(f"payload of {payload.nbytes} bytes does not match plane sizes summing to "
                         f"{sizes.total} ({len(sizes.sizes)} planes); pass the page's canonical payload")


class HeaderTemplate(NamedTuple):
    """The msgpack bytes of a header's fields that do not depend on the page,
    for one fingerprint and plane sizes (``header_template``). Headers built
    from it are byte for byte what ``msgpack.packb`` of the fields gives (the
    map keeps insertion order and msgpack's smallest encodings), without
    packing the fields' dict per page, and let ``decode`` check a header by
    comparing bytes."""

    head: bytes  # "version", 1, "fingerprint", fp, "hash" (key only)
    tail: bytes  # "plane_sizes", [...], "length", n, "checksum" (key only)
    sizes: PlaneSizes


_MAP = 0x80  # msgpack fixmap with n < 16 entries: one byte, 0x80 | n
_MAC_KEY = msgpack.packb("mac")
_HCK_KEY = msgpack.packb("hck")


def header_template(fingerprint: str, sizes: Sequence[int] | PlaneSizes) -> HeaderTemplate:
    ps = plane_sizes(sizes)
    pk = msgpack.packb
    return HeaderTemplate(pk("version") + pk(FORMAT_VERSION) + pk("fingerprint") + pk(fingerprint) + pk("hash"),
                          pk("plane_sizes") + pk(ps.sizes) + pk("length") + pk(ps.total) + pk("checksum"), ps)


def _uint(v: int) -> bytes:
    """``msgpack.packb(v)`` for 0 <= v < 2**64 (msgpack's smallest encoding), without a Packer per call."""
    if v < 0x80:
        return bytes((v,))
    if v < 0x100:
        return b"\xcc" + bytes((v,))
    if v < 0x10000:
        return b"\xcd" + v.to_bytes(2, "big")
    if v < 0x100000000:
        return b"\xce" + v.to_bytes(4, "big")
    return b"\xcf" + v.to_bytes(8, "big")


def _bin(b: bytes) -> bytes:
    """``msgpack.packb(b)`` for bytes shorter than 256."""
    return b"\xc4" + bytes((len(b),)) + b if len(b) < 0x100 else msgpack.packb(b)


def header_bytes(t: HeaderTemplate, keyed: bool, hash_bytes: int = 16) -> int:
    """The length of the header (magic and length prefix included) our writer builds for
    a page of this template whose checksums need their full 8 bytes (all but 1 in 2**32
    pages): what a reader expects before the payload."""
    n = PREFIX_BYTES + 1 + len(t.head) + 2 + hash_bytes + len(t.tail) + 9 + len(_HCK_KEY) + 9
    return n + (len(_MAC_KEY) + 2 + MAC_BYTES if keyed else 0)


def claimed_checksum(t: HeaderTemplate, page_hash: bytes, header: Buffer) -> int | None:
    """The payload checksum that ``header`` (an object's bytes before its payload) holds
    where our writer puts it for this template and page, or None when it is not there
    (then the header is not ours, and the caller hashes the payload to judge it)."""
    at = PREFIX_BYTES + 1 + len(t.head) + 2 + len(page_hash) + len(t.tail)
    if len(page_hash) >= 0x100 or len(header) < at + 9 or header[at] != 0xCF:
        return None
    return int.from_bytes(header[at + 1:at + 9], "big")


_BIN16 = b"\xc4\x10"  # msgpack bin8 of 16 bytes: a page hash
_MAP6, _MAP7, _MAP8 = (bytes((_MAP | n,)) for n in (6, 7, 8))
_HCK_UINT64 = _HCK_KEY + b"\xcf"


def _header_fields(t: HeaderTemplate, page_hash: bytes, ck: int) -> bytes:
    """The six fields' entries (no map byte): what ``hck`` and the MAC cover, after the map byte."""
    key = _BIN16 + page_hash if len(page_hash) == 16 else _bin(bytes(page_hash))
    return t.head + key + t.tail + _uint(ck)


def encode_header(fingerprint: str, page_hash: bytes, sizes: Sequence[int] | PlaneSizes,
                  payload: Buffer, auth_key: bytes = b"", template: HeaderTemplate | None = None) -> bytes:
    """Magic, length prefix and msgpack header for ``payload``; the object is
    this header followed by ``payload`` unchanged. Raises ``ValueError`` when
    the payload length is not the sum of the plane sizes. ``template``: from
    ``header_template(fingerprint, sizes)``, reused across a batch (same bytes)."""
    mv = as_bytes_view(payload)
    t = template or header_template(fingerprint, sizes)
    check_length(mv, t.sizes)
    return header_of_segments(t, page_hash, [mv], auth_key)


def header_of_segments(t: HeaderTemplate, page_hash: bytes, segs: Sequence[memoryview], auth_key: bytes = b"",
                       claimed: int | None = None) -> bytes:
    """``encode_header`` of the payload that ``segs`` hold in order (no join, one
    pass over the bytes); the caller has checked that they sum to ``t.sizes.total``.
    ``claimed``: with ``auth_key``, the checksum a stored header claims (``claimed_checksum``):
    the header is then built with it and no xxh3 pass; it equals the stored header only
    if the MAC over this payload and that claim verifies (a reader's check, not a writer's)."""
    ck, m = payload_digests(segs, auth_key, claimed if auth_key else None)
    return header_of_digests(t, page_hash, ck, m)


def header_of_digests(t: HeaderTemplate, page_hash: bytes, ck: int, m: "blake3.blake3 | None") -> bytes:
    """The header for a payload whose checksum is ``ck`` and whose MAC state (None
    without a key) has been fed the payload (``payload_digests``)."""
    # Run once per page read or written: the map bytes are constants, not built per call.
    entries = _header_fields(t, page_hash, ck)
    if m is None:
        covered, whole = _MAP6 + entries, _MAP7
    else:
        entries += _MAC_KEY + _bin(_finish_mac(m, _MAP6 + entries))
        covered, whole = _MAP7 + entries, _MAP8
    hdr = whole + entries + _HCK_KEY + _uint(xxhash.xxh3_64_intdigest(covered))
    return _PREFIX.pack(MAGIC, len(hdr)) + hdr


class PlainHeaders:
    """``header_of_digests(t, page_hash, ck, None)`` for a batch's pages without a key, the
    common case built from bytes fixed per template: a 16-byte page hash, a checksum and an
    ``hck`` of 8 bytes each (all but 1 in 2**31 pages). Same bytes; None where the case does
    not hold (the caller then calls ``header_of_digests``). Pure."""

    __slots__ = ("_pre", "_mid", "_covered")

    def __init__(self, t: HeaderTemplate):
        n = 1 + len(t.head) + len(_BIN16) + 16 + len(t.tail) + 9 + len(_HCK_KEY) + 9  # the msgpack map's bytes
        self._pre = _PREFIX.pack(MAGIC, n) + _MAP7 + t.head + _BIN16
        self._mid = t.tail + b"\xcf"  # uint64's marker
        self._covered = _MAP6 + t.head + _BIN16

    def __call__(self, page_hash: bytes, ck: int) -> bytes | None:
        if ck < 1 << 32 or len(page_hash) != 16:
            return None
        fields = page_hash + self._mid + ck.to_bytes(8, "big")
        hck = xxhash.xxh3_64_intdigest(self._covered + fields)
        if hck < 1 << 32:
            return None
        return self._pre + fields + _HCK_UINT64 + hck.to_bytes(8, "big")


def _encode_header_dict(fingerprint: str, page_hash: bytes, sizes: Sequence[int] | PlaneSizes,
                        payload: Buffer, auth_key: bytes = b"") -> bytes:
    """The header built from its fields' dict: the reference ``encode_header`` must equal (tests)."""
    mv = as_bytes_view(payload)
    ps = plane_sizes(sizes)
    check_length(mv, ps)
    n = mv.nbytes
    fields = {"version": FORMAT_VERSION, "fingerprint": fingerprint, "hash": bytes(page_hash),
              "plane_sizes": ps.sizes, "length": n, "checksum": checksum(mv)}
    if auth_key:
        fields["mac"] = _mac(auth_key, msgpack.packb(fields), mv)
    fields["hck"] = checksum(msgpack.packb(fields))
    hdr = msgpack.packb(fields)
    return _PREFIX.pack(MAGIC, len(hdr)) + hdr


def encode(fingerprint: str, page_hash: bytes, sizes: Sequence[int] | PlaneSizes, payload: Buffer,
           auth_key: bytes = b"") -> bytes:
    """The whole object as one ``bytes`` (copies the payload; for in-memory stores and tests)."""
    return encode_header(fingerprint, page_hash, sizes, payload, auth_key) + bytes(payload)


def _bad(why: str) -> Decoded:
    return Decoded(ReadStatus.CORRUPT, None, why)


def _decode_exact(mv: memoryview, page_hash: bytes, t: HeaderTemplate, auth_key: bytes = b"") -> Decoded | None:
    """OK when the object is byte for byte what ``encode_header`` writes for
    this page and payload (then every check of ``decode`` holds; compared in
    constant time); None for anything else, which ``decode`` then examines
    field by field."""
    if mv.nbytes < PREFIX_BYTES:
        return None
    magic, hlen = _PREFIX.unpack_from(mv)
    end = PREFIX_BYTES + hlen
    if magic != MAGIC or mv.nbytes - end != t.sizes.total:
        return None
    payload = mv[end:]
    claimed = claimed_checksum(t, page_hash, mv[:end]) if auth_key else None
    want = header_of_segments(t, page_hash, [payload], auth_key, claimed)
    if len(want) != end or not hmac.compare_digest(mv[:end], want):
        return None
    return Decoded(ReadStatus.OK, payload, "")


def decode(obj: Buffer, page_hash: bytes, fingerprint: str,
           expected: Sequence[int] | PlaneSizes | None, auth_key: bytes = b"",
           template: HeaderTemplate | None = None) -> Decoded:
    """Verify ``obj`` against what the reader expects; never raises on bad data.

    ``expected=None`` checks only internal consistency (used by
    ``check_integrity``, which does not know the layout's planes).
    ``auth_key`` (from ``mac_key``): also require a valid MAC.
    ``template``: ``header_template(fingerprint, expected)``, reused across a
    batch; an object whose header is exactly the one this page's payload
    gets verifies by one comparison of bytes.
    """
    mv = as_bytes_view(obj)
    if template is not None:
        d = _decode_exact(mv, page_hash, template, auth_key)
        if d is not None:
            return d
    hdr = _parse_header(mv)
    if isinstance(hdr, Decoded):
        return hdr
    bad = _check_identity(hdr, page_hash, fingerprint, auth_key)
    if bad is not None:
        return bad
    payload = mv[PREFIX_BYTES + _PREFIX.unpack_from(mv)[1]:]
    bad = _check_payload(hdr, payload, expected, auth_key)
    return Decoded(ReadStatus.OK, payload, "") if bad is None else bad


def _parse_header(mv: memoryview) -> dict | Decoded:
    """``decode``'s first step: the header map of a well-framed object, or why not."""
    if mv.nbytes < PREFIX_BYTES:
        return _bad(f"object of {mv.nbytes} bytes is shorter than the {PREFIX_BYTES}-byte prefix")
    magic, hlen = _PREFIX.unpack_from(mv)
    if magic != MAGIC:
        return _bad(f"magic {bytes(magic)!r} != {MAGIC!r}")
    if hlen > _MAX_HEADER or PREFIX_BYTES + hlen > mv.nbytes:
        return _bad(f"header length {hlen} overruns the {mv.nbytes}-byte object")
    try:
        hdr = msgpack.unpackb(mv[PREFIX_BYTES:PREFIX_BYTES + hlen])
    except (ValueError, TypeError, msgpack.UnpackException) as e:
        return _bad(f"header does not parse: {e}")
    if not isinstance(hdr, dict):
        return _bad(f"header is a {type(hdr).__name__}, not a map")
    return hdr


HEAD_BYTES = 4096  # an object's first bytes that hold any usual header (~100 bytes plus a few per plane)


class Head(NamedTuple):
    """What an object's header declares, read before its payload (``parse_head``)."""

    fingerprint: str
    size: int  # bytes of the whole object: prefix, header and payload
    header_bytes: int  # prefix and header: where the payload starts


def head_end(head: Buffer) -> int:
    """How many first bytes of an object ``parse_head`` needs (prefix and header):
    ``PREFIX_BYTES`` until the prefix is there; at most ``PREFIX_BYTES + 1 MiB``."""
    mv = as_bytes_view(head)
    if mv.nbytes < PREFIX_BYTES:
        return PREFIX_BYTES
    return PREFIX_BYTES + min(_PREFIX.unpack_from(mv)[1], _MAX_HEADER)


def _head_map(head: Buffer) -> dict | Decoded:
    """The header map in an object's first bytes (at least ``head_end(head)``), or why not."""
    mv = as_bytes_view(head)
    if mv.nbytes < PREFIX_BYTES or bytes(mv[:4]) != MAGIC:
        return _bad(f"starts with {bytes(mv[:8])!r}, not a hicache object header ({MAGIC!r})")
    hlen = _PREFIX.unpack_from(mv)[1]
    if hlen > _MAX_HEADER or PREFIX_BYTES + hlen > mv.nbytes:
        return _bad(f"header of {hlen} bytes: longer than {_MAX_HEADER} or than the {mv.nbytes} bytes given")
    try:
        hdr = msgpack.unpackb(mv[PREFIX_BYTES:PREFIX_BYTES + hlen])
    except (ValueError, TypeError, msgpack.UnpackException) as e:
        return _bad(f"header does not parse: {e}")
    return hdr if isinstance(hdr, dict) else _bad(f"header is a {type(hdr).__name__}, not a map")


def is_hicache_object(head: Buffer) -> bool:
    """Whether an object's first bytes (at least ``head_end(head)``) are a hicache object's:
    the magic, then a header map naming a format version and a fingerprint (its other
    fields may be damaged). The one test ``hicache storage clear`` and ``fsck --repair``
    pass before they delete anything: another program's key or file is never deleted."""
    hdr = _head_map(head)
    return isinstance(hdr, dict) and "version" in hdr and "fingerprint" in hdr


def parse_head(head: Buffer) -> Head | Decoded:
    """What an object's first bytes (at least ``head_end(head)`` of them) declare: its
    fingerprint and its whole size; a CORRUPT ``Decoded`` naming why when they are no
    sound hicache object header. Reads no payload, so a reader checks an object's size
    before it allocates for it. Pure; never raises on bad data."""
    hdr = _head_map(head)
    if isinstance(hdr, Decoded):
        return hdr
    if not _hck_ok(hdr):
        return _bad("header checksum does not match its fields (damaged header)")
    fp, sizes, length = hdr.get("fingerprint"), hdr.get("plane_sizes"), hdr.get("length")
    if not isinstance(fp, str):
        return _bad(f"fingerprint {fp!r} is not a string")
    if not isinstance(sizes, list) or not all(type(x) is int and x >= 0 for x in sizes):
        return _bad(f"plane sizes {str(sizes)[:80]} are not a list of sizes")
    if type(length) is not int or length != sum(sizes):
        return _bad(f"header length {length!r} is not the plane sizes' sum {sum(sizes)}")
    hlen = PREFIX_BYTES + _PREFIX.unpack_from(as_bytes_view(head))[1]
    return Head(fp, hlen + length, hlen)


def _hck_ok(hdr: dict) -> bool:
    """The header checksum ``hck`` matches the other fields (or is absent: an older writer)."""
    if "hck" not in hdr:
        return True
    fields = {k: v for k, v in hdr.items() if k != "hck"}
    try:
        return hdr["hck"] == checksum(msgpack.packb(fields))
    except (TypeError, ValueError, OverflowError):
        return False


def _check_identity(hdr: dict, page_hash: bytes, fingerprint: str, auth_key: bytes = b"") -> Decoded | None:
    """``decode``'s second step: version, fields, header checksum, fingerprint and page
    hash; None when they hold."""
    version = hdr.get("version")
    if version in OLD_VERSIONS and auth_key:
        return _bad(f"format version {version} object: its MAC (keyed BLAKE2b) is not accepted with "
                    f"storage.auth_key since version {FORMAT_VERSION}; it is a miss and is stored again")
    if version != FORMAT_VERSION and version not in OLD_VERSIONS:
        return _bad(f"format version {version!r} != {FORMAT_VERSION}")
    extra = set(hdr) - _FIELDS
    if extra:
        return _bad(f"unknown header field(s) {sorted(map(repr, extra))[:4]} (damaged header)")
    if not _hck_ok(hdr):
        return _bad("header checksum does not match its fields (damaged header)")
    if hdr.get("fingerprint") != fingerprint:
        return Decoded(ReadStatus.FINGERPRINT, None,
                       f"fingerprint {hdr.get('fingerprint')!r} != ours {fingerprint!r}")
    if hdr.get("hash") != page_hash:
        return _bad(f"page hash {hdr.get('hash')!r} != key {bytes(page_hash)!r}")
    return None


def _check_payload(hdr: dict, payload: memoryview, expected: Sequence[int] | PlaneSizes | None,
                   auth_key: bytes) -> Decoded | None:
    """``decode``'s last step: plane sizes, length, checksum and MAC; None when they hold."""
    sizes = hdr.get("plane_sizes")
    if expected is None:
        if not isinstance(sizes, list) or not all(type(x) is int and x >= 0 for x in sizes):
            return _bad(f"plane sizes {sizes!r} are not a list of sizes")
        total = sum(sizes)
    else:
        want = plane_sizes(expected)
        if sizes != want.sizes:
            return _bad(f"plane sizes {sizes!r} != expected {want.sizes!r}")
        total = want.total
    length = hdr.get("length")
    if length != payload.nbytes or length != total:
        return _bad(f"payload length {payload.nbytes} / header length {length!r} / "
                    f"plane sizes sum {total} disagree")
    ck = checksum(payload)
    if hdr.get("checksum") != ck:
        return _bad(f"checksum {hdr.get('checksum')!r} != computed {ck}")
    if auth_key:
        mac = hdr.get("mac")
        if not isinstance(mac, bytes):
            return _bad("no MAC: written without storage.auth_key, or forged")
        fields = {k: v for k, v in hdr.items() if k not in ("mac", "hck")}
        if not hmac.compare_digest(mac, _mac(auth_key, msgpack.packb(fields), payload)):
            return _bad("MAC does not verify: forged, or written with another storage.auth_key")
    return None
