"""Value-level proof for hybrid models: a tiny model of sliding-window, full-attention
and recurrent (linear-attention) layers, served through ``HybridCache`` by
``HybridRunner``, produces bit for bit the logits and tokens of a cold run when it
resumes from a hit floored to the last state snapshot: from L1, L2 and L3, with
chunked prefill ending mid-window and mid-page, and after preemption. The SWA
layers' pages and the snapshots live in the cache's group stores, which hold only
the pages inside some recorded boundary's window (counted per tier against
``swa_needed_pages``; the bytes held equal ``stored_bytes``' hybrid figure).
Corrupting a held page inside the window, or a snapshot's values, changes the
logits (the checks can fail)."""
import threading

import pytest
import torch

from hicache.core.config import HiCacheConfig
from hicache.core.errors import LayoutError, PoolError
from hicache.tiers.groups import TierCounts
from hicache.core.hashing import page_hashes
from hicache.core.groups import LayerGroup, stored_bytes, swa_needed_pages, workload_bytes
from hicache.cache.hybrid import HybridCache, HybridPools, group_layout
from tests.helpers.gates import GroupGate as _Gate
from hicache.reference.hybrid_runner import HybridRunner
from hicache.reference.model_hybrid import HybridModel, HybridSpec, HybridState
from hicache.reference.model_spec import ModelSpec
from hicache.storage import open_storage
from hicache.transfer import engine

pytestmark = pytest.mark.usefixtures("one_torch_thread")

BASE = ModelSpec(vocab=97, hidden=32, num_layers=4, num_q_heads=4, mlp=48, num_kv_heads=2, head_dim=8, seed=3)
SPEC = HybridSpec(BASE, ("swa", "full", "linear", "swa", "full", "linear"), window=6, snapshot_every=2)
SPARSE = HybridSpec(BASE, SPEC.pattern, window=6, snapshot_every=4)  # fewer boundaries: SWA pages to free
SWA_ONLY = HybridSpec(BASE, ("swa", "full", "swa", "full"), window=6)  # gpt-oss-like: no recurrent layer
PS = 4
PROMPT = torch.randint(1, 97, (37,), generator=torch.Generator().manual_seed(1)).tolist()  # 9 pages + 1
FORK = PROMPT[:30] + [5, 6, 7, 8, 9, 10, 11]
SWA_GI, STATE_GI = 0, 2  # SPEC's groups: swa (0, 2), full (1, 3), state


@pytest.fixture(scope="module")
def models():
    return {s: HybridModel(s) for s in (SPEC, SPARSE, SWA_ONLY)}


@pytest.fixture(scope="module")
def model(models):
    return models[SPEC]


def make_cache(url="", host_layout="page_first", spec=SPEC, pools=HybridPools(), device_pages=64, host_pages=128):
    cfg = HiCacheConfig.load(env={}, overrides={
        "storage.url": url, "pool.device_pages": str(device_pages), "pool.host_pages": str(host_pages),
        "policy.prefetch_policy": "wait_complete", "pool.device": "cpu", "policy.write_policy": "write_through"})
    return HybridCache(cfg, layout=spec.kv_layout(PS, host_layout), pools=pools)


@pytest.fixture(scope="module")
def cold(models):
    """Unchunked, nothing cached: the reference every warm run must equal."""
    out = {}
    for spec in (SPEC, SPARSE, SWA_ONLY):
        for name, prompt in (("base", PROMPT), ("fork", FORK)):
            hc = make_cache(spec=spec)
            r = out[spec, name] = HybridRunner(hc, models[spec], chunk_tokens=64).serve(name, prompt)
            assert r.hit == 0 and r.computed == len(prompt)
            hc.close()
    return out


def same(a, b):
    return torch.equal(a.last_logits, b.last_logits) and a.output == b.output


def clear_l3(hc):
    for st in [hc.hc.storage, *(s.storage for s in hc.stores.values())]:
        st.clear()


def test_group_layouts_fingerprints_and_pool_checks(model):
    lay = SPEC.kv_layout(PS)
    assert lay.groups == (LayerGroup("swa", (0, 2), window=6), LayerGroup("full", (1, 3)),
                          LayerGroup("state", (0, 1), state_bytes=4 * 4 * 8 * 8, snapshot_every=2))
    full, swa, state = (group_layout(lay, ("full",)), group_layout(lay, ("swa",), 0),
                        group_layout(lay, ("state",), 2))
    assert (full.num_layers, swa.num_layers, state.kind, state.row_bytes) == (2, 2, "rows", 2 * 4 * 4 * 8 * 8)
    other = SPARSE.kv_layout(PS)  # another snapshot interval: every part's fingerprint changes
    fps = {x.fingerprint() for x in (full, swa, state, group_layout(other, ("full",)),
                                     group_layout(other, ("swa",), 0), group_layout(other, ("state",), 2))}
    assert len(fps) == 6
    cfg = HiCacheConfig.load(env={}, overrides={"pool.device": "cpu", "storage.url": ""})
    with pytest.raises(LayoutError, match="layer groups"):
        HybridCache(cfg, layout=BASE.kv_layout(PS))
    hc = make_cache()
    with pytest.raises(PoolError, match="SWA group"):  # the full pool handed as the SWA pool
        model.forward_chunk(hc.hc.device_pool, [1, 2], 0, torch.arange(8), state=HybridState.zeros(SPEC),
                            swa=(hc.hc.device_pool, torch.arange(8)))
    with pytest.raises(PoolError, match="pass the SWA layers' pool"):  # the full layers' pool alone
        model.forward_chunk(hc.hc.device_pool, [1, 2], 0, torch.arange(8), state=HybridState.zeros(SPEC))
    hc.close()


def _tiers(hc, gi):
    hc.drain()  # the write-through (L1 -> L2 -> L3) completes as the engine polls
    return hc.stores[gi].counts()


@pytest.mark.parametrize("host_layout", ["page_first", "layer_first"])
def test_warm_equals_cold_floored_to_the_snapshot_on_every_tier(model, cold, tmp_path, host_layout):
    hc = make_cache(f"file://{tmp_path}/l3", host_layout)
    run = HybridRunner(hc, model, chunk_tokens=6)  # chunks end mid-page and mid-window (6 = W)
    first = run.serve("first", PROMPT)
    assert (first.hit, first.resume) == (0, 0) and same(first, cold[SPEC, "base"])
    # boundaries 2..10 (10: taken while decoding 37 prompt + 3 answer tokens), each held on all tiers
    assert sorted(b.pages for b in hc.boundaries.values()) == [2, 4, 6, 8, 10]
    assert _tiers(hc, STATE_GI) == TierCounts(5, 5, 5)
    hc.check_integrity()

    # Hit: 9 pages (36 tokens, the last token is always computed); the last snapshot is at
    # page 8, so the floor is 32 and tokens 32..35 are replayed for the SWA and state layers.
    l1 = run.serve("l1", PROMPT)
    assert (l1.hit, l1.resume, l1.replayed, l1.computed) == (36, 32, 4, 5) and same(l1, cold[SPEC, "base"])
    # ... and records that fork: page 9's window and a snapshot there, so later runs resume at 36
    assert sorted(b.pages for b in hc.boundaries.values()) == [2, 4, 6, 8, 9, 10]

    hc.drain()
    hc.evict(10_000)
    assert _tiers(hc, SWA_GI).l1 == _tiers(hc, STATE_GI).l1 == 0
    hc.check_integrity()
    l2 = run.serve("l2", PROMPT)
    assert (l2.hit, l2.resume, l2.replayed) == (36, 36, 0) and same(l2, cold[SPEC, "base"])

    hc.drain()
    hc.evict(10_000)
    hc.evict_host(10_000)
    assert _tiers(hc, SWA_GI)[:2] == _tiers(hc, STATE_GI)[:2] == (0, 0)
    hc.check_integrity()
    l3 = run.serve("l3", PROMPT)
    assert (l3.hit, l3.resume, l3.replayed) == (36, 36, 0) and same(l3, cold[SPEC, "base"])
    # the window at page 9 (pages 7, 8) and the snapshot there came back from L3
    assert hc.stores[SWA_GI].stats().taken_l3 == 2 and hc.stores[STATE_GI].stats().taken_l3 == 1
    assert hc.stores[STATE_GI].storage.stats().hits == 1
    hc.check_integrity()
    hc.close()




@pytest.mark.parametrize("held", [SWA_GI, STATE_GI])
def test_the_model_waits_for_each_groups_load_before_reading_it(model, cold, held, monkeypatch):
    """The loads are asynchronous: with the SWA window's (or the snapshot's) copy held and
    every L1 pool poisoned (0xFF: NaN), the served request waits; once the copy lands it
    equals the cold run bit for bit (a read before its copy would see the poison)."""
    gate = _Gate()
    hc = make_cache()
    monkeypatch.setattr(engine, "_copy_pages", gate.copy_pages)  # the one transfer engine's copies
    run = HybridRunner(hc, model, chunk_tokens=5)
    run.serve("a", PROMPT)
    hc.drain()
    hc.evict(10_000)
    for pool in (hc.hc.device_pool, *(s.device for s in hc.stores.values())):
        for b in pool.buffers:
            b.view(-1).view(torch.uint8).fill_(0xFF)
    gate.held = hc.stores[held].device
    out = {}
    t = threading.Thread(target=lambda: out.update(r=run.serve("b", PROMPT)), daemon=True)
    t.start()
    t.join(0.5)
    assert t.is_alive() and hc.stores[held].loading and not out, "served without waiting for the held copy"
    gate.event.set()
    t.join(60)
    assert (out["r"].hit, out["r"].resume) == (36, 32) and same(out["r"], cold[SPEC, "base"])
    hc.drain()
    hc.check_integrity()
    hc.close()


def test_a_fork_resumes_from_the_shared_snapshot(model, cold):
    hc = make_cache()
    run = HybridRunner(hc, model, chunk_tokens=5)
    run.serve("base", PROMPT)
    fork = run.serve("fork", FORK)
    # 7 shared pages (28 tokens) hit; the snapshot at page 6 is the floor
    assert (fork.hit, fork.resume, fork.replayed) == (28, 24, 4) and same(fork, cold[SPEC, "fork"])
    # the fork point (page 7) is recorded on the way: the next request sharing it resumes there
    # (the same prompt again hits 9 pages, no cached end: it floors to the snapshot at 8)
    again = run.serve("again", FORK)
    assert (again.hit, again.resume, again.replayed) == (36, 32, 4) and same(again, cold[SPEC, "fork"])
    third = run.serve("third", PROMPT[:30] + [12, 13, 14, 15, 16, 17, 18])
    assert (third.hit, third.resume, third.replayed) == (28, 28, 0)
    hc.check_integrity()
    hc.close()


def test_preempt_and_resume(model, cold):
    hc = make_cache()
    run = HybridRunner(hc, model, chunk_tokens=7)
    r = run.serve("p", PROMPT, preempt_at=21)  # preempted at 21 tokens (5 pages + 1): its state is dropped
    assert same(r, cold[SPEC, "base"])
    # re-admitted: a 20-token page hit plus its own partial page (21 exact tokens); without
    # its live state the floor is the snapshot at page 4, and tokens 16..20 are replayed
    assert (r.hit, r.resume, r.replayed) == (20, 16, 5) and r.computed == 37 + 5
    hc.check_integrity()
    hc.close()


def test_preempt_keeps_exact_accounting_without_a_state_group(models, cold):
    """gpt-oss-like (SWA + full): the preempted request's own partial page is kept in both
    groups, so it resumes at its exact 21 tokens and replays nothing."""
    hc = make_cache(spec=SWA_ONLY)
    run = HybridRunner(hc, models[SWA_ONLY], chunk_tokens=7)
    r = run.serve("p", PROMPT, preempt_at=21)
    assert (r.hit, r.resume, r.replayed, r.computed) == (20, 21, 0, 37) and same(r, cold[SWA_ONLY, "base"])
    # no state group: the only boundaries are the ends (preempted at page 5, finished at page 10)
    assert sorted(b.pages for b in hc.boundaries.values()) == [5, 10]
    # a new request hits 9 pages; boundary 9 is no cached prefix's end, so it floors to 5
    again = run.serve("again", PROMPT)
    assert (again.hit, again.resume, again.replayed) == (36, 20, 16) and same(again, cold[SWA_ONLY, "base"])
    hc.check_integrity()
    hc.close()


def test_forgotten_boundaries_free_everything_and_resume_from_zero(model, cold):
    hc = make_cache()
    run = HybridRunner(hc, model, chunk_tokens=64)
    run.serve("a", PROMPT)
    for key in list(hc.boundaries):
        hc.forget(key)
    assert _tiers(hc, SWA_GI) == _tiers(hc, STATE_GI) == TierCounts(0, 0, 0)
    hc.check_integrity()
    r = run.serve("b", PROMPT)
    assert (r.hit, r.resume, r.replayed) == (36, 0, 36) and same(r, cold[SPEC, "base"])
    hc.check_integrity()
    hc.close()


@pytest.mark.parametrize("chunk", [3, 5, 64])
def test_swa_pages_outside_every_window_are_not_held_and_bytes_match_the_accounting(models, cold, tmp_path,
                                                                                   chunk):
    """SPARSE snapshots every 4 pages: the record is boundaries 4 and 8 (the end, page 10,
    has no snapshot: it cannot resume, so its window is not kept); only their windows'
    SWA pages are held, on every tier, and the bytes held are ``stored_bytes``' and
    ``workload_bytes``' hybrid figure for the 10-page prefix (their defaults account no
    window at an end without a snapshot either)."""
    hc = make_cache(f"file://{tmp_path}/l3", spec=SPARSE)
    clear_l3(hc)
    run = HybridRunner(hc, models[SPARSE], chunk_tokens=chunk)
    assert same(run.serve("a", PROMPT), cold[SPARSE, "base"])
    hc.drain()
    need = swa_needed_pages([4, 8], SPARSE.window, PS)
    assert need == {2, 3, 6, 7} and sorted(b.pages for b in hc.boundaries.values()) == [4, 8]
    hashes = page_hashes(PROMPT + cold[SPARSE, "base"].output, PS)
    st = hc.stores[SWA_GI]
    assert set(st.l1) == set(st.l2) == st.stored == {hashes[p] for p in need}
    assert [st.storage.exists([st.l3_key(h)])[0] for h in hashes] == [p in need for p in range(10)]
    assert _tiers(hc, STATE_GI) == TierCounts(2, 2, 2)
    want = stored_bytes(SPARSE.kv_layout(PS), 10)
    assert want == workload_bytes(SPARSE.kv_layout(PS), [(PROMPT + cold[SPARSE, "base"].output, "")])
    assert hc.held_bytes() == {"L1": want.hybrid, "L2": want.hybrid, "L3": want.hybrid}
    assert want.hybrid < want.every_layer_full + want.state_every_page
    hc.check_integrity()
    hc.close()


def _warm_with(model, mutate):
    """Cache PROMPT, apply ``mutate(hc)``, serve it again."""
    hc = make_cache()
    run = HybridRunner(hc, model, chunk_tokens=64)
    run.serve("a", PROMPT)
    mutate(hc)
    r = run.serve("b", PROMPT)
    hc.check_integrity()
    hc.close()
    return r


def test_a_held_swa_page_inside_the_window_is_read(model, cold):
    h = page_hashes(PROMPT, PS)

    def poke(page):
        def mutate(hc):
            st = hc.stores[SWA_GI]
            dev = st.l1[h[page]]
            st.device.plane("k", 0)[dev * PS:(dev + 1) * PS] = 1e4
        return mutate

    # resume at page 8 reads keys 27..31: pages 6 and 7; pages 4 and 5 are held (the window
    # of boundary 6) but not read from there on; a poked page is rewritten by nobody
    for page, read in ((6, True), (7, True), (5, False), (4, False)):
        r = _warm_with(model, poke(page))
        assert r.resume == 32 and same(r, cold[SPEC, "base"]) == (not read), page


def test_a_wrong_snapshot_changes_the_logits(model, cold):
    def wrong(hc):
        st = hc.stores[STATE_GI]
        st.device.buffers[0][st.l1[page_hashes(PROMPT, PS)[7]]].view(torch.float32)[0] += 1e-3

    r = _warm_with(model, wrong)
    assert r.resume == 32 and not torch.equal(r.last_logits, cold[SPEC, "base"].last_logits)


def test_state_must_be_at_the_chunk_start(model):
    hc = make_cache()
    with pytest.raises(ValueError, match="state is at token 4"):
        model.forward_chunk(hc.hc.device_pool, [1, 2], 0, torch.arange(8), state=HybridState([], pos=4))
    st = HybridState.zeros(SPEC)
    st.check_integrity(SPEC)
    st.layers[0][0, 0, 0] = float("nan")
    with pytest.raises(AssertionError, match="non-finite"):
        st.check_integrity(SPEC)
    hc.close()


def test_snapshots_and_swa_pages_in_l3_are_verified(model, cold, tmp_path):
    url = f"file://{tmp_path}/l3"
    hc = make_cache(url)
    clear_l3(hc)
    run = HybridRunner(hc, model, chunk_tokens=64)
    run.serve("a", PROMPT)
    hc.drain()
    hc.evict(10_000)
    hc.evict_host(10_000)
    # flip one payload byte of the page-8 snapshot object: the codec's checksum catches it
    st = hc.stores[STATE_GI]
    key = st.l3_key(page_hashes(PROMPT, PS)[7])
    path = st.storage._path(st.storage._full(key))[1]
    raw = bytearray(open(path, "rb").read())
    raw[-5] ^= 0x40
    open(path, "wb").write(bytes(raw))
    r = run.serve("b", PROMPT)
    assert (r.hit, r.resume) == (36, 24) and same(r, cold[SPEC, "base"])
    assert st.storage.stats().corrupt == 1
    hc.check_integrity()
    # another layout's state group (another window: another fingerprint) reads none of them
    other = group_layout(HybridSpec(BASE, SPEC.pattern, window=5, snapshot_every=2).kv_layout(PS), ("state",), 2)
    foreign = open_storage(url, fingerprint=other.fingerprint(), key_prefix=st.storage.key_prefix)
    key6 = st.l3_key(page_hashes(PROMPT, PS)[5])
    assert foreign.exists([key6]) == [True] and foreign.get([key6], st.sizes) == [None]
    assert foreign.stats().fingerprint_mismatch == 1
    foreign.close()
    hc.close()


@pytest.mark.parametrize("snapshot_ends, resume", [(False, 32), (True, 36)])
def test_a_follow_up_turn_resumes_at_its_parents_end_with_end_snapshots(model, snapshot_ends, resume):
    p1 = PROMPT[:33]  # 8 pages + 1; with 3 answer tokens the sequence ends at 36 = page 9
    hc = make_cache()
    cold1 = HybridRunner(hc, model, chunk_tokens=64).serve("c1", p1)
    turn2 = p1 + cold1.output + [7, 8, 9, 10, 11, 12]
    hc2 = make_cache()
    cold2 = HybridRunner(hc2, model, chunk_tokens=64).serve("c2", turn2)
    hc.close()
    hc2.close()

    hc = make_cache()
    run = HybridRunner(hc, model, chunk_tokens=5, snapshot_ends=snapshot_ends)
    first = run.serve("t1", p1)
    assert same(first, cold1)
    snaps = sorted(b.pages for b in hc.boundaries.values() if b.snapshot)
    assert snaps == ([2, 4, 6, 8, 9] if snapshot_ends else [2, 4, 6, 8])  # 9: taken while decoding
    second = run.serve("t2", turn2)
    assert (second.hit, second.resume, second.replayed) == (36, resume, 36 - resume) and same(second, cold2)
    hc.check_integrity()
    hc.close()


@pytest.mark.parametrize("scheme", ["memory", "redis"])
def test_groups_round_trip_through_other_l3_backends(model, cold, scheme, request):
    url = "memory://" if scheme == "memory" else request.getfixturevalue("redis_url")
    hc = make_cache(url)
    clear_l3(hc)  # redis: a session-wide server
    run = HybridRunner(hc, model, chunk_tokens=64)
    run.serve("a", PROMPT)
    hc.drain()  # the snapshots' L2 -> L3 writes complete as the engine polls
    assert hc.stores[STATE_GI].storage.stats().put_ok == 5
    hc.evict(10_000)
    hc.evict_host(10_000)
    r = run.serve("b", PROMPT)
    assert (r.hit, r.resume) == (36, 32) and same(r, cold[SPEC, "base"])
    assert hc.stores[STATE_GI].stats().taken_l3 == 1
    hc.check_integrity()
    hc.close()


PROMPTS = [torch.randint(1, 97, (37,), generator=torch.Generator().manual_seed(100 + i)).tolist() for i in range(8)]


@pytest.fixture(scope="module")
def cold_many(model):
    out = []
    for i, prompt in enumerate(PROMPTS):
        hc = make_cache()
        out.append(HybridRunner(hc, model, chunk_tokens=64).serve(f"cold{i}", prompt))
        hc.close()
    return out


@pytest.mark.parametrize("url", ["", "file"])
def test_the_record_stays_bounded_under_pressure_and_what_remains_is_exact(model, cold_many, tmp_path, url):
    """A record of at most 3 boundaries and pools of 24 pages: 8 prompts record 5
    boundaries each (pages 2..10), 13x the cap, while their full pages crowd each other
    off L1 and L2. After every request the record holds at most 3 boundaries and the
    group stores only what they need (3 snapshots, 3 windows of 2 pages) on every tier;
    the last prompt's boundaries 6, 8, 10 remain and it resumes at its last snapshot
    bit for bit; an early prompt's boundaries are forgotten and it resumes from 0."""
    hc = make_cache(f"file://{tmp_path}/l3" if url else "", pools=HybridPools(max_boundaries=3),
                    device_pages=24, host_pages=24)
    run = HybridRunner(hc, model, chunk_tokens=5)
    swa, state = hc.stores[SWA_GI], hc.stores[STATE_GI]
    for i, prompt in enumerate(PROMPTS):
        assert same(run.serve(f"p{i}", prompt), cold_many[i])
        hc.drain()
        assert len(hc.boundaries) <= 3 and len(state.need) <= 3 and len(swa.need) <= 3 * 2
        assert max(state.counts()) <= 3 and max(swa.counts()[1:]) <= 3 * 2
        hc.check_integrity()
    assert hc.stats().forgotten == 8 * 5 - 3
    assert sorted(b.pages for b in hc.boundaries.values()) == [6, 8, 10]
    last = run.serve("last", PROMPTS[-1])
    assert (last.hit, last.resume, last.replayed) == (36, 32, 4) and same(last, cold_many[-1])
    first = run.serve("first", PROMPTS[0])
    assert first.resume == 0 and same(first, cold_many[0])
    hc.check_integrity()
    hc.close()
