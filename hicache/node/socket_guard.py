"""Who may talk to the engine socket (file permissions and peer credentials), and
what ``hicache serve`` checks before it starts anything (``preflight``).

The socket file is created with an explicit mode (``service.socket_mode``,
default ``0600``), never the process umask, and optionally handed to a group
(``service.socket_group``). Every accepted connection's peer is then checked
with ``SO_PEERCRED`` against ``PeerPolicy``: the server's own user, root, the
uids in ``service.allowed_uids`` and (with a socket group) that group's
members. File permissions alone are not enough: a socket inherited by, or
passed to, another process would bypass them.
"""
from __future__ import annotations

import errno
import grp
import os
import pwd
import socket
import stat
import struct
from dataclasses import dataclass
from typing import NamedTuple

from hicache.core.errors import ConfigError, PoolError
from hicache.memory.shm import probe_segment


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


class SocketPathCheck(NamedTuple):
    problem: str  # "" when the path can be used
    stale: bool  # a socket file no server answers on: safe to remove before binding


def check_socket_path(path: str) -> SocketPathCheck:
    """Whether ``service.socket_path`` can be bound. Mutates nothing.

    Only a socket file that no process listens on is ``stale`` (removable);
    anything else under the path (a regular file, a directory, a symlink) is a
    problem: hicache never deletes what it did not create.
    """
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        parent = os.path.dirname(path) or "."
        if not os.path.isdir(parent):
            return SocketPathCheck(f"service.socket_path={path!r}: directory {parent!r} does not exist; "
                                   "create it or choose another path", False)
        return SocketPathCheck("", False)
    if not stat.S_ISSOCK(st.st_mode):
        kind = "a symbolic link" if stat.S_ISLNK(st.st_mode) else f"not a socket ({stat.filemode(st.st_mode)})"
        return SocketPathCheck(f"service.socket_path={path!r} exists and is {kind}; hicache will not "
                               "remove it: move it away or choose another path", False)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        try:
            s.connect(path)
        except (ConnectionRefusedError, FileNotFoundError):
            return SocketPathCheck("", True)
        except OSError as e:
            return SocketPathCheck(f"service.socket_path={path!r}: cannot probe the existing socket "
                                   f"({e.strerror}); remove it or choose another path", False)
    return SocketPathCheck(f"another server already listens on service.socket_path={path!r}; "
                           "stop it or choose another path", False)


def bind_rest(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` as uvicorn binds it; ``ConfigError`` naming ``service.port``."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise ConfigError(f"service.host={host!r} does not resolve ({e.strerror}); use an IP address "
                          "such as 127.0.0.1") from None
    family, kind, proto, _, addr = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.set_inheritable(True)
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise ConfigError(f"service.port={port} on {host} is already in use (another `hicache serve`?); "
                              "stop it or choose another service.port") from None
        if e.errno == errno.EACCES:
            raise ConfigError(f"service.port={port} on {host}: permission denied (ports below 1024 need "
                              "privileges); choose another service.port") from None
        raise ConfigError(f"service.host={host!r} service.port={port}: cannot bind ({e.strerror})") from None
    return sock


# ---- What ``hicache serve`` checks before it starts anything: every conflict at once.
#
# A second ``serve`` on the same node used to fail three times in a row: first
# on the engine socket, then (once that was moved) on the shared segment, then
# on the REST port with uvicorn's raw bind error that names no setting. Here
# each of the three is checked without changing anything, and all that are
# taken are reported together, each naming its setting (``service.socket_path``,
# ``service.shm_name``, ``service.port``).
#
# The REST socket is bound here and handed to uvicorn, so the port cannot be
# taken between the check and the start (and uvicorn never reports a bind
# error of its own).
def preflight(host: str, port: int, socket_path: str, shm_name: str, gid: int | None) -> socket.socket:
    """Check the socket path, the shared segment and the REST port; the bound REST socket.

    Raises one ``ConfigError`` listing every conflict found.
    """
    problems: list[str] = []
    sp = check_socket_path(socket_path)
    if sp.problem:
        problems.append(sp.problem)
    try:
        probe_segment(shm_name, gid)
    except PoolError as e:
        problems.append(str(e))
    rest: socket.socket | None = None
    try:
        rest = bind_rest(host, port)
    except ConfigError as e:
        problems.append(str(e))
    if problems:
        if rest is not None:
            rest.close()
        raise ConfigError(f"hicache serve cannot start: {len(problems)} conflict(s) with what runs on this "
                          "node:\n" + "\n".join(f"  - {p}" for p in problems))
    if rest is None:  # no problem means the REST socket was bound
        raise ConfigError("hicache serve: the REST socket was not bound and no conflict was reported")
    return rest
