"""Storage fixtures: every backend behind one ``Harness`` (the backend plus raw
access to its stored objects, for corruption tests), a real 3-master Redis
Cluster on loopback (session scoped), and private redis-servers that tests may
kill and restart."""
from __future__ import annotations

import os
import random
import shutil
import socket
import subprocess
import time
import uuid
from dataclasses import dataclass
from typing import Callable

import pytest
import redis
from redis.cluster import ClusterNode, RedisCluster

from hicache.storage import StorageBackend, open_storage

FP = "0f1e2d3c4b5a69788796a5b4c3d2e1f0"  # a fingerprint-shaped string for tests


def port_pair_free(port: int) -> bool:
    """``port`` and its cluster bus port (``port + 10000``) can both be bound."""
    for p in (port, port + 10000):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", p))
            except OSError:
                return False
    return True


def free_port(cluster: bool = False) -> int:
    if not cluster:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]
    rng = random.Random(os.getpid() ^ time.monotonic_ns())
    for _ in range(200):
        p = rng.randrange(20000, 30000)
        if port_pair_free(p):
            return p
    raise RuntimeError("no free port pair (p, p+10000) in 20000-40000")


def wait_port(port: int, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.02)
    raise RuntimeError(f"nothing listens on 127.0.0.1:{port} after {timeout}s")


def redis_server(port: int, workdir: str, *extra: str) -> subprocess.Popen:
    exe = shutil.which("redis-server")
    assert exe, "redis-server is not on PATH; install it (apt-get install redis-server)"
    proc = subprocess.Popen([exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no", "--dir", workdir, *extra],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_port(port)
    return proc


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture
def private_redis(tmp_path):
    """A redis-server this test owns: ``(start(), stop(), port)``; restarts on the same port."""
    port = free_port()
    procs: list[subprocess.Popen] = []

    class Server:
        def __init__(self) -> None:
            self.port = port
            self.url = f"redis://127.0.0.1:{port}/0"

        @property
        def proc(self) -> subprocess.Popen:
            return procs[-1]

        def start(self, *extra: str) -> None:
            procs.append(redis_server(port, str(tmp_path), *extra))

        def stop(self) -> None:
            stop(procs[-1])

    srv = Server()
    srv.start()
    try:
        yield srv
    finally:
        for p in procs:
            stop(p)


@pytest.fixture(scope="session")
def redis_cluster_url(tmp_path_factory):
    """A 3-master Redis Cluster on loopback, torn down at the end of the session."""
    exe = shutil.which("redis-cli")
    assert exe, "redis-cli is not on PATH; install it (apt-get install redis-tools)"
    ports, procs = [], []
    try:
        for i in range(3):
            p = free_port(cluster=True)
            d = tmp_path_factory.mktemp(f"cluster{i}")
            procs.append(redis_server(p, str(d), "--cluster-enabled", "yes", "--cluster-config-file",
                                      f"nodes-{p}.conf", "--cluster-node-timeout", "2000"))
            ports.append(p)
        subprocess.run([exe, "--cluster", "create", *[f"127.0.0.1:{p}" for p in ports],
                        "--cluster-replicas", "0", "--cluster-yes"], check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=60)
        deadline = time.monotonic() + 20
        while True:
            states = [redis.Redis(port=p).cluster("info")["cluster_state"] for p in ports]
            if all(s == "ok" for s in states):
                break
            assert time.monotonic() < deadline, f"cluster never became ok: {states}"
            time.sleep(0.1)
        yield "redis+cluster://" + ",".join(f"127.0.0.1:{p}" for p in ports)
    finally:
        for proc in procs:
            stop(proc)


def cluster_nodes(url: str) -> list[ClusterNode]:
    return [ClusterNode(h, int(p)) for h, p in (hp.split(":") for hp in url.split("://")[1].split(","))]


@dataclass
class Harness:
    """A backend under test, plus raw access to what it stored."""

    kind: str
    url: str
    opts: dict
    backend: StorageBackend
    read_raw: Callable[[bytes], bytes | None]  # page hash -> stored object
    write_raw: Callable[[bytes, bytes], None]  # page hash, object -> stored as is

    def reopen(self, **changes) -> StorageBackend:
        opts = {**self.opts, **changes}
        return open_storage(self.url, **opts)


BACKENDS = ["memory", "file", "redis", "cluster"]


@pytest.fixture(params=BACKENDS)
def harness(request, tmp_path, redis_url):
    kind = request.param
    opts = dict(fingerprint=FP, key_prefix=f"t-{uuid.uuid4().hex[:12]}:", timeout_ms=2000)
    if kind == "memory":
        url = "memory://"
    elif kind == "file":
        url = f"file://{tmp_path / 'l3'}"
    elif kind == "redis":
        url = redis_url
    else:
        url = request.getfixturevalue("redis_cluster_url")
    b = open_storage(url, **opts)
    prefix = opts["key_prefix"].encode()
    if kind == "memory":
        read, write = b.raw_object, b.replace_raw_object
    elif kind == "file":
        def read(k):
            p = b.path_of(k)
            return p.read_bytes() if p.exists() else None

        def write(k, obj):
            p = b.path_of(k)
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_bytes(obj)
    else:
        raw = (redis.Redis.from_url(url) if kind == "redis"
               else RedisCluster(startup_nodes=cluster_nodes(url)))

        def read(k):
            return raw.get(prefix + k)

        def write(k, obj):
            raw.set(prefix + k, obj)
    h = Harness(kind, url, opts, b, read, write)
    try:
        yield h
    finally:
        b.close()
        if kind in ("redis", "cluster"):
            raw.close()
