"""Reading a big ``/v1/lookup`` token list without holding the REST loop.

FastAPI decodes a JSON body with ``json.loads`` and validates it with
pydantic on the event loop, holding the GIL throughout: ~0.5 s for a
1M-token list, during which ``/healthz`` cannot answer. ``split_tokens``
takes the token list out of the body instead, with numpy's text parser
(which releases the GIL), on a worker thread (``BodyGate`` calls it); the
rest of the body, now tiny (``"tokens": []``), goes through FastAPI's usual
validation, and the route reads the tokens back with ``parsed_tokens``.

Only a body whose ``tokens`` array holds nothing but digits, commas and
whitespace takes this path, and only when its numbers are all valid
(``0 <= t < 2**32``, at most ``MAX_LOOKUP_TOKENS``); anything else is left
untouched for FastAPI to parse and report as before.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np
from starlette.types import Scope

from hicache.api.models import MAX_LOOKUP_TOKENS

SCOPE_KEY = "hicache.lookup_tokens"
MIN_FAST_BYTES = 64 << 10  # smaller bodies parse in well under a millisecond: not worth a thread hop
_NOT_NUMBERS = b"0123456789,\t\n\r "


class SplitBody(NamedTuple):
    body: bytes  # the request body with its token list emptied
    tokens: list[int]


def split_tokens(body: bytes) -> SplitBody | None:
    """The body with ``"tokens": [...]`` emptied, and the tokens; None to parse it as usual. Pure."""
    key = body.find(b'"tokens"')
    start = body.find(b"[", key) if key >= 0 else -1
    end = body.find(b"]", start) if start >= 0 else -1
    if end < 0 or body.count(b"[") != 1:  # the token list must be the body's only array
        return None
    text = body[start + 1:end]
    if text.translate(None, _NOT_NUMBERS):
        return None  # signs, decimals, strings, NaN...: FastAPI's validation reports them
    compact = text.translate(None, b"\t\n\r ")
    if b",," in compact or compact[:1] == b"," or compact[-1:] == b",":
        return None  # an empty item: the usual path names it
    n = compact.count(b",") + 1 if compact else 0
    if n > MAX_LOOKUP_TOKENS:
        return None
    try:
        arr = np.fromstring(text, dtype=np.int64, sep=",") if n else np.zeros(0, np.int64)  # releases the GIL
    except ValueError:  # a number past int64
        return None
    if len(arr) != n or (n and (int(arr.max()) >= 2**32 or int(arr.min()) < 0)):
        return None  # whitespace inside a number ("1 2"), or an out-of-range value: the usual path names it
    return SplitBody(body[:start + 1] + body[end:], arr.tolist())


def parsed_tokens(scope: Scope) -> list[int] | None:
    """The tokens ``BodyGate`` took out of this request's body, or None when it left the body whole."""
    return scope.get(SCOPE_KEY)
