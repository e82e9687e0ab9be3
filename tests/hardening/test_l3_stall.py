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


# ---------------------------------------------------------------- issue 27, item 8
# Before the fix ``HiCache.drain`` waited for every job, so the first L3 call
# of a freeze (stuck for timeout_ms x (1 + max_retries) before the circuit
# opened: ~210 ms) held the scheduler wherever it drained to free L1 pages.


def _hicache(url: str, **over):
    from hicache.core.config import HiCacheConfig
    from hicache.cache.hicache import HiCache
    from hicache.core.layout import KVLayout
    layout = KVLayout(model_id="t", num_layers=2, num_kv_heads=1, head_dim=4, dtype="float32", page_size=4,
                      host_layout="page_first")
    o = {"storage.url": url, "pool.device": "cpu", "pool.device_pages": "16", "pool.host_pages": "32",
         "storage.timeout_ms": "50", **over}
    return HiCache(HiCacheConfig.load(env={}, overrides=o), layout=layout)


def _finish(hc, rid: str, tokens: list[int]) -> None:
    req = hc.new_request(rid, tokens)
    hc.admit(req).wait()
    req.alloc(len(tokens) - req.computed_tokens)
    req.commit()
    req.finish()


def _drain_in_thread(hc) -> threading.Thread:
    t = threading.Thread(target=hc.drain, daemon=True)
    t.start()
    return t


def test_drain_does_not_wait_for_an_l3_call_stuck_before_the_circuit_opened():
    """An L3 write that never answers (a frozen server, no timeout at all): drain
    returns while it is still stuck; a later poll observes it once it returns."""
    hc = _hicache("memory://")
    hc.storage.BOUNDED_LOOKUPS = True  # stands for a store on another machine (memory:// never blocks by itself)
    stuck, release, order = threading.Event(), threading.Event(), []
    real = hc.storage._raw_put

    def frozen_put(items):
        stuck.set()
        release.wait(60)
        order.append("put returned")
        return real(items)
    hc.storage._raw_put = frozen_put
    try:
        _finish(hc, "a", list(range(100, 117)))  # 4 pages: backup L1 -> L2, then the store L2 -> L3
        until(lambda: hc.poll() >= 0 and stuck.is_set())  # the backup is observed, its store starts
        t = _drain_in_thread(hc)
        t.join(30)  # before the fix: blocked until release (this watchdog), then the assert below fails
        order.append("drain returned" if not t.is_alive() else "drain still waiting")
        assert order == ["drain returned"], order
        assert hc.storage.stalled() and len(hc.transfers._pending) == 1  # the store is still in flight
        hc.check_integrity()  # its L2 pages are pinned by the pending store, and accounted
        release.set()
        until(lambda: hc.poll() > 0 or not hc._jobs)
        hc.drain()
        assert not hc._jobs and not hc.storage.stalled()
        assert order == ["drain returned", "put returned"]
        hc.check_integrity()
    finally:
        release.set()
        hc.close()


def test_drain_waits_for_a_slow_local_store():
    """In-process and file stores bound their own calls: drain waits for them as before."""
    hc = _hicache("memory://")
    release, real = threading.Event(), hc.storage._raw_put

    def slow_put(items):
        release.wait(60)
        return real(items)
    hc.storage._raw_put = slow_put
    try:
        _finish(hc, "a", list(range(100, 117)))
        until(lambda: hc.poll() >= 0 and bool(hc.storage._inflight))
        t = _drain_in_thread(hc)
        t.join(0.3)  # (only gives drain the chance to return early; it must not)
        assert t.is_alive() and not hc.storage.stalled()
        release.set()
        t.join(30)
        assert not t.is_alive() and not hc._jobs
    finally:
        release.set()
        hc.close()


def test_drain_during_a_redis_sigstop_returns_before_the_stuck_call(frozen_redis):
    hc = _hicache(frozen_redis.url, **{"storage.max_retries": "2"})
    returned, real = [], hc.storage._raw_put

    def put(items):
        try:
            return real(items)
        finally:  # answered or failed (the frozen server: a timeout, after every retry)
            returned.append("put returned")
    hc.storage._raw_put = put
    try:
        _finish(hc, "warm", list(range(200, 217)))
        hc.drain()  # healthy: waits for the L3 write as before
        assert returned == ["put returned"] and not hc._jobs
        frozen_redis.freeze()
        _finish(hc, "a", list(range(100, 117)))
        until(lambda: hc.poll() >= 0 and bool(hc.storage._inflight))  # the write is on the wire to the stopped server
        t = _drain_in_thread(hc)
        t.join(30)
        returned.append("drain returned" if not t.is_alive() else "drain still waiting")
        # The stuck write fails after timeout_ms x 3 attempts; drain gave up waiting after one.
        assert returned == ["put returned", "drain returned"], returned
        until(lambda: len(returned) == 3)
        frozen_redis.thaw()
        until(lambda: not hc.storage.down)
        hc.drain()
        assert not hc._jobs
        hc.check_integrity()
    finally:
        frozen_redis.thaw()
        hc.close()
