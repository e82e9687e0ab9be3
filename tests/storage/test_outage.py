"""Redis down or frozen: misses and dropped writes, no exception, one warning
per outage, and recovery by itself once the server is back on the same port."""
from __future__ import annotations

import logging
import signal
import time

import pytest

from hicache.core.hashing import page_hashes
from hicache.storage import open_storage

from .conftest import FP

SIZES = [8, 8]


def keys(n: int) -> list[bytes]:
    return page_hashes(list(range(4 * n)), 4)


def pages(n: int) -> list[tuple[bytes, bytes, list[int]]]:
    return [(k, bytes([i]) * 16, SIZES) for i, k in enumerate(keys(n))]


def poll(fn, deadline_s: float = 15.0):
    """Call ``fn`` until it returns something truthy; fail after the deadline."""
    end = time.monotonic() + deadline_s
    while True:
        out = fn()
        if out:
            return out
        assert time.monotonic() < end, "no recovery before the deadline"
        time.sleep(0.05)


def every_call_misses(b, n: int = 3) -> None:
    ks = keys(n)
    assert b.get(ks, SIZES) == [None] * n
    assert b.put(pages(n)) == 0
    assert b.exists(ks) == [False] * n
    assert b.prefix_hits(ks) == 0
    assert b.delete(ks) == 0


@pytest.mark.parametrize("max_retries", [0, 2])
def test_killed_redis_turns_into_misses_and_recovers(private_redis, caplog, max_retries):
    b = open_storage(private_redis.url, fingerprint=FP, timeout_ms=100, max_retries=max_retries,
                     probe_max_ms=200)
    assert b.put(pages(3)) == 3
    private_redis.stop()
    with caplog.at_level(logging.WARNING, logger="hicache.storage"):
        for _ in range(5):
            every_call_misses(b)
        assert b.ping() is False and b.down
        s = b.stats()
        assert s.put_dropped == 15 and s.put_ok == 3 and s.misses == 15 and s.hits == 0
        assert s.errors >= 2  # the first failure and at least the ping; the rest answer at once
        b.check_integrity()
        down_msgs = [r for r in caplog.records if "unreachable" in r.getMessage()]
        assert len(down_msgs) == 1, [r.getMessage() for r in caplog.records]

        private_redis.start()  # same port, empty (no persistence)
        stored = poll(lambda: b.put(pages(3)))  # the client reconnects by itself
    assert stored == 3 and not b.down
    assert [bytes(p) for p in b.get(keys(3), SIZES)] == [bytes([i]) * 16 for i in range(3)]
    s = b.stats()
    assert s.reconnects == 1
    assert len([r for r in caplog.records if "answers again after" in r.getMessage()]) == 1
    b.check_integrity()
    b.close()


def test_frozen_redis_times_out_into_misses(private_redis):
    """SIGSTOP freezes the server with its socket open: reads time out."""
    b = open_storage(private_redis.url, fingerprint=FP, timeout_ms=50, max_retries=1, probe_max_ms=100)
    assert b.put(pages(2)) == 2
    private_redis.proc.send_signal(signal.SIGSTOP)
    try:
        assert b.get(keys(2), SIZES) == [None, None]
        assert b.put(pages(2)) == 0
        assert b.down
    finally:
        private_redis.proc.send_signal(signal.SIGCONT)
    got = poll(lambda: [p for p in b.get(keys(2), SIZES) if p is not None])
    assert [bytes(p) for p in got] == [bytes([0]) * 16, bytes([1]) * 16]
    s = b.stats()
    assert s.reconnects == 1 and s.put_dropped == 2 and s.corrupt == 0
    b.check_integrity()
    b.close()


def test_server_never_up_at_open(private_redis):
    """Opening does not connect: a backend opened while Redis is down works once it is up."""
    private_redis.stop()
    b = open_storage(private_redis.url, fingerprint=FP, timeout_ms=100, max_retries=0, probe_max_ms=100)
    every_call_misses(b)
    private_redis.start()
    assert poll(lambda: b.put(pages(1))) == 1
    b.close()


def test_cluster_unreachable_at_open_misses(tmp_path):
    from .conftest import free_port
    url = f"redis+cluster://127.0.0.1:{free_port()},127.0.0.1:{free_port()}"
    b = open_storage(url, fingerprint=FP, timeout_ms=50, max_retries=0)
    every_call_misses(b)
    assert b.down and b.stats().put_dropped == 3
    b.close()


def test_closed_backend_answers_misses(private_redis):
    b = open_storage(private_redis.url, fingerprint=FP)
    b.close()
    b.close()
    every_call_misses(b)
    assert b.ping() is False


def test_refused_writes_are_dropped_per_item_without_an_outage(private_redis):
    """A full Redis (noeviction) refuses some SETs: counted drops, not an outage."""
    import redis
    raw = redis.Redis(port=private_redis.port)
    raw.config_set("maxmemory", raw.info("memory")["used_memory"] + (4 << 20))
    raw.config_set("maxmemory-policy", "noeviction")
    b = open_storage(private_redis.url, fingerprint=FP, timeout_ms=2000, key_prefix="oom:")
    ks = page_hashes(list(range(4 * 8)), 4)
    stored = b.put([(k, bytes([i]) * (1 << 20), [1 << 20]) for i, k in enumerate(ks)])
    present = [bool(raw.exists(b"oom:" + k)) for k in ks]
    s = b.stats()
    assert 0 < stored < 8 and stored == sum(present)
    assert (s.put_ok, s.put_dropped, s.errors) == (stored, 8 - stored, 8 - stored)
    assert not b.down  # the connection is still in step: reads work
    got = b.get(ks, [1 << 20])
    assert [g is not None for g in got] == present
    b.check_integrity()
    b.close()
    raw.close()
