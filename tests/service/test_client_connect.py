"""ServiceClient (and ServiceConsensus, on the same link) name the socket path and
say what to do when no service answers there; the exception class stays the
OSError subclass callers retry on."""
import socket

import pytest

from hicache.client.link import ServiceClient
from hicache.core.config import DEFAULT_SOCKET_PATH, HiCacheConfig
from hicache.client.consensus import ServiceConsensus


def test_default_socket_path_is_the_one_constant():
    assert HiCacheConfig.load(env={}).service.socket_path == DEFAULT_SOCKET_PATH == "/tmp/hicache.sock"


def test_missing_socket_names_the_path_and_hicache_serve(tmp_path):
    path = str(tmp_path / "nobody-here.sock")
    layout = HiCacheConfig.load(env={}).layout()
    with pytest.raises(FileNotFoundError) as e:
        ServiceClient(path, layout, timeout=2)
    msg = str(e.value)
    assert e.value.filename == path and repr(path) in msg, msg
    assert "start `hicache serve` first" in msg and DEFAULT_SOCKET_PATH in msg, msg
    with pytest.raises(FileNotFoundError) as e:
        ServiceConsensus(path, "g", 0, 1, timeout_s=2)
    assert repr(path) in str(e.value) and "hicache serve" in str(e.value), e.value


def test_socket_file_without_a_listener_says_the_server_is_gone(tmp_path):
    path = str(tmp_path / "stale.sock")
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(path)  # the file a crashed server leaves: bound, never listening
    try:
        with pytest.raises(ConnectionRefusedError) as e:
            ServiceClient(path, HiCacheConfig.load(env={}).layout(), timeout=2)
    finally:
        s.close()
    msg = str(e.value)
    assert repr(path) in msg and "no server listens" in msg and "start it again" in msg, msg
