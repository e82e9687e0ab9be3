"""A shared L2 segment planted by another local user is refused (issue 27, item 1).

Before the fix ``take_orphan`` opened ``/dev/shm/<shm_name>`` with plain
``O_RDWR`` and adopted whatever carried a valid header: a file that user
``nobody`` created with mode 0666 and "committed" pages was adopted
(``segment_origin == "adopted"``) and its bytes served to engines; a
symlink was followed; the default name ``hicache-l2`` was the same for
every user. Each case below was adopted, followed or mapped then.
"""
from __future__ import annotations

import os
import stat

import pytest

from hicache.node.server import NodeServer
from hicache.core.config import HiCacheConfig
from hicache.core.errors import PoolError
from hicache.core.hashing import page_hashes
from hicache.node.l2_segment import L2Segment
from hicache.core.layout import KVLayout
from hicache.memory.shm import SharedSegment, shm_path

from .conftest import LAYOUT, config

NOBODY = 65534
PAGES = 16


def _valid_image(name: str, layout: KVLayout) -> tuple[bytes, bytes]:
    """A real segment's bytes with page 0 committed under the victim's first page hash, and that hash."""
    h = page_hashes(list(range(layout.page_size)), layout.page_size)[0]
    opened = L2Segment.open_for_server(name + "-src", layout, PAGES)
    seg = opened.segment
    try:
        seg.pool.write_page(0, b"\x66" * layout.page_bytes)
        seg.committed(0, h, False)
        assert seg.shm.tensor is not None
        return seg.shm.tensor.numpy().tobytes(), h
    finally:
        seg.close()


def _plant_as(uid: int | None, path: str, image: bytes, mode: int = 0o666) -> None:
    """Create ``path`` holding ``image`` with ``mode``, as user ``uid`` (None: this user).

    Another uid is a forked child that drops to it (setgroups/setgid/setuid)
    and only makes system calls, so it needs no interpreter it can read.
    """
    pid = os.fork()
    if pid == 0:  # child: never returns into pytest
        rc = 1
        try:
            if uid is not None:
                os.setgroups([])
                os.setgid(uid)
                os.setuid(uid)
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0)
            os.fchmod(fd, mode)
            os.write(fd, image)
            os.close(fd)
            rc = 0
        finally:
            os._exit(rc)
    assert os.waitpid(pid, 0)[1] == 0, f"planting {path} as uid {uid} failed"
    st = os.stat(path)
    assert (st.st_uid, stat.S_IMODE(st.st_mode), st.st_size) == (
        os.geteuid() if uid is None else uid, mode, len(image))


@pytest.fixture
def cfg():
    c = config()
    yield c
    for suffix in ("", "-src", "-target"):
        p = shm_path(c.service.shm_name + suffix)
        if os.path.lexists(p):
            os.unlink(p) if not os.path.isdir(p) or os.path.islink(p) else os.rmdir(p)


def _plant(kind: str, cfg: HiCacheConfig) -> str:
    name = cfg.service.shm_name
    path, layout = shm_path(name), cfg.layout()
    image, _ = _valid_image(name, layout)
    if kind == "other_user":
        if os.geteuid() != 0:
            pytest.skip("planting as a second uid needs root here; the wrong-mode cases cover the check")
        _plant_as(NOBODY, path, image)
    elif kind == "own_0666":
        _plant_as(None, path, image)
    elif kind == "own_0644":
        _plant_as(None, path, image, 0o644)
    elif kind == "symlink":
        _plant_as(None, path + "-target", image, 0o600)
        os.symlink(path + "-target", path)
    elif kind == "hardlink":
        _plant_as(None, path + "-target", image, 0o600)
        os.link(path + "-target", path)
    elif kind == "fifo":
        os.mkfifo(path, 0o600)
    elif kind == "directory":
        os.mkdir(path, 0o700)
    return path


CASES = {"other_user": "owned by uid 65534", "own_0666": "mode is 0666, expected 0600",
         "own_0644": "mode is 0644", "symlink": "symbolic link", "hardlink": "2 hard links",
         "fifo": "not a regular file", "directory": "not a regular file"}


@pytest.mark.parametrize("kind", list(CASES))
def test_planted_segment_is_refused_not_adopted(cfg, kind):
    path = _plant(kind, cfg)
    before = os.lstat(path)
    with pytest.raises(PoolError) as e:
        L2Segment.open_for_server(cfg.service.shm_name, cfg.layout(), PAGES)
    msg = str(e.value)
    assert CASES[kind] in msg and f"rm {path}" in msg and "service.shm_name" in msg, msg
    after = os.lstat(path)  # refused, and left alone: never unlinked or rewritten
    assert (after.st_ino, after.st_mtime_ns, after.st_size) == (before.st_ino, before.st_mtime_ns, before.st_size)


def test_server_refuses_to_start_on_a_planted_segment(cfg):
    """End to end: a server whose L2 name another user took fails at start, before serving."""
    path = _plant("other_user" if os.geteuid() == 0 else "own_0666", cfg)
    srv = NodeServer(cfg)
    with pytest.raises(PoolError, match="not this server's to use"):
        srv.start()
    assert os.path.exists(path) and not os.path.exists(cfg.service.socket_path)


def test_own_orphan_is_still_adopted(cfg):
    """The check keeps what it is for: a segment this user's dead server left (0600, one link) is adopted."""
    name = cfg.service.shm_name
    image, h = _valid_image(name, cfg.layout())
    _plant_as(None, shm_path(name), image, 0o600)
    opened = L2Segment.open_for_server(name, cfg.layout(), PAGES)
    try:
        assert (opened.action, opened.restored, opened.segment.entries()) == ("adopted", 1, [(0, h, False)])
    finally:
        opened.segment.close()
    assert not os.path.exists(shm_path(name))


@pytest.mark.parametrize("group", [False, True])
def test_segment_is_created_0600_or_0660_for_the_socket_group(group):
    cfg = config(**({"socket_group": str(os.getegid())} if group else {}))
    srv = NodeServer(cfg)
    srv.start()
    try:
        st = os.stat(shm_path(cfg.service.shm_name))
        assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode), st.st_nlink) == (
            os.geteuid(), os.getegid(), 0o660 if group else 0o600, 1)
    finally:
        srv.stop()


def test_client_maps_only_the_servers_own_segment(cfg):
    name = cfg.service.shm_name
    with SharedSegment.create(name, 4096):
        with pytest.raises(PoolError, match=f"owned by uid {os.geteuid()}, not uid {NOBODY}"):
            SharedSegment.attach(name, 4096, owner_uid=NOBODY)
        SharedSegment.attach(name, 4096, owner_uid=os.geteuid()).close()
    _plant_as(None, shm_path(name), bytes(4096), 0o666)
    with pytest.raises(PoolError, match="mode is 0666"):
        SharedSegment.attach(name, 4096)


def test_default_segment_name_is_per_user():
    assert HiCacheConfig.load(env={}).service.shm_name == f"hicache-l2-{os.geteuid()}"
    assert LAYOUT  # the hardening layout the planted images use
