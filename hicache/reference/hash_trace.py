"""Hash-block traces (Mooncake's FAST'25 release and traces like it), streamed.

One JSON object per line::

    {"timestamp": 27482, "input_length": 6955, "output_length": 52, "hash_ids": [46, 47, 48, ...]}

``timestamp`` is milliseconds from the start; ``hash_ids`` name the request's
prompt blocks of ``block_tokens`` tokens each (512 in Mooncake's release):
equal ids mean an equal block *and* an equal prefix before it (the ids are
prefix hashes). The last block is partial: it holds ``input_length -
block_tokens * (len(hash_ids) - 1)`` tokens. ``output_length`` is what the
model generated; its KV is not part of later prompts' ids, so it is not
replayed.
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Iterator, Literal, NamedTuple

import numpy as np

from hicache.reference.trace_format import bounded_lines, loads, open_regular
from hicache.core.errors import TraceError

DEFAULT_BLOCK_TOKENS = 512
HASH_FIELDS = {"timestamp", "input_length", "output_length", "hash_ids"}
TraceKind = Literal["hicache", "hash_blocks"]
# Pages carry (id low, id high, page index) in their first three tokens.
MIN_PAGE_TOKENS = 3
# The most prompt tokens one line may ask for, checked before its tokens are built
# (``block_tokens_of`` peaks at 12 bytes a token): 16M tokens, ~200 MB.
MAX_REQUEST_TOKENS = 1 << 24


class HashBlockRequest(NamedTuple):
    """One request of a hash-block trace (a line). ``tokens`` builds its prompt on demand."""

    index: int  # 0-based request number (line order)
    arrival: float  # seconds from the start of the trace
    input_length: int  # prompt tokens
    output_length: int  # generated tokens (not replayed: later prompts carry their own ids)
    hash_ids: tuple[int, ...]  # prompt blocks, in order

    @property
    def rid(self) -> str:
        return f"r{self.index}"

    def tokens(self, block_tokens: int, page_size: int) -> np.ndarray:
        """The prompt's token ids (uint32, a fresh array of ``input_length`` ids)."""
        return block_tokens_of(self.hash_ids, block_tokens, page_size).reshape(-1)[:self.input_length]


def block_tokens_of(hash_ids, block_tokens: int, page_size: int) -> np.ndarray:
    """The token blocks of ``hash_ids``: a ``[len(hash_ids), block_tokens]`` uint32 array.

    Token ``k`` of block ``h`` is ``(h * block_tokens + k) mod 2**32``, except the
    first three tokens of each page, which are ``h mod 2**32``, ``h >> 32`` and the
    page's index in the block: two different ids never give an equal page,
    whatever their size. Pure."""
    if page_size < MIN_PAGE_TOKENS or block_tokens % page_size:
        raise TraceError(f"block_tokens={block_tokens} must be a whole number of pages of {page_size} "
                         f"tokens, and pages at least {MIN_PAGE_TOKENS} tokens")
    ids = np.asarray(hash_ids, dtype=np.uint64)
    out = ((ids[:, None] * np.uint64(block_tokens) + np.arange(block_tokens, dtype=np.uint64)[None, :])
           & np.uint64(0xFFFFFFFF)).astype(np.uint32)
    out[:, 0::page_size] = (ids & np.uint64(0xFFFFFFFF)).astype(np.uint32)[:, None]
    out[:, 1::page_size] = (ids >> np.uint64(32)).astype(np.uint32)[:, None]
    out[:, 2::page_size] = np.arange(block_tokens // page_size, dtype=np.uint32)[None, :]
    return out


def detect_format(path: str | Path) -> TraceKind:
    """``"hicache"`` (a header line ``{"hicache_trace": ...}``) or ``"hash_blocks"``
    (lines with ``hash_ids``), from the first non-empty line. ``TraceError`` otherwise."""
    try:
        with open_regular(path) as f:  # a FIFO or device is refused before any read
            for _, raw in bounded_lines(f, path):
                if raw.strip():
                    break
            else:
                raise TraceError(f"trace {str(path)!r} is empty")
    except FileNotFoundError:
        raise TraceError(f"trace {str(path)!r} does not exist") from None
    except IsADirectoryError:
        raise TraceError(f"trace {str(path)!r} is a directory; give a JSONL trace file") from None
    try:
        obj = json.loads(raw.decode("utf-8"))
    except (ValueError, RecursionError):  # not UTF-8, not JSON, NaN: the reader names the problem
        return "hicache" if b"hash_ids" not in raw else "hash_blocks"
    if isinstance(obj, dict) and "hicache_trace" in obj:
        return "hicache"
    if isinstance(obj, dict) and "hash_ids" in obj:
        return "hash_blocks"
    fields = sorted(obj) if isinstance(obj, dict) else type(obj).__name__
    raise TraceError(f"{path}: unknown trace format (first line has {fields}); expected a hicache trace "
                     f'header {{"hicache_trace": 1, ...}} or hash-block lines with {sorted(HASH_FIELDS)}')


def iter_hash_trace(path: str | Path, block_tokens: int = DEFAULT_BLOCK_TOKENS, *, page_size: int = 1,
                    max_pages: int | None = None, limit: str = "") -> Iterator[HashBlockRequest]:
    """Validated requests, one line at a time (a generator: memory stays one line).

    Raises ``TraceError`` naming the line and field: unknown or missing fields,
    timestamps that go back, an ``input_length`` its blocks cannot hold, a line
    over ``MAX_LINE_BYTES``, or more than ``max_pages`` pages of ``page_size``
    tokens (``limit`` says what bounds them) or ``MAX_REQUEST_TOKENS``: checked
    before the request's tokens are built.

    Every hash id becomes a fixed, deterministic block of token ids
    (``block_tokens_of``): equal ids give equal tokens, different ids give pages
    that differ in their first tokens, so the radix tree shares exactly the pages
    the trace shares. The reader yields one request at a time and builds a
    request's tokens only when asked (``HashBlockRequest.tokens``), so a
    145M-token trace never sits in memory.
    """
    if block_tokens < 1:
        raise TraceError(f"block_tokens={block_tokens}: a hash id stands for at least one token (Mooncake: 512)")
    cap = MAX_REQUEST_TOKENS if max_pages is None else min(MAX_REQUEST_TOKENS, max_pages * page_size)
    why = limit if max_pages is not None and cap < MAX_REQUEST_TOKENS else "hash_trace.MAX_REQUEST_TOKENS"
    last = 0
    index = 0
    try:
        f = open_regular(path)
    except FileNotFoundError:
        raise TraceError(f"trace {str(path)!r} does not exist") from None
    with f:
        for no, raw in bounded_lines(f, path):
            if not raw.strip():
                continue
            where = f"{path}:{no}"
            req = _request(loads(raw, where), index, where, block_tokens)
            if req.input_length > cap:
                pages = -(-req.input_length // page_size)
                raise TraceError(f"{where}: input_length {req.input_length:,} tokens ({pages:,} pages of "
                                 f"{page_size}) is over the limit of {cap // page_size:,} pages ({why})")
            if req.arrival < last:
                raise TraceError(f"{where}: timestamp {req.arrival * 1e3:g} is before the previous line's "
                                 f"{last * 1e3:g}; sort the trace by timestamp")
            last = req.arrival
            index += 1
            yield req


def _request(obj: object, index: int, where: str, block_tokens: int) -> HashBlockRequest:
    if not isinstance(obj, dict):
        raise TraceError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    if set(obj) != HASH_FIELDS:
        missing, unknown = sorted(HASH_FIELDS - set(obj)), sorted(set(obj) - HASH_FIELDS)
        raise TraceError(f"{where}: a hash-block line has exactly {sorted(HASH_FIELDS)}; "
                         f"missing {missing}, unknown {unknown}")
    ts, n, out, ids = obj["timestamp"], obj["input_length"], obj["output_length"], obj["hash_ids"]
    for name, v in (("timestamp", ts), ("input_length", n), ("output_length", out)):
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or v < 0:
            raise TraceError(f"{where}, field {name!r}: expected a finite number >= 0, got {v!r}")
    if not isinstance(n, int) or n < 1:
        raise TraceError(f"{where}, field 'input_length': expected an integer >= 1, got {n!r}")
    if not isinstance(ids, list) or not ids or not all(
            isinstance(h, int) and not isinstance(h, bool) and 0 <= h < 2**64 for h in ids):
        raise TraceError(f"{where}, field 'hash_ids': expected a non-empty list of integers in [0, 2**64)")
    if not (len(ids) - 1) * block_tokens < n <= len(ids) * block_tokens:
        raise TraceError(f"{where}: input_length {n} does not fit {len(ids)} blocks of {block_tokens} tokens "
                         f"(the last block partial: ({len(ids) - 1} * {block_tokens}, {len(ids) * block_tokens}]); "
                         "is --block-tokens right?")
    return HashBlockRequest(index, ts / 1e3, n, int(out), tuple(ids))
