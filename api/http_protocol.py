"""uvicorn's h11 protocol with guards for connections that send no request.

uvicorn sets no timer before a request head is complete, and ``limit_concurrency``
counts connections: clients sending their headers a byte at a time (slowloris), or
nothing, could hold ``rest_max_connections`` connections and turn every other
request, ``/healthz`` included, into a 503. ``HeadGuardedH11`` adds, per server:
- a deadline for each request head (``service.rest_header_timeout_s``) from the
  connection's start or the previous response's end; past it the connection closes;
- at most ``max_waiting`` connections waiting for a head; a new one past that closes
  the longest-waiting, so waiting connections never fill ``limit_concurrency``.
A head is at most ``MAX_HEAD_BYTES`` (a longer one is answered 400).
"""
from __future__ import annotations

import asyncio
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

MAX_HEAD_BYTES = 16 << 10  # request line + headers (h11's own default, set here so it is ours)


class _Waiting:
    """The connections of one server that wait for a request head, oldest first."""

    def __init__(self, limit: int):
        self.limit = limit
        self.conns: dict[HeadGuardedH11, None] = {}  # insertion-ordered: the first waited longest


class HeadGuardedH11(H11Protocol):
    """``H11Protocol`` with a request-head deadline and a cap on connections waiting for one.
    Build the class with ``head_guarded``; uvicorn makes one instance per connection."""

    head_timeout_s: float = 10.0
    max_waiting: int = 32

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        state = self.server_state
        # One registry per server (its ServerState); made by its first connection.
        if not hasattr(state, "hicache_waiting"):
            state.hicache_waiting = _Waiting(self.max_waiting)
        self._waiting: _Waiting = state.hicache_waiting
        self._head_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:  # type: ignore[override]
        super().connection_made(transport)  # type: ignore[arg-type]
        self._await_head()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE:  # the head is in (or the connection failed)
            self._head_in()

    def on_response_complete(self) -> None:
        super().on_response_complete()  # may start a pipelined request at once
        if not self.transport.is_closing() and self.conn.their_state is h11.IDLE:
            self._await_head()

    def connection_lost(self, exc: Exception | None) -> None:
        self._head_in()
        super().connection_lost(exc)

    def _await_head(self) -> None:
        if self._head_timer is not None:
            return
        self._head_timer = self.loop.call_later(self.head_timeout_s, self._close)
        waiting = self._waiting.conns
        waiting[self] = None
        while len(waiting) > self._waiting.limit:
            next(iter(waiting))._close()  # removes itself

    def _head_in(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None
        self._waiting.conns.pop(self, None)

    def _close(self) -> None:
        self._head_in()
        if not self.transport.is_closing():
            self.transport.close()


def head_guarded(head_timeout_s: float, max_waiting: int) -> type[HeadGuardedH11]:
    """A ``HeadGuardedH11`` class with these limits, for ``uvicorn.Config(http=...)``."""
    return type("HeadGuardedH11", (HeadGuardedH11,),
                {"head_timeout_s": head_timeout_s, "max_waiting": max_waiting})
