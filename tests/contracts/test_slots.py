"""Owned metadata slots: the old ring-buffer failure reproduced, and prevented."""
from __future__ import annotations

import queue
import threading

import pytest
import torch

from hicache.core.errors import CacheStateError, SlotsExhausted, StaleSlot
from hicache.cache.slots import MetaSlotPool

K, H = 3, 4


def payload(i: int):
    """Request i's metadata: every value encodes i."""
    return 100 + i, torch.arange(K) + 10 * i, torch.full((K,), i / 10), torch.full((H,), float(i))


def assert_is(data, i: int):
    tok, ids, probs, hid = payload(i)
    assert data.first_token == tok
    assert torch.equal(data.topk_ids, ids) and torch.equal(data.topk_probs, probs)
    assert torch.equal(data.hidden, hid)


class RingSlots:
    """The old scheme: slot = next index mod N, whoever still needs it."""

    def __init__(self, n: int):
        self.n, self.next = n, 0
        self.hidden = torch.zeros(n, H)
        self.first = [0] * n
        self.lock = threading.Lock()

    def write(self, i: int) -> int:
        with self.lock:
            s = self.next % self.n
            self.next += 1
        tok, _, _, hid = payload(i)
        self.first[s], self.hidden[s] = tok, hid
        return s

    def read(self, s: int):
        return self.first[s], self.hidden[s].clone()


def run_transfers(land, consume, n_req: int, in_flight: int):
    """Transfers 0..in_flight-1 land one after another (each on its own thread) before
    anyone reads; the rest start together and land while a consumer reads completions
    in the order they arrive. Returns ({request: what its consumer read}, log)."""
    log, lock, done = [], threading.Lock(), queue.Queue()

    def transfer(i):
        h = land(i)
        with lock:
            log.append(("land", i))
        done.put((i, h))

    threads = [threading.Thread(target=transfer, args=(i,)) for i in range(n_req)]
    for t in threads[:in_flight]:
        t.start()
        t.join(10)
    for t in threads[in_flight:]:
        t.start()
    out = {}
    for _ in range(n_req):
        i, h = done.get(timeout=10)
        with lock:
            log.append(("read", i))  # logged before the read can free anything
        out[i] = consume(i, h)
    for t in threads:
        t.join(10)
    return out, log


def max_unread(log) -> int:
    """Most transfers landed and not yet (being) read at any point of the log."""
    unread = worst = 0
    for kind, _ in log:
        unread += 1 if kind == "land" else -1
        worst = max(worst, unread)
    return worst


def test_ring_buffer_recycles_a_slot_before_its_consumer_read_it():
    ring = RingSlots(2)
    out, log = run_transfers(lambda i: ring.write(i), lambda i, s: ring.read(s), 3, in_flight=3)
    first0, hid0 = out[0]
    assert (first0, hid0[0].item()) == (102, 2.0)  # request 0 reads request 2's metadata
    assert out[2][0] == 102
    assert max_unread(log) == 3  # three in flight over two slots


def test_owned_pool_back_pressures_instead_of_recycling():
    pool = MetaSlotPool(2, K, H)

    def land(i):
        v = pool.acquire(f"r{i}", timeout=10)  # blocks while both slots are owned
        pool.write(v, *payload(i))
        return v

    out, log = run_transfers(land, lambda i, v: pool.consume(v), 6, in_flight=2)
    for i, data in out.items():
        assert_is(data, i)
    assert sorted(out) == list(range(6))
    assert max_unread(log) == 2  # never more owned than there are slots
    pool.check_integrity()
    assert pool.num_free == 2 and pool.stats.consumed == 6


def test_exhaustion_raises_typed_error_and_abort_frees():
    pool = MetaSlotPool(2, K, H)
    a, b = pool.acquire("a"), pool.acquire("b")
    assert pool.try_acquire("c") is None
    with pytest.raises(SlotsExhausted, match="all 2 metadata slots are owned"):
        pool.acquire("c", timeout=0)
    pool.release(a)  # abort of request a
    c = pool.acquire("c")
    assert c.index == a.index and c.generation == a.generation + 1
    pool.check_integrity()
    assert pool.owners() == {b.index: "b", c.index: "c"}


def test_stale_view_raises_instead_of_serving_new_owner():
    pool = MetaSlotPool(1, K, H)
    v0 = pool.acquire("r0")
    pool.write(v0, *payload(0))
    assert_is(pool.consume(v0), 0)
    v1 = pool.acquire("r1")
    pool.write(v1, *payload(1))
    with pytest.raises(StaleSlot, match="generation 0"):
        pool.read(v0)  # a second read by r0's consumer
    with pytest.raises(StaleSlot):
        pool.write(v0, *payload(0))  # a late transfer of r0 must not overwrite r1
    with pytest.raises(StaleSlot):
        pool.release(v0)
    assert_is(pool.read(v1), 1)
    assert pool.stats.stale == 3
    pool.check_integrity()


def test_read_before_write_is_refused():
    pool = MetaSlotPool(1, K, H)
    v = pool.acquire("r")
    with pytest.raises(CacheStateError, match="not written yet"):
        pool.read(v)
    with pytest.raises(ValueError, match="hidden row of 4"):
        pool.write(v, 1, torch.zeros(K), torch.zeros(K), torch.zeros(H + 1))


def test_many_threads_never_see_foreign_metadata():
    pool = MetaSlotPool(3, K, H)
    ready: queue.Queue = queue.Queue()
    n_threads, per = 6, 40
    errors = []

    def producer(t):
        for j in range(per):
            i = t * per + j
            v = pool.acquire(f"r{i}", timeout=30)
            pool.write(v, *payload(i))
            ready.put((i, v))

    def consumer():
        for _ in range(n_threads * per):
            i, v = ready.get(timeout=30)
            try:
                assert_is(pool.consume(v), i)
            except AssertionError as e:  # pragma: no cover - reported below
                errors.append((i, e))

    ths = [threading.Thread(target=producer, args=(t,)) for t in range(n_threads)]
    ths.append(threading.Thread(target=consumer))
    for t in ths:
        t.start()
    for t in ths:
        t.join(60)
    assert not errors
    assert pool.stats.consumed == n_threads * per and pool.stats.exhausted > 0
    pool.check_integrity()
