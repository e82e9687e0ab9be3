"""A hand-driven connection to the engine socket, for tests that send malformed,
unusual or half-sent frames (tests/service, tests/hardening)."""
from __future__ import annotations

import os
import socket
from typing import Any

import msgpack

from hicache.core.layout import KVLayout
from hicache.client.protocol import HEADER, hello_request


class RawConn:
    """A hand-driven connection for sending malformed or unusual frames."""

    def __init__(self, sock_path: str, timeout: float = 10.0):
        self.s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.s.settimeout(timeout)
        self.s.connect(sock_path)

    def send_raw(self, data: bytes) -> None:
        self.s.sendall(data)

    def send(self, obj: Any) -> None:
        body = msgpack.packb(obj, use_bin_type=True)
        self.s.sendall(HEADER.pack(len(body)) + body)

    def recv(self) -> dict | None:
        """The next reply frame, or None once the server has closed the connection."""
        head = self._exact(4)
        if head is None:
            return None
        body = self._exact(HEADER.unpack(head)[0])
        assert body is not None, "server closed mid-frame"
        return msgpack.unpackb(body, raw=False)

    def call(self, obj: Any) -> dict | None:
        self.send(obj)
        return self.recv()

    def hello(self, layout: KVLayout) -> dict:
        rep = self.call(hello_request(layout.to_dict(), layout.fingerprint(), os.getpid()))
        assert rep is not None and rep["ok"], rep
        return rep

    def closed(self) -> bool:
        """True once the server has hung up (reads EOF)."""
        try:
            return self.s.recv(1) == b""
        except ConnectionResetError:
            return True

    def _exact(self, n: int) -> bytes | None:
        buf = b""
        while len(buf) < n:
            try:
                chunk = self.s.recv(n - len(buf))
            except ConnectionResetError:
                chunk = b""
            if not chunk:
                return None
            buf += chunk
        return buf

    def close(self) -> None:
        self.s.close()

    def __enter__(self) -> "RawConn":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
