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
"""
from __future__ import annotations

from redis.connection import Connection, Encoder, HiredisRespSerializer, PythonRespSerializer, SSLConnection
from redis.utils import HIREDIS_AVAILABLE

# redis-py's cutoff above which an argument is sent as its own buffer.
_BUFFER_CUTOFF = 6000


class FramedValue:
    """A bulk-string argument sent as ``header`` then ``payload`` with no join."""

    __slots__ = ("header", "payload")

    def __init__(self, header: bytes, payload: memoryview):
        self.header = header
        self.payload = payload  # flat byte view; only read while the command is sent


class FramedPacker:
    """redis-py command packer that understands ``FramedValue`` arguments."""

    def __init__(self) -> None:
        self._encode = Encoder("utf-8", "strict", False).encode
        self._plain = (HiredisRespSerializer() if HIREDIS_AVAILABLE
                       else PythonRespSerializer(_BUFFER_CUTOFF, self._encode))

    def pack(self, *args):
        if not any(type(a) is FramedValue for a in args):
            return self._plain.pack(*args)
        out: list[bytes | memoryview] = []
        buff = b"*%d\r\n" % len(args)
        for a in args:
            if type(a) is FramedValue:
                total = len(a.header) + a.payload.nbytes
                out.append(b"%s$%d\r\n%s" % (buff, total, a.header))
                out.append(a.payload)  # memoryview: pack_commands keeps it a separate chunk
                buff = b"\r\n"
            else:
                v = self._encode(a)
                buff = b"%s$%d\r\n%s\r\n" % (buff, len(v), v)
        out.append(buff)
        return out


class FramedConnection(Connection):
    def __init__(self, **kwargs):
        kwargs.setdefault("command_packer", FramedPacker())
        super().__init__(**kwargs)


class FramedSSLConnection(SSLConnection):
    def __init__(self, **kwargs):
        kwargs.setdefault("command_packer", FramedPacker())
        super().__init__(**kwargs)
