"""A server killed with SIGKILL leaves its segment behind; the next server adopts or recreates it.

Real processes throughout: ``python -m hicache.node.server`` for the
servers, ``engine_worker.py`` for engines that write and read pages.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import NamedTuple

import pytest

from hicache.client.link import ServiceClient
from hicache.core.hashing import page_hashes
from hicache.core.layout import KVLayout
from hicache.memory.shm import shm_path

from .conftest import LAYOUTS, run_worker, unique_shm_name, wait_ready, write_config
from .engine_worker import payload

DRAFT = LAYOUTS["mla-layer_first-bytes-draft"]
MHA = LAYOUTS["mha-page_first"]


class Server(NamedTuple):
    proc: subprocess.Popen
    log: Path


@pytest.fixture
def node():
    """A socket path and segment name for the servers of one test; removes leftovers."""
    d = Path(tempfile.mkdtemp(prefix="hcr", dir="/tmp"))  # short: sun_path holds 107 bytes
    shm = unique_shm_name()
    procs: list[subprocess.Popen] = []

    def start(layout: KVLayout, n: int = 0) -> Server:
        write_config(d / f"h{n}.toml", layout, str(d / "e.sock"), shm)
        log = d / f"server{n}.log"
        with open(log, "w") as err:
            p = subprocess.Popen([sys.executable, "-m", "hicache.node.server", "--config", str(d / f"h{n}.toml"),
                                  "--set", "log_level=INFO"], stdout=err, stderr=err)
        procs.append(p)
        wait_ready(str(d / "e.sock"), layout, p, log)
        return Server(p, log)
    yield str(d / "e.sock"), shm, start, d
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()
    if os.path.exists(shm_path(shm)):
        os.unlink(shm_path(shm))
    shutil.rmtree(d, ignore_errors=True)


def kill(s: Server) -> None:
    s.proc.send_signal(signal.SIGKILL)
    assert s.proc.wait(30) == -signal.SIGKILL


def stop(s: Server, shm: str) -> None:
    s.proc.send_signal(signal.SIGTERM)
    assert s.proc.wait(30) == 0, s.log.read_text()
    assert not os.path.exists(shm_path(shm))


TOKENS = list(range(1000, 1000 + 4 * 4))  # 4 pages of page size 4


def test_segment_of_a_killed_server_is_adopted_with_its_pages(node):
    sock, shm, start, _ = node
    first = start(DRAFT)
    w = run_worker("write", socket=sock, layout=DRAFT.to_dict(), tokens=TOKENS, seed=5, draft_pages=3)
    assert w["inserted"] == 4
    kill(first)
    assert os.path.exists(shm_path(shm)) and os.path.exists(sock)  # what a crash leaves

    second = start(DRAFT, 1)
    assert f"L2 segment {shm} adopted (4 cached pages kept)" in second.log.read_text()
    with ServiceClient(sock, DRAFT, pin=False) as c:
        st = c.stats()
        assert st["segment_origin"] == "adopted" and st["committed_pages"] == 4 and st["free_pages"] == 12
        c.check_integrity()
    # The pages an engine wrote before the crash, byte for byte, and their draft validity.
    r = run_worker("read", socket=sock, layout=DRAFT.to_dict(), tokens=TOKENS)
    assert r["num_pages"] == 4 and r["pages"] == w["pages"]
    assert r["data"] == [payload(5, i, DRAFT.page_bytes).hex() for i in range(4)]
    assert run_worker("read", socket=sock, layout=DRAFT.to_dict(), tokens=TOKENS, need_draft=True)["num_pages"] == 3
    # The adopted server goes on serving: a new write, then a clean stop removes the segment.
    run_worker("write", socket=sock, layout=DRAFT.to_dict(), tokens=list(range(16)), seed=6)
    with ServiceClient(sock, DRAFT, pin=False) as c:
        assert c.stats()["committed_pages"] == 8
        c.check_integrity()
    stop(second, shm)


def test_segment_still_mapped_by_a_client_of_the_dead_server_is_recreated(node):
    sock, shm, start, _ = node
    first = start(MHA)
    run_worker("write", socket=sock, layout=MHA.to_dict(), tokens=TOKENS, seed=1)
    stale = ServiceClient(sock, MHA, pin=False)  # an engine that still maps the old segment
    try:
        kill(first)
        second = start(MHA, 1)
        log = second.log.read_text()
        assert f"L2 segment {shm} recreated (0 cached pages kept)" in log and "other processes still map it" in log
        with ServiceClient(sock, MHA, pin=False) as c:
            assert c.stats()["segment_origin"] == "recreated"
            assert c.lookup(page_hashes(TOKENS, MHA.page_size)).num_pages == 0
            # The stale engine's late writes land in the old (unlinked) pages, not in the new segment.
            stale.pool.write_page(0, b"\x5a" * MHA.page_bytes)
            assert c.pool.read_page(0) == bytes(MHA.page_bytes)
            c.check_integrity()
    finally:
        stale.close(send_bye=False)
    stop(second, shm)


def test_segment_of_another_layout_is_recreated_naming_the_difference(node):
    sock, shm, start, _ = node
    first = start(MHA)
    kill(first)
    second = start(DRAFT, 1)
    log = second.log.read_text()
    assert f"L2 segment {shm} recreated" in log and "for another layout or size" in log
    assert f"fingerprint: found {MHA.fingerprint()!r}, need {DRAFT.fingerprint()!r}" in log
    stop(second, shm)


def test_segment_of_a_live_server_is_still_refused(node):
    sock, shm, start, d = node
    first = start(MHA)
    write_config(d / "other.toml", MHA, str(d / "other.sock"), shm)
    r = subprocess.run([sys.executable, "-m", "hicache.node.server", "--config", str(d / "other.toml")],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert f"shared memory segment {shm_path(shm)} already exists and a live server owns it" in r.stderr
    assert not os.path.exists(d / "other.sock")
    with ServiceClient(sock, MHA, pin=False) as c:  # the live server is untouched
        assert c.stats()["segment_origin"] == "created"
    stop(first, shm)
