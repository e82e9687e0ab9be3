"""A stopped Redis does not stall callers (issue 17, item 11). No wall-clock asserts:
the tests count raw calls and answers, and a watchdog only guards against a hang.

Before the fix: once the probe time had passed, the next caller probed the
frozen server itself (its ``_raw_get`` ran and blocked for the timeout), an
outage ended only when a caller happened to succeed, and ``prefix_hits`` had
no budget (it took no ``budget_s``).
"""
from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import threading
import time

import pytest

from hicache.storage import open_storage

FP = "0f1e2d3c4b5a69788796a5b4c3d2e1f0"
SIZES = [8, 8]


def key(i: int) -> bytes:
    return i.to_bytes(16, "big")


@pytest.fixture
def frozen_redis(tmp_path):
    """A private redis-server; ``freeze()``/``thaw()`` send SIGSTOP/SIGCONT."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([shutil.which("redis-server"), "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no", "--dir", str(tmp_path)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(200):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            break
        except OSError:
            time.sleep(0.05)

    class R:
        url = f"redis://127.0.0.1:{port}/0"
        freeze = staticmethod(lambda: proc.send_signal(signal.SIGSTOP))
        thaw = staticmethod(lambda: proc.send_signal(signal.SIGCONT))
    try:
        yield R
    finally:
        proc.send_signal(signal.SIGCONT)
        proc.terminate()
        proc.wait(10)


def until(cond, limit: float = 30.0) -> None:
    deadline = time.monotonic() + limit
    while not cond():
        assert time.monotonic() < deadline, "condition not reached (watchdog)"
        time.sleep(0.02)


def test_callers_never_probe_a_dead_l3_and_a_background_ping_ends_the_outage(frozen_redis):
    b = open_storage(frozen_redis.url, fingerprint=FP, timeout_ms=50, max_retries=0, probe_max_ms=100)
    raw_calls = []
    real = b._raw_get
    b._raw_get = lambda keys: raw_calls.append(len(keys)) or real(keys)
    try:
        assert b.put([(key(1), bytes(16), SIZES)]) == 1
        frozen_redis.freeze()
        assert b.get([key(1)], SIZES) == [None] and b.down
        n = len(raw_calls)
        time.sleep(0.5)  # several probe intervals pass: a caller would now probe (and block)
        for _ in range(20):
            assert b.get([key(1)], SIZES) == [None]
        assert len(raw_calls) == n  # the circuit is open: no caller touched the network
        frozen_redis.thaw()
        until(lambda: not b.down)  # closed by the background ping, with no caller traffic
        assert b.stats().reconnects == 1
        assert [bytes(x) for x in b.get([key(1)], SIZES)] == [bytes(16)]
        b.check_integrity()
    finally:
        frozen_redis.thaw()
        b.close()


def test_a_bounded_lookup_answers_miss_and_moves_on(frozen_redis):
    b = open_storage(frozen_redis.url, fingerprint=FP, timeout_ms=2000, max_retries=0, probe_max_ms=100)
    try:
        assert b.put([(key(i), bytes(16), SIZES) for i in range(4)]) == 4
        assert b.prefix_hits([key(i) for i in range(4)], budget_s=5.0) == 4
        frozen_redis.freeze()
        out: list[int] = []
        t = threading.Thread(target=lambda: out.extend([b.prefix_hits([key(0)], budget_s=0.01),
                                                        b.prefix_hits([key(0)], budget_s=0.01)]))
        t.start()
        t.join(30)  # the socket timeout is 2 s; a bounded lookup must not wait for it
        assert not t.is_alive() and out == [0, 0]
        assert b.stats().lookup_timeouts == 2  # the first timed out, the second found the worker busy
        frozen_redis.thaw()
        until(lambda: b.prefix_hits([key(i) for i in range(4)], budget_s=5.0) == 4)
    finally:
        frozen_redis.thaw()
        b.close()
