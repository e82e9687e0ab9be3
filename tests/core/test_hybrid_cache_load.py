"""``HybridCache``'s load back, waited on per layer group: a request admitted after its
prefix left L1 gets the full groups' pages through ``HiCache``'s layer-wise load and the
SWA window and the snapshot through one ``hybrid_copy.plan_load`` plan on the group
lanes of a ``HybridLoader``. With one group's copy held at a gate, every layer of the
other groups (and the snapshot, unless it is the one held) is ready while the held
group's layers still wait; once the gate opens, every page and the snapshot on L1 equal,
byte for byte, what the cold request wrote. At a toy shape and at the gpt-oss-120b and
qwen3-next-80b-a3b shapes, on the CPU and (marked ``gpu``) on CUDA pools."""
from __future__ import annotations

import threading
import time
import zlib

import pytest
import torch

import hicache.transfer.engine as tr
from hicache.core.config import HiCacheConfig
from hicache.core.errors import CacheStateError, TransferError
from hicache.core.hashing import page_hashes
from hicache.core.groups import LayerGroup, hybrid_layout
from hicache.cache.hybrid import HybridCache, HybridPools
from hicache.kernels.page_copy import PageCopier
from tests.helpers.gates import GroupGate as _Gate
from hicache.core.layout import KVLayout
from hicache.memory.pools import DevicePool
from hicache.core.shapes import model_shape

pytestmark = pytest.mark.usefixtures("one_torch_thread")
HAS_CUDA = torch.cuda.is_available()

TOY = KVLayout("toy-hybrid", num_layers=4, num_kv_heads=2, head_dim=8, page_size=4, dtype="float32",
               groups=(LayerGroup("swa", (0, 2), window=6), LayerGroup("full", (1, 3)),
                       LayerGroup("state", (0, 1), state_bytes=48, snapshot_every=2)))


def _layout(name: str) -> KVLayout:
    if name == "toy":
        return TOY
    return hybrid_layout(model_shape(name), 16, snapshot_every=4)


# (shape, prompt pages): the warm floor is the prompt's last full page; past gpt-oss's 128-token
# window (8 pages of 16), at qwen3-next's second snapshot (every 4 pages), past the toy's window.
CASES = [("toy", 5), ("gpt-oss-120b", 10), ("qwen3-next-80b-a3b", 8)]


def _cache(lay: KVLayout, device: str, copier: PageCopier | None = None, url: str = "") -> HybridCache:
    cfg = HiCacheConfig.load(env={}, overrides={"storage.url": url, "pool.device_pages": "24",
                                                "pool.host_pages": "32", "pool.device": device,
                                                "policy.write_policy": "write_through",
                                                "policy.prefetch_policy": "wait_complete"})
    return HybridCache(cfg, layout=lay, pools=HybridPools(state_device_slots=2, state_host_slots=3), copier=copier)


def _page(pool: DevicePool, plane: int, page: int) -> torch.Tensor:
    nb = pool.layout.planes[plane].page_bytes
    return pool.buffers[plane].view(-1).view(torch.uint8)[page * nb:(page + 1) * nb]


def _pages(pool: DevicePool, page: int) -> list[torch.Tensor]:
    return [_page(pool, k, page).cpu().clone() for k in range(len(pool.layout.planes))]


def _write(pool: DevicePool, page: int, gen: torch.Generator) -> list[torch.Tensor]:
    out = []
    for k in range(len(pool.layout.planes)):
        dst = _page(pool, k, page)
        src = torch.randint(0, 256, (dst.numel(),), dtype=torch.uint8, generator=gen)
        dst.copy_(src)
        out.append(src)
    return out


def _cold(hc: HybridCache, tokens: list[int], gen: torch.Generator) -> dict:
    """One request computes ``tokens`` (random bytes in every page it holds, a random snapshot
    at every state boundary and at its end) and finishes; everything then leaves L1.
    Returns the bytes written: ``full[p]``, ``swa[gi][p]`` per plane, ``state[b]``."""
    ps, n = hc.ps, len(tokens)
    req = hc.new_request("cold", tokens)
    assert hc.admit(req).hit == 0
    req.alloc(n)
    want: dict = {"full": {p: _write(hc.hc.device_pool, dev, gen) for p, dev in enumerate(req.inner.pages)},
                  "swa": {gi: {p: _write(hc.stores[gi].device, dev, gen) for p, (dev, _) in t.items()}
                          for gi, t in req.swa.items()}, "state": {}}
    snaps = {}
    if hc.state_gi is not None:
        g = hc.groups[hc.state_gi]
        ends = {b for b in range(1, n // ps + 1) if b % g.snapshot_every == 0} | {n // ps}
        for b in ends:
            snaps[b] = [torch.randint(0, 256, (g.state_bytes,), dtype=torch.uint8, generator=gen)
                        for _ in g.layers]
            want["state"][b] = torch.stack(snaps[b])
        snaps = {b: [t.to(hc.hc.device_pool.device) for t in s] for b, s in snaps.items()}
    req.commit(n, snaps)
    req.finish()
    hc.drain()
    hc.evict(10 ** 6)
    assert not any(s.l1 for s in hc.stores.values()) and not hc.hc.cache.stats().device_pages_cached
    hc.check_integrity()
    return want


def _check_bytes(hc: HybridCache, req, adm, want: dict) -> None:
    b = adm.resume // hc.ps
    for p, dev in enumerate(req.inner.pages[:b]):
        assert all(torch.equal(a, w) for a, w in zip(_pages(hc.hc.device_pool, dev), want["full"][p])), \
            f"full page {p} differs from the cold request's"
    for gi, table in req.swa.items():
        lo = max(0, b * hc.ps - hc.groups[gi].window + 1) // hc.ps
        assert sorted(p for p in table if p < b) == list(range(lo, b))  # the window, nothing more
        for p in range(lo, b):
            assert all(torch.equal(a, w) for a, w in zip(_pages(hc.stores[gi].device, table[p][0]),
                                                         want["swa"][gi][p])), f"SWA page {p} differs"
    if hc.state_gi is not None:
        assert torch.equal(adm.state.cpu(), want["state"][b]), f"the snapshot at {b} differs"




def _returns(fn, timeout: float = 30.0) -> bool:
    t = threading.Thread(target=fn, daemon=True)
    t.start()
    t.join(timeout)
    return not t.is_alive()


def _groups(lay: KVLayout) -> dict[str, int]:
    return {g.kind: gi for gi, g in enumerate(lay.groups)}


@pytest.mark.parametrize("name,pages", CASES)
def test_a_layer_waits_for_its_own_groups_load_only(name, pages, monkeypatch):
    lay = _layout(name)
    kinds = _groups(lay)
    for held in kinds:
        gate = _Gate()
        hc = _cache(lay, "cpu", gate)
        gen = torch.Generator().manual_seed(zlib.crc32(f"{name}-{held}".encode()))
        tokens = torch.randint(1, 50_000, (pages * hc.ps + 1,), generator=gen).tolist()
        want = _cold(hc, tokens, gen)
        if held == "full":  # HiCache's copy worker: its layer-wise load waits at the gate
            orig = tr._copy_pages
            monkeypatch.setattr(tr, "_copy_pages", lambda *a, **k: (gate.event.wait(60), orig(*a, **k)))
        else:
            gate.held = hc.stores[kinds[held]].device
        req = hc.new_request("warm", tokens)
        adm = hc.admit(req)
        assert (adm.hit, adm.resume) == (pages * hc.ps, pages * hc.ps)
        hc.check_integrity()  # the group loads in flight hold their items
        others = [gi for k, gi in kinds.items() if k != held]
        for gi in others:
            for i in lay.groups[gi].layers if lay.groups[gi].kind != "state" else ():
                assert _returns(lambda: adm.wait_layer(i)), f"{lay.groups[gi].kind} layer {i} waited for {held}"
        if held != "state" and "state" in kinds:
            assert _returns(lambda: adm.waits.wait_state()), f"the snapshot waited for {held}"
        stuck = (lambda: adm.waits.wait_state()) if held == "state" else \
            (lambda: adm.wait_layer(lay.groups[kinds[held]].layers[0]))
        assert not _returns(stuck, 0.3), f"a {held} layer did not wait for its own group's load"
        if held != "full":
            assert not adm.waits.group_ready(kinds[held]) and all(adm.waits.group_ready(g) for g in others)
        gate.event.set()
        adm.wait()
        _check_bytes(hc, req, adm, want)
        assert hc.poll() >= 0 and hc.settle_loads(wait=True) >= 0
        assert not any(s.loading or s.pending for s in hc.stores.values())
        hc.check_integrity()
        req.finish()
        hc.drain()
        hc.check_integrity()
        monkeypatch.undo()
        hc.close()


def test_a_second_admission_waits_for_the_load_of_an_item_it_shares():
    """Two requests read the same window: the second takes items the first's load is still
    bringing, so it waits on that load (per group) rather than reading them early."""
    gate = _Gate()
    hc = _cache(TOY, "cpu", gate)
    gen = torch.Generator().manual_seed(5)
    tokens = torch.randint(1, 97, (5 * 4 + 1,), generator=gen).tolist()
    want = _cold(hc, tokens, gen)
    gate.held = hc.stores[0].device
    a = hc.new_request("a", tokens)
    adm_a = hc.admit(a)
    b = hc.new_request("b", tokens)
    adm_b = hc.admit(b)
    assert adm_b.waits.loads[0] == adm_a.waits.loads[0]  # the same load: its items, not new copies
    assert not _returns(lambda: adm_b.wait_layer(0), 0.3)
    assert _returns(lambda: adm_b.wait_layer(1)) and _returns(adm_b.waits.wait_state)
    gate.event.set()
    adm_b.wait()
    _check_bytes(hc, b, adm_b, want)
    a.abort()  # the load is still observed (its pin) after the request that started it ended
    hc.check_integrity()
    b.finish()
    hc.drain()
    assert all(not s.pins for s in hc.stores.values())
    hc.check_integrity()
    hc.close()


def test_a_lowered_floor_gives_back_the_items_it_took(tmp_path):
    """Items taken for a boundary the floor then leaves (its snapshot's L3 object turned out
    corrupt) are un-taken before the load starts: no copy, their L1 pages freed, L2 keeps
    them; the window and snapshot at the lower floor load and equal the cold bytes."""
    hc = _cache(TOY, "cpu", url=f"file://{tmp_path}/l3")
    gen = torch.Generator().manual_seed(9)
    tokens = torch.randint(1, 97, (6 * 4 + 1,), generator=gen).tolist()
    want = _cold(hc, tokens, gen)
    hc.evict_host(10 ** 6)  # L3 only now
    hashes = page_hashes(tokens[:24], 4)
    st = hc.stores[2]
    path = st.storage._path(st.storage._full(st.l3_key(hashes[5])))[1]
    raw = bytearray(open(path, "rb").read())
    raw[-5] ^= 0x40  # the snapshot at page 6: listed, but its checksum fails when taken
    open(path, "wb").write(bytes(raw))
    req = hc.new_request("warm", tokens)
    adm = hc.admit(req)
    assert (adm.hit, adm.resume) == (24, 16)
    swa = hc.stores[0]
    assert all(h in swa.l2 and h not in swa.l1 for h in hashes[4:6])  # taken for page 6, given back
    assert set(swa.loading) == set(hashes[2:4]) and not swa.pending and set(st.loading) == {hashes[3]}
    hc.check_integrity()
    adm.wait()
    _check_bytes(hc, req, adm, want)
    req.finish()
    hc.drain()
    hc.check_integrity()
    hc.close()


def test_the_snapshot_row_is_given_back_at_the_first_advance():
    """The request pins the snapshot's L1 row from admission until its first advance (the
    engine reads it first), not for its whole life: a state pool of a few slots serves
    many running requests."""
    hc = _cache(TOY, "cpu")
    gen = torch.Generator().manual_seed(13)
    tokens = torch.randint(1, 97, (5 * 4 + 1,), generator=gen).tolist()
    want = _cold(hc, tokens, gen)
    req = hc.new_request("warm", tokens)
    adm = hc.admit(req)
    st, h = hc.stores[2], page_hashes(tokens[:20], 4)[4]
    assert torch.equal(adm.state, want["state"][5])
    assert hc.settle_loads(wait=True) == 3 and st.pins == {h: 1}  # 2 SWA pages and the snapshot loaded
    req.advance(req.computed_tokens)
    assert h not in st.pins
    with pytest.raises(CacheStateError, match="before its first commit or advance"):
        adm.state
    hc.check_integrity()
    req.finish()
    hc.check_integrity()
    hc.close()


def test_a_failed_group_load_raises_for_its_layers_and_stops_the_cache():
    class Failing(PageCopier):
        held = None

        def copy_pages(self, src, dst, *a, **kw):
            if dst is self.held:
                raise RuntimeError("swa copy broke")
            return super().copy_pages(src, dst, *a, **kw)

    cp = Failing()
    hc = _cache(TOY, "cpu", cp)
    gen = torch.Generator().manual_seed(11)
    tokens = torch.randint(1, 97, (5 * 4 + 1,), generator=gen).tolist()
    _cold(hc, tokens, gen)
    cp.held = hc.stores[0].device
    req = hc.new_request("warm", tokens)
    adm = hc.admit(req)
    adm.wait_layer(1)  # full: unaffected
    adm.waits.wait_state()
    with pytest.raises(TransferError, match=r"group 0 \(swa\) failed.*swa copy broke"):
        adm.wait_layer(0)
    with pytest.raises(TransferError, match="swa0: loading items .* failed"):
        hc.poll()
    with pytest.raises(TransferError, match="stops serving"):
        hc.admit(hc.new_request("next", tokens))
    hc.close()


# ----------------------------------------------------------------- on the GPU
def _poison(hc: HybridCache) -> None:
    """0xFF in every L1 pool: a page or snapshot the loads did not bring reads as that."""
    for pool in (hc.hc.device_pool, *(s.device for s in hc.stores.values())):
        for b in pool.buffers:
            b.view(-1).view(torch.uint8).fill_(0xFF)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("name,pages", CASES)
def test_gpu_warm_pages_and_snapshot_equal_the_cold_request(name, pages):
    """On CUDA pools (pinned L2, a CUDA stream per group, full layers through HiCache's
    stream): every layer waited for on the compute stream, then L1 equals what the cold
    request wrote, byte for byte. Full layer counts of both shapes (no reduction)."""
    lay = _layout(name)
    hc = _cache(lay, "cuda:0")
    gen = torch.Generator().manual_seed(zlib.crc32(f"gpu-{name}".encode()))
    tokens = torch.randint(1, 50_000, (pages * hc.ps + 1,), generator=gen).tolist()
    want = _cold(hc, tokens, gen)
    _poison(hc)
    req = hc.new_request("warm", tokens)
    adm = hc.admit(req)
    assert (adm.hit, adm.resume) == (pages * hc.ps, pages * hc.ps)
    assert hc.loader is not None and hc.loader.on_gpu
    for i in range(lay.num_layers):
        adm.wait_layer(i)  # device-side: the current stream waits, the host does not
    _check_bytes(hc, req, adm, want)  # reads on the current stream, after its waits
    req.finish()
    hc.drain()
    assert not any(s.loading for s in hc.stores.values())
    hc.check_integrity()
    hc.close()


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("name,pages", CASES[1:])
def test_gpu_full_layers_do_not_wait_for_a_held_group(name, pages):
    """The non-full group's stream is held by a device-side wait on a pinned flag (as
    tests/kernels/test_hybrid_copy.py holds one): the compute stream's waits on every
    full layer complete while the held group has not moved a byte; then the flag opens
    and every byte is right. A first, unheld round loads every kernel and captures
    HiCache's load graph (lazy loading would synchronise the context under the hold)."""
    from hicache.transfer.load_graph import _stream_wait_value_works, _wait_value64

    if not _stream_wait_value_works(torch.device("cuda")):
        pytest.fail("cuStreamWaitValue64 is unavailable: the hold cannot be placed")
    lay = _layout(name)
    hc = _cache(lay, "cuda:0")
    gen = torch.Generator().manual_seed(zlib.crc32(f"gpu-held-{name}".encode()))
    tokens = torch.randint(1, 50_000, (pages * hc.ps + 1,), generator=gen).tolist()
    want = _cold(hc, tokens, gen)
    held = next(gi for gi, g in enumerate(lay.groups) if g.kind != "full")
    fulls = [i for g in lay.groups if g.kind == "full" for i in g.layers]
    for rnd in ("warm-up", "held"):
        _poison(hc)
        torch.cuda.synchronize()
        flag = torch.zeros(1, dtype=torch.int64).pin_memory()
        if rnd == "held":
            _wait_value64(hc.loader.streams[held], flag.data_ptr(), 1)
        try:
            req = hc.new_request(rnd, tokens)
            adm = hc.admit(req)
            for i in fulls:
                adm.wait_layer(i)
            after = torch.cuda.Event()
            after.record()
            deadline = time.monotonic() + 20
            while not after.query() and time.monotonic() < deadline:
                time.sleep(0.001)
            assert after.query(), "the compute stream's wait on the full layers needed the held group's copy"
            if rnd == "held":
                assert not adm.waits.group_ready(held)
                st = hc.stores[held]
                for h in st.loading:
                    assert bool((_page(st.device, 0, st.l1[h]).cpu() == 0xFF).all()), "the held group moved"
        finally:
            flag.fill_(1)
        adm.wait()
        _check_bytes(hc, req, adm, want)
        req.finish()
        hc.drain()
        hc.evict(10 ** 6)
        hc.check_integrity()
    hc.close()
