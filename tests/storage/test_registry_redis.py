"""URL registry and options; redis:// URL details; Redis Cluster spreads pages."""
from __future__ import annotations

import pytest
import redis

from hicache.core.errors import ConfigError
from hicache.core.hashing import page_hashes
from hicache.storage import StorageRegistry, default_registry, open_storage
from hicache.storage.memory import MemoryBackend
from hicache.storage.redis_backend import RedisClusterBackend

from .conftest import FP, cluster_nodes


def test_default_schemes_and_errors():
    assert default_registry().schemes() == ["file", "hicache+unix", "memory", "redis", "redis+cluster", "rediss",
                                            "rediss+cluster"]
    with pytest.raises(ConfigError, match="scheme 's3' is not registered; known: file, hicache\\+unix, memory"):
        open_storage("s3://bucket", fingerprint=FP)
    with pytest.raises(ConfigError, match="expected scheme://"):
        open_storage("/var/cache", fingerprint=FP)
    with pytest.raises(ConfigError, match="fingerprint"):
        open_storage("memory://", fingerprint="")
    with pytest.raises(ConfigError, match="timeout_ms=0"):
        open_storage("memory://", fingerprint=FP, timeout_ms=0)
    with pytest.raises(ConfigError, match=r"bad option\(s\) \['colour'\]"):
        open_storage("memory://", fingerprint=FP, colour="red")
    with pytest.raises(ConfigError, match="takes no host"):
        open_storage("memory://somewhere", fingerprint=FP)


def test_new_backend_registers_by_name():
    reg = StorageRegistry()
    opened = []

    def factory(url, options, **opts):
        opened.append((url, options.timeout_ms, opts))
        return MemoryBackend(options, name=url)

    reg.register("mine", factory)
    with pytest.raises(ConfigError, match="already registered"):
        reg.register("mine", factory)
    b = open_storage("mine://x", fingerprint=FP, timeout_ms=7, registry=reg, flavour=1)
    assert opened == [("mine://x", 7, {"flavour": 1})]
    assert b.key_prefix == b"hicache:0f1e2d3c:"
    assert reg.schemes() == ["mine"]


def test_redis_url_password_and_db(private_redis):
    private_redis.stop()
    private_redis.start("--requirepass", "s3cret")
    url = f"redis://:s3cret@127.0.0.1:{private_redis.port}/3"
    b = open_storage(url, fingerprint=FP, key_prefix="p:")
    assert "s3cret" not in repr(b) and ":***@" in b.name
    k = page_hashes(list(range(4)), 4)[0]
    assert b.put([(k, b"abcd", [4])]) == 1
    raw = redis.Redis(port=private_redis.port, password="s3cret", db=3)
    assert raw.exists(b"p:" + k) == 1
    assert redis.Redis(port=private_redis.port, password="s3cret", db=0).exists(b"p:" + k) == 0
    wrong = open_storage(f"redis://:nope@127.0.0.1:{private_redis.port}/3", fingerprint=FP,
                         key_prefix="p:")
    assert wrong.get([k], [4]) == [None] and wrong.stats().errors == 1
    b.close()
    wrong.close()
    raw.close()


def test_cluster_spreads_pages_over_every_master(redis_cluster_url):
    b = open_storage(redis_cluster_url, fingerprint=FP, key_prefix="spread:", timeout_ms=2000)
    assert isinstance(b, RedisClusterBackend)
    ks = page_hashes(list(range(4 * 64)), 4)
    assert b.put([(k, bytes([i % 256]) * 32, [32]) for i, k in enumerate(ks)]) == 64
    per_node = [len(redis.Redis(host=n.host, port=n.port).keys(b"spread:*"))
                for n in cluster_nodes(redis_cluster_url)]
    assert sum(per_node) == 64 and min(per_node) > 0, per_node
    got = b.get(ks, [32])
    assert [bytes(g) for g in got] == [bytes([i % 256]) * 32 for i in range(64)]
    assert b.prefix_hits(ks) == 64 and b.delete(ks) == 64 and b.prefix_hits(ks) == 0
    assert b.ping()
    b.check_integrity()
    b.close()


@pytest.mark.parametrize("url, why", [
    ("redis+cluster://", "at least one host:port"),
    ("redis+cluster://127.0.0.1", "must be host:port"),
    ("redis+cluster://127.0.0.1:7000/2", "only db 0"),
])
def test_cluster_url_errors(url, why):
    with pytest.raises(ConfigError, match=why):
        open_storage(url, fingerprint=FP)


def test_backend_name_hides_query_string_passwords():
    from hicache.storage import open_storage
    b = open_storage("rediss://user:s3cret@127.0.0.1:1/0?password=q-s3cret&ssl_password=x", fingerprint="0" * 32)
    try:
        assert "s3cret" not in repr(b) and "q-s3cret" not in str(b.name) and "***" in str(b.name)
    finally:
        b.close()
