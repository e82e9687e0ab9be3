"""Value-level proof for hybrid models: a tiny model of sliding-window, full-attention
and recurrent (linear-attention) layers, served through ``HiCache`` by
``HybridRunner``, produces bit for bit the logits and tokens of a cold run when it
resumes from a hit floored to the last state snapshot: from L1, L2 and L3, with
chunked prefill ending mid-window and mid-page, and after preemption. SWA pages
outside the resume boundary's window are never read; corrupting one inside the
window, or a snapshot's values, changes the logits (the check can fail)."""
import pytest
import torch

from hicache.config import HiCacheConfig
from hicache.reference.hybrid_runner import HybridRunner, SnapshotStore, _l3_key
from hicache.reference.model_hybrid import HybridModel, HybridSpec, HybridState
from hicache.reference.model_spec import ModelSpec
from hicache.errors import PoolError
from hicache.hashing import page_hashes
from hicache.hicache import HiCache
from hicache.hybrid import LayerGroup, swa_needed_pages
from hicache.storage import open_storage

pytestmark = pytest.mark.usefixtures("one_torch_thread")

BASE = ModelSpec(vocab=97, hidden=32, num_layers=4, num_q_heads=4, mlp=48, num_kv_heads=2, head_dim=8, seed=3)
SPEC = HybridSpec(BASE, ("swa", "full", "linear", "swa", "full", "linear"), window=6, snapshot_every=2)
PS = 4
PROMPT = torch.randint(1, 97, (37,), generator=torch.Generator().manual_seed(1)).tolist()  # 9 pages + 1


@pytest.fixture(scope="module")
def model():
    return HybridModel(SPEC)


def make_cache(url="", host_layout="page_first", spec=SPEC):
    cfg = HiCacheConfig.load(env={}, overrides={
        "storage.url": url, "pool.device_pages": "64", "pool.host_pages": "128",
        "policy.prefetch_policy": "wait_complete", "pool.device": "cpu"})
    return HiCache(cfg, layout=spec.kv_layout(PS, host_layout))


@pytest.fixture(scope="module")
def cold(model):
    """Unchunked, nothing cached: the reference every warm run must equal."""
    out = {}
    for name, prompt in (("base", PROMPT), ("fork", PROMPT[:30] + [5, 6, 7, 8, 9, 10, 11])):
        hc = make_cache()
        out[name] = HybridRunner(hc, model, chunk_tokens=64).serve(name, prompt)
        assert out[name].hit == 0 and out[name].computed == len(prompt)
        hc.close()
    return out


def same(a, b):
    return torch.equal(a.last_logits, b.last_logits) and a.output == b.output


def test_layout_groups_and_pool_check(model):
    lay = SPEC.kv_layout(PS)
    assert lay.groups == (LayerGroup("swa", (0, 2), window=6), LayerGroup("full", (1, 3)),
                          LayerGroup("state", (0, 1), state_bytes=4 * 4 * 8 * 8, snapshot_every=2))
    assert lay.fingerprint() != BASE.kv_layout(PS).fingerprint()
    hc = HiCache(HiCacheConfig.load(env={}, overrides={"pool.device": "cpu", "storage.url": ""}),
                 layout=BASE.kv_layout(PS, model_id=SPEC.model_id))
    with pytest.raises(PoolError, match="groups"):
        HybridRunner(hc, model).serve("x", PROMPT)
    hc.close()


@pytest.mark.parametrize("host_layout", ["page_first", "layer_first"])
def test_warm_equals_cold_floored_to_the_snapshot_on_every_tier(model, cold, tmp_path, host_layout):
    hc = make_cache(f"file://{tmp_path}/l3", host_layout)
    # chunks end mid-page and mid-window (6 = W); snapshots written through to the same file:// L3
    run = HybridRunner(hc, model, chunk_tokens=6, state_url=f"file://{tmp_path}/l3")
    first = run.serve("first", PROMPT)
    assert (first.hit, first.resume) == (0, 0) and same(first, cold["base"])
    # 10: taken while decoding (37 prompt + 3 answer tokens), keyed by the answer's page hash
    assert sorted(s.pages for s in run.store._snaps.values()) == [2, 4, 6, 8, 10]

    # Hit: 9 pages (36 tokens, the last token is always computed); the last snapshot is at
    # page 8, so the floor is 32 and tokens 32..35 are replayed to advance the state.
    l1 = run.serve("l1", PROMPT)
    assert (l1.hit, l1.resume, l1.replayed, l1.computed) == (36, 32, 4, 5) and same(l1, cold["base"])

    hc.drain()
    hc.evict(10_000)
    hc.check_integrity()
    l2 = run.serve("l2", PROMPT)
    assert (l2.hit, l2.resume, l2.replayed) == (36, 32, 4) and same(l2, cold["base"])

    hc.drain()
    hc.evict(10_000)
    hc.evict_host(10_000)
    assert run.store.evict_host() == 5
    hc.check_integrity()
    l3 = run.serve("l3", PROMPT)
    assert (l3.hit, l3.resume, l3.replayed) == (36, 32, 4) and same(l3, cold["base"])
    assert run.store.l3_hits == 1 and run.store.storage.stats().hits >= 1
    run.store.check_integrity()
    hc.check_integrity()
    run.close()
    hc.close()


def test_a_fork_resumes_from_the_shared_snapshot(model, cold):
    hc = make_cache()
    run = HybridRunner(hc, model, chunk_tokens=5)
    run.serve("base", PROMPT)
    fork = run.serve("fork", PROMPT[:30] + [5, 6, 7, 8, 9, 10, 11])
    # 7 shared pages (28 tokens) hit; the snapshot at page 6 is the floor
    assert (fork.hit, fork.resume, fork.replayed) == (28, 24, 4) and same(fork, cold["fork"])
    hc.close()


def test_preempt_and_resume(model, cold):
    hc = make_cache()
    run = HybridRunner(hc, model, chunk_tokens=7)
    r = run.serve("p", PROMPT, preempt_at=21)  # preempted at 21 tokens (5 pages + 1): its state is dropped
    assert same(r, cold["base"])
    # re-admitted: a 20-token page hit plus its own partial page (21 exact tokens); without
    # its live state the floor is the snapshot at page 4, and tokens 16..20 are replayed
    assert (r.hit, r.resume, r.replayed) == (20, 16, 5) and r.computed == 37 + 5
    hc.close()


def test_no_snapshot_means_resume_from_zero(model, cold):
    hc = make_cache()
    run = HybridRunner(hc, model, chunk_tokens=64)
    run.serve("a", PROMPT)
    run.store._snaps.clear()
    r = run.serve("b", PROMPT)
    assert (r.hit, r.resume, r.replayed) == (36, 0, 36) and same(r, cold["base"])
    hc.close()


def _warm_with(model, mutate):
    """Cache PROMPT, apply ``mutate(hc, run, match)``, serve it again."""
    hc = make_cache()
    run = HybridRunner(hc, model, chunk_tokens=64)
    run.serve("a", PROMPT)
    m = hc.cache.match(PROMPT)
    assert m.device_tokens == 36
    mutate(hc, run, m)
    r = run.serve("b", PROMPT)
    run.store.check_integrity()
    hc.close()
    return r


def _poke_swa(page):
    def mutate(hc, run, m):
        k0 = hc.device_pool.plane("k", 0)  # KV layer 0 is an SWA layer
        k0[m.device_pages[page] * PS:(m.device_pages[page] + 1) * PS] = 1e4
    return mutate


def test_swa_pages_outside_the_window_are_never_read(model, cold):
    need = swa_needed_pages([8], SPEC.window, PS)  # resume at page 8: keys 27..31
    assert need == {6, 7}
    for page in range(8):
        r = _warm_with(model, _poke_swa(page))
        assert r.resume == 32
        assert same(r, cold["base"]) == (page not in need), page


def test_a_wrong_snapshot_changes_the_logits_and_a_corrupt_one_is_dropped(model, cold):
    def wrong(hc, run, m):
        h = page_hashes(PROMPT, PS)
        run.store.put(h[7], 8, [t + 1e-3 for t in run.store.get(h[7], 8).layers])  # valid digest, wrong values

    r = _warm_with(model, wrong)
    assert r.resume == 32 and not torch.equal(r.last_logits, cold["base"].last_logits)

    def corrupt(hc, run, m):
        run.store._snaps[page_hashes(PROMPT, PS)[7]].layers[0][0, 0, 0] += 1.0  # digest now fails

    runs = []
    r = _warm_with(model, lambda hc, run, m: (corrupt(hc, run, m), runs.append(run)))
    assert r.resume == 24 and same(r, cold["base"]) and runs[0].store.corrupt == 1


def test_state_must_be_at_the_chunk_start(model):
    hc = make_cache()
    with pytest.raises(ValueError, match="state is at token 4"):
        model.forward_chunk(hc.device_pool, [1, 2], 0, torch.arange(8), state=HybridState([], pos=4))
    st = HybridState.zeros(SPEC)
    st.check_integrity(SPEC)
    st.layers[0][0, 0, 0] = float("nan")
    with pytest.raises(AssertionError, match="non-finite"):
        st.check_integrity(SPEC)
    hc.close()


def test_snapshots_in_l3_are_verified(model, cold, tmp_path):
    url = f"file://{tmp_path}/l3"
    hc = make_cache(url)
    run = HybridRunner(hc, model, chunk_tokens=64, state_url=url)
    run.serve("a", PROMPT)
    run.store.evict_host()
    # flip one payload byte of the page-8 snapshot object: the codec's checksum catches it
    path = run.store.storage._path(run.store.storage._full(_l3_key(page_hashes(PROMPT, PS)[7])))[1]
    raw = bytearray(open(path, "rb").read())
    raw[-5] ^= 0x40
    open(path, "wb").write(bytes(raw))
    r = run.serve("b", PROMPT)
    assert (r.hit, r.resume) == (36, 24) and same(r, cold["base"])
    assert run.store.storage.stats().corrupt == 1 and run.store.l3_hits == 1
    run.store.check_integrity()
    # another layout's store (another window: another fingerprint) under the same prefix reads none
    other = HybridSpec(BASE, SPEC.pattern, window=5, snapshot_every=2).kv_layout(PS).fingerprint()
    foreign = SnapshotStore(other, run.store.shapes, open_storage(url, fingerprint=other,
                                                                 key_prefix=run.store.storage.key_prefix))
    assert foreign.has(page_hashes(PROMPT, PS)[5]) and foreign.get(page_hashes(PROMPT, PS)[5], 6) is None
    assert foreign.storage.stats().fingerprint_mismatch == 1
    foreign.storage.close()
    run.close()
    hc.close()


@pytest.mark.parametrize("snapshot_ends, resume", [(False, 32), (True, 36)])
def test_a_follow_up_turn_resumes_at_its_parents_end_with_end_snapshots(model, snapshot_ends, resume):
    p1 = PROMPT[:33]  # 8 pages + 1; with 3 answer tokens the sequence ends at 36 = page 9
    hc = make_cache()
    cold1 = HybridRunner(hc, model, chunk_tokens=64).serve("c1", p1)
    turn2 = p1 + cold1.output + [7, 8, 9, 10, 11, 12]
    cold2 = HybridRunner(make_cache(), model, chunk_tokens=64).serve("c2", turn2)
    hc.close()

    hc = make_cache()
    run = HybridRunner(hc, model, chunk_tokens=5, snapshot_ends=snapshot_ends)
    first = run.serve("t1", p1)
    assert same(first, cold1)
    pages = sorted(s.pages for s in run.store._snaps.values())
    assert pages == ([2, 4, 6, 8, 9] if snapshot_ends else [2, 4, 6, 8])  # 9: taken while decoding
    second = run.serve("t2", turn2)
    assert (second.hit, second.resume, second.replayed) == (36, resume, 36 - resume) and same(second, cold2)
    run.store.check_integrity()
    hc.close()


@pytest.mark.parametrize("scheme", ["memory", "redis"])
def test_snapshots_round_trip_through_other_l3_backends(model, cold, scheme, request):
    url = "memory://" if scheme == "memory" else request.getfixturevalue("redis_url")
    hc = make_cache()
    run = HybridRunner(hc, model, chunk_tokens=64, state_url=url)
    run.store.storage.clear()  # redis: a session-wide server
    run.serve("a", PROMPT)
    assert run.store.storage.stats().put_ok == 5 and run.store.evict_host() == 5
    hc.evict(10_000)  # pages stay in L2, snapshots come back from L3
    r = run.serve("b", PROMPT)
    assert (r.hit, r.resume, run.store.l3_hits) == (36, 32, 1) and same(r, cold["base"])
    run.store.check_integrity()
    run.close()
    hc.close()
