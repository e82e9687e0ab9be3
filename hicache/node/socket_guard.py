"""Who may talk to the engine socket: file permissions and peer credentials.

The socket file is created with an explicit mode (``service.socket_mode``,
default ``0600``), never the process umask, and optionally handed to a group
(``service.socket_group``). Every accepted connection's peer is then checked
with ``SO_PEERCRED`` against ``PeerPolicy``: the server's own user, root, the
uids in ``service.allowed_uids`` and (with a socket group) that group's
members. File permissions alone are not enough: a socket inherited by, or
passed to, another process would bypass them.
"""
from __future__ import annotations

import grp
import os
import pwd
import socket
import struct
from dataclasses import dataclass
from typing import NamedTuple

from hicache.core.errors import ConfigError

_UCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


class PeerCred(NamedTuple):
    pid: int
    uid: int
    gid: int


def peer_cred(sock: socket.socket) -> PeerCred:
    """The connected peer's pid, uid and gid (Linux ``SO_PEERCRED``)."""
    return PeerCred(*_UCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)))


def resolve_group(group: str) -> int | None:
    """``service.socket_group`` (a name or a numeric gid, "" for none) as a gid."""
    if not group:
        return None
    if group.isdigit():
        return int(group)
    try:
        return grp.getgrnam(group).gr_gid
    except KeyError:
        raise ConfigError(f"service.socket_group={group!r}: no such group on this machine; create it, "
                          "give a numeric gid, or leave it empty") from None


@dataclass(frozen=True, slots=True)
class PeerPolicy:
    """Which peers may use the socket. ``allows`` is pure."""

    owner_uid: int
    allowed_uids: frozenset[int] = frozenset()
    group_gid: int | None = None
    allow_root: bool = True  # root can read the socket file anyway

    def allows(self, cred: PeerCred) -> bool:
        if cred.uid == self.owner_uid or cred.uid in self.allowed_uids or (self.allow_root and cred.uid == 0):
            return True
        if self.group_gid is None:
            return False
        return cred.gid == self.group_gid or self.group_gid in _groups_of(cred.uid, cred.gid)

    def describe(self) -> str:
        who = [f"uid {self.owner_uid} (the server's user)"] + (["root"] if self.allow_root else [])
        who += [f"uid {u}" for u in sorted(self.allowed_uids)]
        if self.group_gid is not None:
            who.append(f"members of gid {self.group_gid}")
        return ", ".join(who)


def _groups_of(uid: int, gid: int) -> list[int]:
    try:
        return os.getgrouplist(pwd.getpwuid(uid).pw_name, gid)
    except (KeyError, OSError):
        return [gid]


def bind_unix_socket(path: str, mode: int, gid: int | None) -> socket.socket:
    """A listening-ready Unix socket at ``path`` with exactly ``mode`` (and group ``gid``).

    The file is created under a ``0o177`` umask, so it is never wider than
    owner read/write even for an instant, then opened up to ``mode``.
    Raises ``ConfigError`` naming the path when it cannot be created.
    """
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        old = os.umask(0o177)
        try:
            sock.bind(path)
        finally:
            os.umask(old)
        if gid is not None:
            os.chown(path, -1, gid)
        os.chmod(path, mode)
    except FileNotFoundError:
        sock.close()
        raise ConfigError(f"service.socket_path={path!r}: directory {os.path.dirname(path) or '.'!r} does "
                          "not exist; create it or choose another path") from None
    except PermissionError as e:
        sock.close()
        raise ConfigError(f"service.socket_path={path!r}: {e.strerror}; choose a directory this user "
                          "can write (or fix service.socket_group)") from None
    except OSError as e:
        sock.close()
        raise ConfigError(f"service.socket_path={path!r}: cannot bind ({e.strerror})") from None
    return sock
