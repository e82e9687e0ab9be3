"""The engine service as a real process, with engine clients in other processes."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from hicache.client.link import ServiceClient
from hicache.core.errors import ContractMismatch, ForeignPage, OutOfPages, ServiceError
from hicache.core.hashing import page_hashes


def expected_page(seed: int, i: int, nbytes: int) -> bytes:
    import hashlib  # same formula as engine_worker.payload
    block = hashlib.blake2b(f"{seed}/{i}".encode(), digest_size=64).digest()
    return (block * (nbytes // 64 + 1))[:nbytes]


@pytest.fixture
def client(service):
    with ServiceClient(service.socket, service.layout) as c:
        yield c
        c.check_integrity()


def wait_stats(client: ServiceClient, pred, limit: float = 30.0) -> dict:
    """Poll stats until ``pred`` holds (the server notices a dead peer asynchronously)."""
    deadline = time.monotonic() + limit
    while True:
        s = client.stats()
        if pred(s) or time.monotonic() > deadline:
            return s
        time.sleep(0.02)


def test_two_engine_processes_share_prefixes_with_exact_bytes(service, worker, client):
    lay, ps = service.layout, service.layout.page_size
    tokens = list(range(1000, 1000 + 5 * ps + 2))  # 5 whole pages and a partial one
    w = worker("write", socket=service.socket, layout=lay.to_dict(), tokens=tokens, seed=7)
    assert (w["inserted"], w["duplicates"], len(w["pages"])) == (5, 0, 5)

    longer = tokens[:5 * ps] + list(range(9000, 9000 + 2 * ps))  # 2 pages nobody wrote
    r = worker("read", socket=service.socket, layout=lay.to_dict(), tokens=longer)
    assert r["num_pages"] == 5 and r["pages"] == w["pages"]
    assert [bytes.fromhex(x) for x in r["data"]] == [expected_page(7, i, lay.page_bytes) for i in range(5)]

    # A second writer sharing the first 3 pages: duplicates go back to free.
    other = tokens[:3 * ps] + list(range(5000, 5000 + 2 * ps))
    before = client.stats()
    w2 = worker("write", socket=service.socket, layout=lay.to_dict(), tokens=other, seed=8)
    assert (w2["inserted"], w2["duplicates"]) == (2, 3)
    after = client.stats()
    assert after["committed_pages"] == before["committed_pages"] + 2
    assert after["reserved_pages"] == after["locked_pages"] == 0
    # The test process reads the same bytes through its own mapping.
    hashes = page_hashes(other, ps)
    pages = client.acquire(hashes)
    assert pages[:3] == w["pages"][:3] and pages[3:] == w2["pages"][3:]
    got = [client.pool.read_page(p) for p in pages]
    client.release(hashes)
    assert got == [expected_page(7, i, lay.page_bytes) for i in range(3)] + \
        [expected_page(8, i, lay.page_bytes) for i in (3, 4)]


def test_mismatched_layout_is_refused_naming_every_field(service, client):
    lay = service.layout
    flipped = "layer_first" if lay.host_layout == "page_first" else "page_first"
    bad = lay.replace(num_layers=3, page_size=8, host_layout=flipped)
    before = client.stats()["errors"].get("contract", 0)
    with pytest.raises(ContractMismatch) as e:
        ServiceClient(service.socket, bad)
    diffs = {f: (ours, theirs) for f, ours, theirs in e.value.differences}
    assert set(diffs) == {"num_layers", "page_size", "host_layout", "fingerprint"}
    assert diffs["num_layers"] == (3, 2) and diffs["page_size"] == (8, 4)
    assert diffs["host_layout"] == (flipped, lay.host_layout)
    for f in diffs:
        assert f in str(e.value)
    assert client.stats()["errors"]["contract"] == before + 1
    assert client.lookup([]).num_pages == 0  # others keep being served


def test_sigkill_after_reserve_and_acquire_reclaims_everything(service, client):
    lay = service.layout
    tokens = list(range(300, 300 + 2 * lay.page_size))
    base = client.stats()
    args = {"socket": service.socket, "layout": lay.to_dict(), "tokens": tokens, "reserve": 3}
    here = os.path.dirname(__file__)
    proc = subprocess.Popen([sys.executable, os.path.join(here, "engine_worker.py"), "hold", json.dumps(args)],
                            stdout=subprocess.PIPE, text=True)
    try:
        held = json.loads(proc.stdout.readline())["held"]
        assert len(held["reserved"]) == 3 and len(held["acquired"]) == 2
        s = client.stats()
        assert s["clients"] == base["clients"] + 1
        assert s["reserved_pages"] == base["reserved_pages"] + 3
        assert s["locked_pages"] == base["locked_pages"] + 2
        client.check_integrity()
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()
    s = wait_stats(client, lambda s: s["clients"] == base["clients"])
    assert s["clients"] == base["clients"]
    assert s["reserved_pages"] == base["reserved_pages"] and s["locked_pages"] == base["locked_pages"]
    assert s["reclaimed"] == base["reclaimed"] + 3 + 2
    assert s["used_pages"] == s["committed_pages"] + s["reserved_pages"]
    client.check_integrity()
    # The committed pages stay cached for others.
    assert client.lookup(page_hashes(tokens, lay.page_size)).num_pages == 2


def test_eviction_and_out_of_pages_through_the_service(service, client):
    lay = service.layout
    hashes = page_hashes(list(range(7000, 7000 + 4 * lay.page_size)), lay.page_size)
    pages = client.reserve(4)
    for p in pages:
        client.pool.write_page(p, bytes(lay.page_bytes))
    client.commit(hashes, pages)
    assert client.acquire(hashes[:1]) == pages[:1]
    s = client.stats()
    unlocked = s["committed_pages"] - s["locked_pages"]
    grab = client.reserve(s["free_pages"] + unlocked)  # evicts every unlocked page
    s2 = client.stats()
    assert s2["evictions"] == s["evictions"] + unlocked
    assert s2["free_pages"] == 0 and s2["committed_pages"] == s2["locked_pages"] == 1
    assert client.lookup(hashes).num_pages == 1  # the locked head survives
    with pytest.raises(OutOfPages, match="0 free and 0 evictable"):
        client.reserve(1)
    client.cancel(grab)
    client.release(hashes[:1])
    assert client.stats()["free_pages"] == s2["capacity_pages"] - 1


def test_client_errors_map_to_typed_exceptions(service, client):
    with pytest.raises(ForeignPage, match=r"page id 999 is not in \[0, 16\)"):
        client.commit(page_hashes(list(range(service.layout.page_size)), service.layout.page_size), [999])
    with pytest.raises(ServiceError) as e:
        client.release([b"\0" * 16])
    assert e.value.kind == "not_acquired"
