"""REST input guards, enforced before FastAPI parses a body.

- ``BodyLimit`` (ASGI middleware): a body over ``service.max_request_bytes`` is
  answered 413, from its ``Content-Length`` or while a chunked body streams.
- ``BodyGate``: at most ``service.max_body_requests`` large bodies (64 KiB or more,
  or chunked) are read at once, each within ``service.body_read_timeout_s`` (else
  408). Others wait in a short queue, then get 503; a freed slot goes to the client
  holding the fewest (``BodyGate``). A ``/v1/lookup`` body with more items than a
  lookup may carry is refused from a count of its commas; a big valid token list is
  parsed off the event loop (``split_tokens``; the route reads ``parsed_tokens``).
- ``validation_error`` replaces FastAPI's 422 handler: it reports each error's
  location, type and message, never the input (which may be huge or not encodable).
"""
from __future__ import annotations

import asyncio
from typing import Any, NamedTuple, Sequence

import numpy as np
from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from hicache.api.models import MAX_LOOKUP_TOKENS
from hicache.core.errors import IntegrityError


# Only a body whose ``tokens`` array holds nothing but digits, commas and whitespace takes
# the fast path, and only when its numbers are all valid (0 <= t < 2**32, at most
# MAX_LOOKUP_TOKENS); anything else is left for FastAPI to parse and report.
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


MAX_ERRORS = 10  # errors listed in one 422


class BodyLimit:
    def __init__(self, app: ASGIApp, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        for name, value in scope.get("headers", ()):
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    await self._reject(send, 400, "Content-Length is not a number")
                    return
                if declared > self.max_bytes:
                    await self._too_large(send, declared)
                    return
        seen = 0
        started = False

        async def counted_receive() -> Message:
            nonlocal seen
            msg = await receive()
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                if seen > self.max_bytes:
                    raise _TooLarge(seen)
            return msg

        async def tracked_send(msg: Message) -> None:
            nonlocal started
            if msg["type"] == "http.response.start":
                started = True
            await send(msg)

        try:
            await self.app(scope, counted_receive, tracked_send)
        except _TooLarge as e:
            if not started:
                await self._too_large(send, e.seen)

    async def _too_large(self, send: Send, n: int) -> None:
        await self._reject(send, 413, f"request body of {n}+ bytes exceeds the limit of {self.max_bytes} "
                           "bytes (service.max_request_bytes); send a shorter prompt or page-hash list")

    @staticmethod
    async def _reject(send: Send, status: int, detail: str) -> None:
        await _reject(send, status, detail)


class BodyGate:
    """Admission of requests with a body (see the module docstring). One event loop: no lock.

    Past the slots, requests wait in a queue (``max_waiting``) for up to twice the read
    timeout (a slot held by a body that never comes frees within one), then get 503 with
    ``Retry-After``. A freed slot goes to the waiter whose client (its address) holds
    the fewest slots, first come first served among equals: a client that reopens its
    connections after each 408 queues behind the others instead of holding every slot.

    ``max_items``: per path, the most JSON items (commas + 1) a body may hold.
    ``read_timeout_s``: the time an admitted request has to deliver its whole body; a
    request waits in the queue for a slot twice as long at most.
    ``max_waiting``: requests that may wait for a slot (default 4 per slot; 0: none wait).
    """

    def __init__(self, app: ASGIApp, max_bodies: int, max_bytes: int, max_items: dict[str, int] | None = None,
                 read_timeout_s: float = 10.0, max_waiting: int | None = None):
        self.app = app
        self.max_bodies = max_bodies
        self.max_bytes = max_bytes
        self.max_items = max_items or {}
        self.read_timeout_s = read_timeout_s
        self.max_waiting = 4 * max_bodies if max_waiting is None else max_waiting
        self.in_flight = 0  # requests with a body admitted and not yet answered
        self.admitted = self.refused = self.timed_out = 0  # counters, for tests and logs
        self._held: dict[str, int] = {}  # client address -> slots it holds
        self._waiting: list[tuple[str, asyncio.Future]] = []  # in arrival order

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not _big_body(scope):
            await self.app(scope, receive, send)
            return
        client = str((scope.get("client") or ("",))[0])
        if not await self._slot(client):
            self.refused += 1
            await _reject(send, 503, f"{self.in_flight} request bodies are being read and {len(self._waiting)} "
                          f"wait (service.max_body_requests={self.max_bodies}); retry shortly",
                          [(b"retry-after", b"1")])
            return
        self.admitted += 1
        started = False

        async def tracked_send(msg: Message) -> None:
            nonlocal started
            started = started or msg["type"] == "http.response.start"
            await send(msg)
        try:
            await self._admitted(scope, _timed(receive, self.read_timeout_s), tracked_send)
        except _ReadTimeout:
            self.timed_out += 1
            if not started:
                await _reject(send, 408, f"request body not received within {self.read_timeout_s:g} s "
                              "(service.body_read_timeout_s); send the body with its headers")
        finally:
            self._release(client)

    async def _slot(self, client: str) -> bool:
        """Take a slot for ``client``, waiting in the queue up to ``2 * read_timeout_s``; False: none."""
        if self.in_flight < self.max_bodies and not self._waiting:
            self._take(client)
            return True
        if len(self._waiting) >= self.max_waiting:
            return False
        entry = (client, asyncio.get_running_loop().create_future())
        self._waiting.append(entry)
        fut = entry[1]
        try:
            await asyncio.wait({fut}, timeout=2 * self.read_timeout_s)
        except asyncio.CancelledError:  # the client left; a slot handed over meanwhile goes on
            if fut.done() and not fut.cancelled():
                self._release(client)
            raise
        finally:
            if entry in self._waiting:
                self._waiting.remove(entry)
            if not fut.done():
                fut.cancel()
        return not fut.cancelled()

    def _take(self, client: str) -> None:
        self.in_flight += 1
        self._held[client] = self._held.get(client, 0) + 1

    def _release(self, client: str) -> None:
        """Free ``client``'s slot and hand free slots to the waiters whose clients hold the fewest."""
        self.in_flight -= 1
        self._held[client] -= 1
        if not self._held[client]:
            del self._held[client]
        while self._waiting and self.in_flight < self.max_bodies:
            i = min(range(len(self._waiting)), key=lambda j: (self._held.get(self._waiting[j][0], 0), j))
            c, fut = self._waiting.pop(i)
            if not fut.done():
                self._take(c)
                fut.set_result(None)

    async def _admitted(self, scope: Scope, receive: Receive, send: Send) -> None:
        limit = self.max_items.get(scope.get("path", ""))
        if limit is not None:
            body = await _read_all(receive)
            items = body.count(b",") + 1
            if items > limit:
                await _reject(send, 413, f"request body holds {items}+ JSON items; {scope['path']} takes at "
                              f"most {limit} (tokens or page hashes); split the request")
                return
            if len(body) >= MIN_FAST_BYTES:  # take a big token list out, off the loop
                split = await asyncio.to_thread(split_tokens, body)
                if split is not None:
                    body, scope = split.body, {**scope, SCOPE_KEY: split.tokens}
            receive = _replay(body)
        await self.app(scope, receive, send)

    def check_integrity(self) -> None:
        if not 0 <= self.in_flight <= self.max_bodies:
            raise IntegrityError(f"BodyGate: {self.in_flight} bodies in flight, limit {self.max_bodies}")
        if sum(self._held.values()) != self.in_flight or len(self._waiting) > self.max_waiting:
            raise IntegrityError(f"BodyGate: clients hold {self._held}, {self.in_flight} in flight; "
                                 f"{len(self._waiting)} waiting, limit {self.max_waiting}")
        if self.admitted < self.in_flight:
            raise IntegrityError(f"BodyGate: {self.in_flight} in flight but only {self.admitted} admitted")


def _big_body(scope: Scope) -> bool:
    """A body of ``MIN_FAST_BYTES`` or more, or of unknown length (chunked). Smaller ones
    (every router's lookup of a real prompt) parse in well under a millisecond: not gated."""
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            return value.strip().isdigit() and int(value) >= MIN_FAST_BYTES
        if name == b"transfer-encoding":
            return True
    return False


async def _read_all(receive: Receive) -> bytes:
    parts = []
    while True:
        msg = await receive()
        if msg["type"] != "http.request":
            break
        parts.append(msg.get("body", b""))
        if not msg.get("more_body", False):
            break
    return b"".join(parts)


def _timed(receive: Receive, timeout_s: float) -> Receive:
    """``receive`` that raises ``_ReadTimeout`` once the body has not all arrived within
    ``timeout_s`` of admission (a deadline, so a trickle of bytes does not extend it)."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    done = False

    async def timed() -> Message:
        nonlocal done
        if done:  # the body is in: waiting for a disconnect is not bounded
            return await receive()
        left = deadline - asyncio.get_running_loop().time()
        try:
            msg = await asyncio.wait_for(receive(), max(left, 0.0))
        except asyncio.TimeoutError:
            raise _ReadTimeout() from None
        done = msg["type"] != "http.request" or not msg.get("more_body", False)
        return msg
    return timed


def _replay(body: bytes) -> Receive:
    sent = False

    async def receive() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return {"type": "http.disconnect"}
    return receive


async def _reject(send: Send, status: int, detail: str, headers: Sequence[tuple[bytes, bytes]] = ()) -> None:
    resp = JSONResponse({"detail": detail}, status_code=status, headers={"Connection": "close"})
    await send({"type": "http.response.start", "status": resp.status_code, "headers": [*resp.raw_headers, *headers]})
    await send({"type": "http.response.body", "body": resp.body})


class _TooLarge(BaseException):
    """Not an ``Exception``: FastAPI turns any ``Exception`` raised while reading
    a body into a 400, so this must pass through it to ``BodyLimit``."""

    def __init__(self, seen: int):
        self.seen = seen


class _ReadTimeout(BaseException):
    """Not an ``Exception``, for the reason ``_TooLarge`` is not."""


async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    errors = exc.errors()
    detail: list[dict[str, Any]] = [
        {"loc": [x if isinstance(x, int) else _safe(str(x), 64) for x in e.get("loc", ())],
         "type": _safe(str(e.get("type", "")), 64), "msg": _safe(str(e.get("msg", "")), 200)}
        for e in errors[:MAX_ERRORS]]
    if len(errors) > MAX_ERRORS:
        detail.append({"loc": [], "type": "truncated", "msg": f"{len(errors) - MAX_ERRORS} more error(s)"})
    return JSONResponse({"detail": detail}, status_code=422)


def _safe(s: str, limit: int) -> str:
    """Encodable text of bounded length (a lone surrogate becomes ``\\udXXX``)."""
    s = s.encode("utf-8", "backslashreplace").decode("utf-8")
    return s if len(s) <= limit else s[:limit] + "..."
