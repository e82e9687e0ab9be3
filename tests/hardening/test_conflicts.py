"""Start-up conflicts of ``hicache serve`` (issue 27, items 5 and 13).

Before the fix: a ``service.socket_path`` naming an existing regular file
was deleted ("removing stale socket"); a second ``serve`` reported its
conflicts one at a time (socket, then segment, then port), the port as
uvicorn's raw bind error that names no setting.
"""
from __future__ import annotations

import os
import socket

import pytest

from hicache.node.server import NodeServer
from hicache.node.socket_guard import check_socket_path
from hicache.api.serve import serve
from hicache.core.config import HiCacheConfig
from hicache.core.errors import ConfigError
from hicache.memory.shm import shm_path

from .conftest import config


def _with(cfg: HiCacheConfig, **service) -> HiCacheConfig:
    return cfg.model_copy(update={"service": cfg.service.model_copy(update=service)})


def _listener() -> socket.socket:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    return s


@pytest.mark.parametrize("kind", ["file", "symlink", "directory"])
def test_socket_path_that_is_not_a_socket_is_refused_and_kept(kind):
    cfg = config()
    path = cfg.service.socket_path
    target = path + ".target"
    with open(target, "w") as f:
        f.write("precious\n")
    if kind == "file":
        os.rename(target, path)
    elif kind == "symlink":
        os.symlink(target, path)
    else:
        os.mkdir(path)
    srv = NodeServer(cfg)
    with pytest.raises(ConfigError, match="hicache will not remove it") as e:
        srv.start()
    assert f"service.socket_path={path!r}" in str(e.value)
    assert os.path.lexists(path) and not os.path.exists(shm_path(cfg.service.shm_name))
    if kind == "file":
        assert open(path).read() == "precious\n"
    elif kind == "symlink":
        assert os.readlink(path) == target and open(target).read() == "precious\n"


def test_stale_socket_is_still_removed():
    cfg = config()
    s = socket.socket(socket.AF_UNIX)
    s.bind(cfg.service.socket_path)
    s.close()  # a socket file nobody listens on: what a killed server leaves
    assert check_socket_path(cfg.service.socket_path) == (("", True))
    srv = NodeServer(cfg)
    srv.start()
    srv.stop()
    assert not os.path.exists(cfg.service.socket_path)


def test_second_serve_reports_socket_shm_and_port_together():
    first = NodeServer(config())
    first.start()
    busy = _listener()
    try:
        port = busy.getsockname()[1]
        second = _with(first.config, port=port)
        with pytest.raises(ConfigError) as e:
            serve(second)
        msg = str(e.value)
        assert "3 conflict(s)" in msg, msg
        for setting in (f"service.socket_path={first.socket_path!r}", f"service.shm_name={first.shm_name!r}",
                        f"service.port={port}"):
            assert setting in msg, (setting, msg)
        assert "Errno" not in msg and "error while attempting to bind" not in msg
        first.check_integrity()  # the first server lost nothing: socket and segment are its own still
        assert check_socket_path(first.socket_path).problem.startswith("another server already listens")
    finally:
        busy.close()
        first.stop()


def test_port_conflict_alone_names_service_port_and_starts_nothing():
    cfg = config()
    busy = _listener()
    try:
        port = busy.getsockname()[1]
        with pytest.raises(ConfigError, match=rf"1 conflict\(s\)[^\n]*\n  - service.port={port} on 127.0.0.1 "
                                              "is already in use"):
            serve(_with(cfg, port=port))
    finally:
        busy.close()
    assert not os.path.exists(cfg.service.socket_path) and not os.path.exists(shm_path(cfg.service.shm_name))
