"""Zero-copy SET of ``header + payload`` through redis-py.

A page object is a small header followed by a large payload. Joining them
costs a full copy of the payload per put (measured: ~25% of loopback SET
throughput on a 2-core box). Instead ``FramedValue(header, payload)`` is
passed as the SET value and ``FramedPacker`` writes it as ONE RESP bulk string
made of two buffers: the header is coalesced with the command prefix and the
payload goes to ``sendall`` as its own memoryview, exactly as redis-py already
sends any large argument. Every other command is packed by redis-py's own
packer (hiredis's when installed: fast for small commands, and no command
but the framed SET carries a large value). The connection classes plug the packer in through
redis-py's public ``command_packer`` argument, so pools, retries, pipelines
and cluster routing are all stock redis-py.

Replies: ``DirectReplyParser`` (redis-py's public ``parser_class`` argument)
receives a GET's value straight from the socket into the buffer it returns.
redis-py's parsers copy every reply twice more on the way (hiredis: socket
buffer -> reader buffer -> ``bytes``; the pure-Python parser: ``recv`` ->
``BytesIO`` -> ``bytes``); here a large value is copied once, by the kernel.
The backend asks for it per command (``NEVER_DECODE``, i.e. ``read_response(
disable_decoding=True)``): only those bulk replies of at least ``_DIRECT_MIN``
bytes come back as a ``bytearray``; every other reply has redis-py's usual types. It speaks RESP2,
which the backends ask for (``protocol=2``; redis-py 8 defaults to RESP3,
whose push messages an L3 of GET/SET does not use); a URL or caller that sets
``protocol=3`` gets redis-py's own parser.

``FramedConnection.read_into(sink)`` reads one array reply (an MGET's) with each value
received straight into buffers the ``ValueSink`` names (a page's header buffer and its
L2 destination) and judged by the sink as soon as it has landed.
"""
from __future__ import annotations

import socket
import ssl
from typing import Any, Callable, Iterator, Protocol, Sequence

from redis._parsers import BaseParser
from redis.connection import Connection, Encoder, HiredisRespSerializer, PythonRespSerializer, SSLConnection
from redis.exceptions import ConnectionError, InvalidResponse
from redis.utils import HIREDIS_AVAILABLE, SENTINEL as _SENTINEL

# redis-py's cutoff above which an argument is sent as its own buffer.
_BUFFER_CUTOFF = 6000
# Bytes asked of one recv() while reading reply lines and small values. Small,
# so that little of a large value lands here (and is copied again) before its
# own buffer is allocated; a pipeline of small replies still takes few calls.
_LINE_READ = 16 << 10
# A bulk reply asked for undecoded lands in its own ``bytearray`` from this size on
# (a page's value); a smaller one is ``bytes``, as redis-py returns it (redis-py 8.2
# asks INFO undecoded too, and its INFO parser decodes ``bytes`` only).
_DIRECT_MIN = 64 << 10
_CRLF = b"\r\n"
_OK = b"+OK\r\n"
_CLOSED = "Connection closed by server."


class FramedValue:
    """A bulk-string argument sent as ``header`` then ``payload`` with no join.

    ``header`` may be a callable that builds it: it is then called when the
    command is packed, which a framed connection does just before sending it
    (``FramedConnection.pack_commands``), so the header's checksum pass over
    the payload leaves it in cache for the send that follows.
    """

    __slots__ = ("header", "payload")

    def __init__(self, header: bytes | Callable[[], bytes], payload: memoryview):
        self.header = header
        self.payload = payload  # flat byte view; only read while the command is sent


class FramedPacker:
    """redis-py command packer that understands ``FramedValue`` arguments."""

    def __init__(self) -> None:
        self._encode = Encoder("utf-8", "strict", False).encode
        self._plain = (HiredisRespSerializer() if HIREDIS_AVAILABLE
                       else PythonRespSerializer(_BUFFER_CUTOFF, self._encode))

    def pack(self, *args):
        if len(args) == 3 and type(args[2]) is FramedValue and type(args[1]) is bytes and args[0] == "SET":
            # The put's one command, packed in one step (the same bytes as the loop below).
            key, v = args[1], args[2]
            hdr = v.header if type(v.header) is bytes else v.header()
            return [b"*3\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n%s" % (len(key), key, len(hdr) + v.payload.nbytes, hdr),
                    v.payload, b"\r\n"]
        if not any(type(a) is FramedValue for a in args):
            return self._plain.pack(*args)
        out: list[bytes | memoryview] = []
        buff = b"*%d\r\n" % len(args)
        for a in args:
            if type(a) is FramedValue:
                hdr = a.header if type(a.header) is bytes else a.header()
                total = len(hdr) + a.payload.nbytes
                out.append(b"%s$%d\r\n%s" % (buff, total, hdr))
                out.append(a.payload)  # memoryview: pack_commands keeps it a separate chunk
                buff = b"\r\n"
            else:
                v = self._encode(a)
                buff = b"%s$%d\r\n%s\r\n" % (buff, len(v), v)
        out.append(buff)
        return out


class ValueSink(Protocol):
    """Where ``FramedConnection.read_into`` puts the values of one array reply (an MGET's)."""

    def buffers(self, i: int, n: int) -> Sequence[memoryview]:
        """Buffers to receive value ``i`` (``n`` bytes) into, in order; they may hold less."""

    def landed(self, i: int, n: int | None | BaseException) -> Any:
        """Value ``i`` is in its buffers (``n``: its length), nil (None), or an error
        reply; what this returns is the reply's element ``i``."""


class DirectReplyParser(BaseParser):
    """RESP2 reply parser; undecoded bulk replies are received into their own
    ``bytearray`` with no intermediate copy (see the module docstring).

    Follows redis-py's parser contract: socket timeouts propagate as
    ``socket.timeout`` (the connection turns them into ``TimeoutError`` and
    disconnects), a closed socket raises ``ConnectionError``, an error reply
    is returned as its exception (raised when it is a ``ConnectionError``).
    """

    def __init__(self, socket_read_size: int):
        self._read_size = max(64, min(socket_read_size, _LINE_READ))
        self._sock: socket.socket | None = None
        self._timeout: float | None = None
        self.encoder = None
        self._buf = bytearray(self._read_size)  # pending bytes are _buf[_start:_end]
        self._start = self._end = 0
        self.sink: ValueSink | None = None  # set by FramedConnection.read_into for one array reply

    def on_connect(self, connection) -> None:
        self._sock = connection._sock
        self._timeout = connection.socket_timeout
        self.encoder = connection.encoder
        self._start = self._end = 0

    def on_disconnect(self) -> None:
        self._sock = None
        self._start = self._end = 0

    def can_read(self, timeout: float = 0) -> bool:
        if self._start < self._end:
            return True
        if self._sock is None:
            return False
        try:
            self._recv(timeout)
        except (socket.timeout, BlockingIOError, InterruptedError, ssl.SSLWantReadError, ssl.SSLWantWriteError):
            return False  # nothing to read now (a TLS socket may also want a write first)
        return True

    def _recv(self, timeout: object = _SENTINEL) -> None:
        """Read what the socket has (at least one byte) after the pending bytes."""
        sock = self._sock
        if sock is None:
            raise ConnectionError(_CLOSED)
        buf = self._buf
        if self._start == self._end:
            self._start = self._end = 0
        elif len(buf) - self._end < self._read_size:
            n = self._end - self._start
            if n * 2 > len(buf):  # a long line: grow (copies only its own bytes)
                self._buf = buf = buf[self._start:self._end] + bytearray(max(len(buf), self._read_size))
            else:
                buf[:n] = buf[self._start:self._end]
            self._start, self._end = 0, n
        custom = timeout is not _SENTINEL
        if custom:
            sock.settimeout(timeout)
        try:
            with memoryview(buf) as mv:
                got = sock.recv_into(mv[self._end:])
        finally:
            if custom:
                sock.settimeout(self._timeout)
        if not got:
            raise ConnectionError(_CLOSED)
        self._end += got

    def _line(self, timeout: object) -> bytes:
        while True:
            i = self._buf.find(_CRLF, self._start, self._end)
            if i >= 0:
                line = bytes(self._buf[self._start:i])
                self._start = i + 2
                return line
            self._recv(timeout)

    def _take(self, n: int, timeout: object) -> bytes:
        while self._end - self._start < n:
            self._recv(timeout)
        out = bytes(self._buf[self._start:self._start + n])
        self._start += n
        return out

    def _bulk_into(self, n: int, timeout: object) -> bytearray:
        """The next ``n`` bytes in a new buffer: what is pending, then straight from the socket."""
        out = bytearray(n)
        with memoryview(out) as mv:
            self._fill(mv, timeout)
        return out

    def _fill(self, mv: memoryview, timeout: object) -> None:
        """Fill ``mv`` with the next bytes of the stream: what is pending, then straight
        from the socket (no copy between)."""
        n = mv.nbytes
        have = min(n, self._end - self._start)
        mv[:have] = self._buf[self._start:self._start + have]
        self._start += have
        if have == n:
            return
        sock = self._sock
        if sock is None:
            raise ConnectionError(_CLOSED)
        custom = timeout is not _SENTINEL
        if custom:
            sock.settimeout(timeout)
        try:
            while have < n:
                got = sock.recv_into(mv[have:])
                if not got:
                    raise ConnectionError(_CLOSED)
                have += got
        finally:
            if custom:
                sock.settimeout(self._timeout)

    def _value_into(self, sink: "ValueSink", i: int, timeout: object):
        """Element ``i`` of an array reply handed to ``sink``: a bulk value received into
        the buffers ``sink.buffers(i, n)`` gives (bytes past them are read and dropped),
        then ``sink.landed(i, n)``; a nil is ``landed(i, None)``, an error reply
        ``landed(i, error)``."""
        raw = self._line(timeout)
        kind = raw[:1]
        if kind == b"$":
            n = _int(raw)
            if n < 0:
                return sink.landed(i, None)
            left = n
            for mv in sink.buffers(i, n):
                take = min(left, mv.nbytes)
                self._fill(mv[:take], timeout)
                left -= take
            while left:  # a value longer than anything we asked for: read and dropped
                with memoryview(bytearray(min(left, 1 << 20))) as scratch:
                    self._fill(scratch, timeout)
                    left -= scratch.nbytes
            if self._take(2, timeout) != _CRLF:
                raise InvalidResponse(f"Protocol Error: bulk string of {n} bytes is not followed by CRLF")
            return sink.landed(i, n)
        if kind == b"-":
            error = self.parse_error(raw[1:].decode("utf-8", errors="replace"))
            if isinstance(error, ConnectionError):
                raise error
            return sink.landed(i, error)
        raise InvalidResponse(f"Protocol Error: {raw[:100]!r} where an array element was expected")

    def read_response(self, disable_decoding: bool = False, timeout: object = _SENTINEL):
        if self._buf.startswith(_OK, self._start, self._end):  # a put's replies
            self._start += len(_OK)
            return b"OK" if disable_decoding else self.encoder.decode(b"OK")
        raw = self._line(timeout)
        kind, rest = raw[:1], raw[1:]
        if kind == b"$":
            n = _int(raw)
            if n < 0:
                return None
            if disable_decoding and n >= _DIRECT_MIN:
                value: object = self._bulk_into(n, timeout)
            else:
                value = self._take(n, timeout)
            if self._take(2, timeout) != _CRLF:
                raise InvalidResponse(f"Protocol Error: bulk string of {n} bytes is not followed by CRLF")
            return value if disable_decoding else self.encoder.decode(value)
        if kind == b":":
            return _int(raw)
        if kind == b"+":
            return rest if disable_decoding else self.encoder.decode(rest)
        if kind == b"-":
            error = self.parse_error(rest.decode("utf-8", errors="replace"))
            if isinstance(error, ConnectionError):
                raise error
            return error
        if kind == b"*":
            n = _int(raw)
            if n < 0:
                return None
            sink, self.sink = self.sink, None  # the elements of this reply only
            if sink is not None:
                return [self._value_into(sink, i, timeout) for i in range(n)]
            return [self.read_response(disable_decoding, timeout) for _ in range(n)]
        raise InvalidResponse(f"Protocol Error: {raw!r}")


def _int(line: bytes) -> int:
    try:
        return int(line[1:])
    except ValueError:
        raise InvalidResponse(f"Protocol Error: {line[:100]!r}") from None


def _framed_kwargs(kwargs: dict) -> dict:
    kwargs.setdefault("command_packer", FramedPacker())
    if kwargs.get("protocol") in (2, "2"):  # RESP3 (redis-py's default) keeps redis-py's parser
        kwargs.setdefault("parser_class", DirectReplyParser)
    return kwargs


def _lazy(cmd: tuple) -> bool:
    return any(type(a) is FramedValue and type(a.header) is not bytes for a in cmd)


class _Framed:
    """Shared by both connection classes: a pipeline with headers still to
    build is packed lazily, command by command, as ``send_packed_command``
    sends it (it iterates what ``pack_commands`` returns), so each page's
    header is built right before that page is sent. Small pieces are joined
    as redis-py joins them; an exception while building disconnects, as any
    failure in the middle of a send does. ``read_into`` receives an MGET's
    values straight into the caller's buffers."""

    _buffer_cutoff: int

    @property
    def reads_into(self) -> bool:
        """Whether ``read_into`` works here: replies parsed by ``DirectReplyParser`` (RESP2)."""
        return isinstance(self._parser, DirectReplyParser)  # type: ignore[attr-defined]

    def read_into(self, sink: ValueSink) -> list:
        """The next reply, an array whose values go where ``sink`` says, read by redis-py's
        ``read_response`` (its timeouts, errors and disconnects). Raises ``TypeError`` when
        this connection parses with redis-py's own parser (``protocol=3``: see ``reads_into``)."""
        parser = self._parser  # type: ignore[attr-defined]  (redis-py's Connection sets it)
        if not isinstance(parser, DirectReplyParser):
            raise TypeError(f"{type(self).__name__} parses replies with {type(parser).__name__}, "
                            "not DirectReplyParser (protocol=3?)")
        parser.sink = sink
        try:
            return self.read_response(disable_decoding=True)  # type: ignore[attr-defined]
        finally:
            parser.sink = None

    def pack_commands(self, commands):
        commands = list(commands)
        if not any(_lazy(c) for c in commands):
            return super().pack_commands(commands)  # type: ignore[misc]
        return self._pack_lazily(commands)

    def _pack_lazily(self, commands: list) -> Iterator[bytes | memoryview]:
        cutoff = self._buffer_cutoff
        pieces: list[bytes] = []
        n = 0
        for cmd in commands:
            for chunk in self._command_packer.pack(*cmd):  # type: ignore[attr-defined]
                if isinstance(chunk, memoryview) or len(chunk) > cutoff:
                    if pieces:
                        yield b"".join(pieces)
                        pieces, n = [], 0
                    yield chunk
                else:
                    pieces.append(chunk)
                    n += len(chunk)
                    if n > cutoff:
                        yield b"".join(pieces)
                        pieces, n = [], 0
        if pieces:
            yield b"".join(pieces)


class FramedConnection(_Framed, Connection):
    def __init__(self, **kwargs):
        super().__init__(**_framed_kwargs(kwargs))


class FramedSSLConnection(_Framed, SSLConnection):
    def __init__(self, **kwargs):
        super().__init__(**_framed_kwargs(kwargs))
