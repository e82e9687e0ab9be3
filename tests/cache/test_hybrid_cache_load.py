"""``HybridCache``'s load back on the one transfer engine: a request admitted after its
prefix left L1 gets the full groups' pages through ``HiCache``'s layer-wise load and each
group's SWA window and snapshot through a ``LoadPlan`` of that group, queued ahead of it
on the same lane (the copy thread; on a GPU the copy stream, each load one CUDA-graph replay).
With one load held at a gate, every layer of the loads queued before it is ready while its
own layers wait; once the gate opens, every page and the snapshot on L1 equal, byte for
byte, what the cold request wrote. At a toy shape and at the gpt-oss-120b and
qwen3-next-80b-a3b shapes, on the CPU and (marked ``gpu``) on CUDA pools."""
from __future__ import annotations

import threading
import zlib

import pytest
import torch

import hicache.transfer.engine as tr
from hicache.core.config import HiCacheConfig
from hicache.core.errors import CacheStateError, TransferError
from hicache.core.hashing import page_hashes
from hicache.core.groups import LayerGroup, hybrid_layout
from hicache.cache.hybrid import HybridCache, HybridPools
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


def _cache(lay: KVLayout, device: str, url: str = "") -> HybridCache:
    cfg = HiCacheConfig.load(env={}, overrides={"storage.url": url, "pool.device_pages": "24",
                                                "pool.host_pages": "32", "pool.device": device,
                                                "policy.write_policy": "write_through",
                                                "policy.prefetch_policy": "wait_complete"})
    return HybridCache(cfg, layout=lay, pools=HybridPools(state_device_slots=2, state_host_slots=3))


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


def _gate(monkeypatch, pool) -> _Gate:
    """The one engine's copies into ``pool`` wait at the returned gate."""
    gate = _Gate()
    gate.held = pool
    monkeypatch.setattr(tr, "_copy_pages", gate.copy_pages)
    return gate


@pytest.mark.parametrize("name,pages", CASES)
def test_a_layer_waits_only_for_the_loads_queued_up_to_its_own(name, pages, monkeypatch):
    lay = _layout(name)
    kinds = _groups(lay)
    order = [k for k, _ in sorted(kinds.items(), key=lambda kv: kv[1]) if k != "full"] + ["full"]  # the lane's
    for held in kinds:
        hc = _cache(lay, "cpu")
        gen = torch.Generator().manual_seed(zlib.crc32(f"{name}-{held}".encode()))
        tokens = torch.randint(1, 50_000, (pages * hc.ps + 1,), generator=gen).tolist()
        want = _cold(hc, tokens, gen)
        gate = _gate(monkeypatch, hc.hc.device_pool if held == "full" else hc.stores[kinds[held]].device)
        req = hc.new_request("warm", tokens)
        adm = hc.admit(req)
        assert (adm.hit, adm.resume) == (pages * hc.ps, pages * hc.ps)
        hc.check_integrity()  # the group loads in flight hold their items
        ready = order[:order.index(held)]
        for k in ready:
            for i in lay.groups[kinds[k]].layers if k != "state" else ():
                assert _returns(lambda: adm.wait_layer(i)), f"{k} layer {i} waited for the held {held} load"
        if "state" in ready:
            assert _returns(adm.wait_state), f"the snapshot waited for the held {held} load"
        stuck = adm.wait_state if held == "state" else (lambda: adm.wait_layer(lay.groups[kinds[held]].layers[0]))
        assert not _returns(stuck, 0.3), f"a {held} layer did not wait for its own group's load"
        gate.event.set()
        adm.wait()
        _check_bytes(hc, req, adm, want)
        hc.drain()
        assert not any(s.loading or s.pending for s in hc.stores.values())
        hc.check_integrity()
        req.finish()
        hc.drain()
        hc.check_integrity()
        monkeypatch.undo()
        hc.close()


def test_a_second_admission_waits_for_the_load_of_an_item_it_shares(monkeypatch):
    """Two requests read the same window: the second takes items the first's load is still
    bringing, so it waits on that load rather than reading them early."""
    hc = _cache(TOY, "cpu")
    gen = torch.Generator().manual_seed(5)
    tokens = torch.randint(1, 97, (5 * 4 + 1,), generator=gen).tolist()
    want = _cold(hc, tokens, gen)
    gate = _gate(monkeypatch, hc.stores[0].device)
    a = hc.new_request("a", tokens)
    adm_a = hc.admit(a)
    b = hc.new_request("b", tokens)
    adm_b = hc.admit(b)
    assert adm_b.loads[0] == adm_a.loads[0]  # the same load: its items, not new copies
    assert not _returns(lambda: adm_b.wait_layer(0), 0.3)
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
    hc.drain()
    assert st.pins == {h: 1} and not any(s.loading for s in hc.stores.values())  # the loads' pins released
    req.advance(req.computed_tokens)
    assert h not in st.pins
    with pytest.raises(CacheStateError, match="before its first commit or advance"):
        adm.state
    hc.check_integrity()
    req.finish()
    hc.check_integrity()
    hc.close()


def test_a_failed_group_load_raises_for_its_layers_and_stops_the_cache(monkeypatch):
    hc = _cache(TOY, "cpu")
    gen = torch.Generator().manual_seed(11)
    tokens = torch.randint(1, 97, (5 * 4 + 1,), generator=gen).tolist()
    _cold(hc, tokens, gen)
    real, held = tr._copy_pages, hc.stores[0].device

    def failing(src, dst, *a, **kw):
        if dst is held:
            raise RuntimeError("swa copy broke")
        return real(src, dst, *a, **kw)
    monkeypatch.setattr(tr, "_copy_pages", failing)
    req = hc.new_request("warm", tokens)
    adm = hc.admit(req)
    adm.wait_layer(1)  # full: unaffected
    with pytest.raises(RuntimeError, match="swa copy broke"):
        adm.wait_layer(0)
    with pytest.raises(TransferError, match="layer group 0's items .* failed"):
        hc.poll()
    with pytest.raises(TransferError, match="refuses to serve"):
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
    """On CUDA pools (pinned L2; the full groups' load, then each group's, on the one copy
    stream, each one CUDA-graph replay): every layer waited for on the compute stream, then L1 equals what the cold
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
    graphs = hc.hc.transfers._group_graphs  # every group's load went through its captured graph
    assert set(graphs) == set(hc.stores) and hc.hc.transfers._graph is not None
    for i in range(lay.num_layers):
        adm.wait_layer(i)  # device-side: the current stream waits, the host does not
    _check_bytes(hc, req, adm, want)  # reads on the current stream, after its waits
    req.finish()
    hc.drain()
    assert not any(s.loading for s in hc.stores.values())
    hc.check_integrity()
    hc.close()
