"""REST input guards: a request-body size limit enforced before parsing, and
validation errors that never echo the input.

``BodyLimit`` is plain ASGI middleware: a ``Content-Length`` above the limit
is answered 413 without reading the body, and a chunked body is counted as
it streams and cut off with 413 once it passes the limit, so a 50 MB body
never reaches the JSON parser (``service.max_request_bytes``).

``BodyGate`` bounds what is buffered and parsed at once: at most
``service.max_body_requests`` requests with a large body (64 KiB or more, or
chunked) are admitted together
(the rest are answered 503 with ``Retry-After`` before a byte of their body
is read), an admitted body must arrive within ``service.body_read_timeout_s``
(else 408, and its slot is free again: two idle connections cannot hold the
gate shut), and a ``/v1/lookup`` body holding more JSON items than a lookup
may carry is refused from a count of its commas, before the JSON parser and
validation spend a second of the event loop on it (which is what stalled
``/healthz`` for seconds under ten 8 MiB bodies). A big token list that is
valid is read off the loop (``hicache.api.lookup_fast``).

``validation_error`` replaces FastAPI's default 422 handler. The default one
echoes each invalid input (three times for a long token list) and fails with
a 500 when the input cannot be encoded back (``NaN``, ``Infinity``, a lone
surrogate). Ours reports each error's location, type and message only.
"""
from __future__ import annotations

import asyncio
from typing import Any, Sequence

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from hicache.api.lookup_fast import MIN_FAST_BYTES, SCOPE_KEY, split_tokens
from hicache.core.errors import IntegrityError

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

    ``max_items``: per path, the most JSON items (commas + 1) a body may hold.
    ``read_timeout_s``: the time an admitted request has to deliver its whole body.
    """

    def __init__(self, app: ASGIApp, max_bodies: int, max_bytes: int, max_items: dict[str, int] | None = None,
                 read_timeout_s: float = 10.0):
        self.app = app
        self.max_bodies = max_bodies
        self.max_bytes = max_bytes
        self.max_items = max_items or {}
        self.read_timeout_s = read_timeout_s
        self.in_flight = 0  # requests with a body admitted and not yet answered
        self.admitted = self.refused = self.timed_out = 0  # counters, for tests and logs

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not _big_body(scope):
            await self.app(scope, receive, send)
            return
        if self.in_flight >= self.max_bodies:
            self.refused += 1
            await _reject(send, 503, f"{self.in_flight} request bodies are being read already "
                          f"(service.max_body_requests={self.max_bodies}); retry shortly",
                          [(b"retry-after", b"1")])
            return
        self.in_flight += 1
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
            self.in_flight -= 1

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
