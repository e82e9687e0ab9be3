"""Zero-copy shared L2: engine A prefills and shares its pages through the
service's segment with the page-copy kernels; engine B, a separate process,
loads them from the segment into its L1 and gets logits bit-identical to
computing cold. Neither engine keeps a private L2 or copies a page payload
through the CPU (their pools' byte path is disabled in the worker)."""
from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from hicache.client.link import ServiceClient
from hicache.core.errors import ServiceError
from hicache.core.hashing import page_hashes
from hicache.memory.pools import DevicePool
from hicache.kernels.page_copy import default_copier

from .conftest import unique_shm_name, wait_ready, write_config
from .shared_l2_worker import PS, layout_of, load, store

WORKER = str(Path(__file__).with_name("shared_l2_worker.py"))


def _worker(mode: str, **args) -> dict:
    out = subprocess.run([sys.executable, WORKER, mode, json.dumps(args)], capture_output=True, text=True,
                         timeout=180)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture
def start_service():
    """``start(layout) -> socket path`` of a real service process; stopped (cleanly) after the test."""
    started: list[tuple[subprocess.Popen, Path]] = []

    def start(layout) -> str:
        d = Path(tempfile.mkdtemp(prefix="hcz", dir="/tmp"))  # short: sun_path holds 107 bytes
        sock = str(d / "e.sock")
        write_config(d / "h.toml", layout, sock, unique_shm_name())
        log = d / "server.log"
        with open(log, "w") as err:
            p = subprocess.Popen([sys.executable, "-m", "hicache.node.server", "--config", str(d / "h.toml")],
                                 stdout=err, stderr=err)
        started.append((p, d))
        wait_ready(sock, layout, p, log)
        return sock
    yield start
    for p, d in started:
        p.send_signal(signal.SIGTERM)
        assert p.wait(30) == 0, (d / "server.log").read_text()
        shutil.rmtree(d, ignore_errors=True)


def _alter_shared_page(sock: str, layout, prompt: list[int], i: int) -> None:
    """Reverse the bytes of the shared page holding page ``i`` of ``prompt`` (after an integrity check)."""
    with ServiceClient(sock, layout, pin=False) as c:
        c.check_integrity()
        h = page_hashes(prompt[:6 * PS], PS)[i:i + 1]
        page = c.acquire(h)[0]
        c.pool.write_page(page, bytes(reversed(c.pool.read_page(page))))
        c.release(h)


@pytest.mark.slow
@pytest.mark.parametrize("kind,host_layout", [("mha", "page_first"), ("mla", "layer_first")])
def test_engine_b_loads_engine_a_prefix_from_the_segment_bit_exact(kind, host_layout, start_service):
    layout = layout_of(kind, host_layout)
    sock = start_service(layout)
    prompt = list(range(3, 3 + 6 * PS + 1))  # 6 whole pages + 1 token
    a = _worker("prefill", socket=sock, kind=kind, host_layout=host_layout, prompt=prompt)
    assert (a["stored"], a["copied"]) == (6, 6)
    b = _worker("warm", socket=sock, kind=kind, host_layout=host_layout, prompt=prompt)
    assert b["loaded"] == 6 and b["locked_after"] == 0
    assert b["warm"] == b["cold"] == a["logits"]  # bit-identical float32 logits
    # A second prefill of the same prompt copies nothing: the shared pages are there.
    again = _worker("prefill", socket=sock, kind=kind, host_layout=host_layout, prompt=prompt)
    assert (again["stored"], again["copied"]) == (6, 0)
    with ServiceClient(sock, layout, pin=False) as c:
        st = c.stats()
        assert (st["committed_pages"], st["reserved_pages"], st["locked_pages"]) == (6, 0, 0)
    # The comparison can fail: with one shared page's bytes altered, B's logits differ.
    _alter_shared_page(sock, layout, prompt, 2)
    bad = _worker("warm", socket=sock, kind=kind, host_layout=host_layout, prompt=prompt)
    assert bad["loaded"] == 6 and bad["warm"] != bad["cold"] == a["logits"]


@pytest.mark.slow
@pytest.mark.parametrize("kind,host_layout", [("mha", "page_first"), ("mla", "layer_first")])
def test_hicache_in_service_mode_shares_l2_through_the_segment_bit_exact(kind, host_layout, start_service):
    """Two engine processes running ``HiCache`` with ``storage.url = hicache+unix://``:
    A's write-through backup lands in the segment (no private L2, no CPU copy); B's
    admission loads it layer by layer into scattered L1 pages; B's logits are
    bit-identical to B computing cold."""
    layout = layout_of(kind, host_layout)
    sock = start_service(layout)
    prompt = list(range(7, 7 + 6 * PS + 1))
    a = _worker("hc_prefill", socket=sock, kind=kind, host_layout=host_layout, prompt=prompt)
    assert (a["hit"], a["backup_pages"], a["private_l2_bytes"]) == (0, 6, 0)
    assert a["logits"] == a["cold"]
    b = _worker("hc_warm", socket=sock, kind=kind, host_layout=host_layout, prompt=prompt)
    assert (b["hit"], b["host_tokens"], b["load_back_pages"]) == (6 * PS, 6 * PS, 6)
    assert b["backup_pages"] == 0  # the pages B computed or loaded are in the segment already
    assert b["logits"] == b["cold"] == a["logits"]
    assert (b["locked_after"], b["reserved_after"]) == (0, 0)
    with ServiceClient(sock, layout, pin=False) as c:
        assert c.stats()["committed_pages"] == 6
    _alter_shared_page(sock, layout, prompt, 4)
    bad = _worker("hc_warm", socket=sock, kind=kind, host_layout=host_layout, prompt=prompt)
    assert bad["hit"] == 6 * PS and bad["logits"] != bad["cold"]  # the comparison can fail


def test_store_and_load_move_exact_pages_and_give_back_on_failure(start_service, monkeypatch):
    layout = layout_of("mha", "page_first")
    sock = start_service(layout)
    src, dst = DevicePool(layout, 8, "cpu"), DevicePool(layout, 8, "cpu")
    for i, buf in enumerate(src.buffers):
        buf.copy_(torch.arange(buf.numel(), dtype=buf.dtype).reshape(buf.shape) * (i + 1))
    h = page_hashes(list(range(4 * PS)), PS)
    with ServiceClient(sock, layout, pin=False) as c:
        copier = default_copier()
        assert store(c, src, [5, 1, 2], h[:3], copier=copier) == (0, 3, 3)
        assert load(c, h, dst, [0, 7, 3, 4]) == 3  # the fourth is not shared: page 4 untouched
        for s, d in zip([5, 1, 2], [0, 7, 3]):
            for key, t in src.page_view(s).items():
                assert torch.equal(dst.page_view(d)[key], t), (s, d, key)
        assert all(not bool(t.any()) for t in dst.page_view(4).values())
        # A copy that fails gives its reservation back; nothing is committed.
        def broken(*a, **k):
            raise RuntimeError("copy failed")
        monkeypatch.setattr(copier, "copy_pages", broken)
        with pytest.raises(RuntimeError, match="copy failed"):
            store(c, src, [0], h[3:], copier=copier)
        monkeypatch.undo()
        st = c.stats()
        assert (st["reserved_pages"], st["locked_pages"], st["committed_pages"]) == (0, 0, 3)
        with pytest.raises(ServiceError, match="bad_args"):
            load(c, [b"short"], dst, [0])
        c.check_integrity()
