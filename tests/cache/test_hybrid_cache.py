"""``HybridCache`` and ``GroupTiers`` without a model: group layouts at the published
shapes, one group's items on L1/L2/L3 under the record's counts, and the index-level
life of hybrid requests (windows kept per boundary, freed outside them, bytes held
equal to ``stored_bytes``), with ``check_integrity`` after every step."""
import pytest
import torch

from hicache.core.config import HiCacheConfig
from hicache.core.errors import ConfigError, IntegrityError, OutOfPages
from hicache.tiers.groups import GroupTiers, TierCounts
from hicache.core.hashing import page_hashes
from hicache.core.groups import LayerGroup, hybrid_layout, stored_bytes, swa_needed_pages, workload_bytes
from hicache.cache.hybrid import HybridCache, HybridPools, group_layout
from hicache.transfer.engine import TransferController
from hicache.core.layout import KVLayout
from hicache.core.shapes import model_shape
from hicache.storage import open_storage

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.mark.parametrize("name", ["gpt-oss-120b", "qwen3-next-80b-a3b"])
def test_group_layouts_at_the_real_shapes(name):
    lay = hybrid_layout(model_shape(name), 16)
    full = group_layout(lay, ("full",))
    parts = [full] + [group_layout(lay, (g.kind,), gi) for gi, g in enumerate(lay.groups) if g.kind != "full"]
    kv = sum(p.page_bytes for p in parts if p.kind != "rows")
    assert kv == lay.page_bytes  # the full and SWA parts split the KV planes exactly
    for p in parts:
        if p.kind == "rows":
            g = lay.groups[1]
            assert p.row_bytes == len(g.layers) * g.state_bytes == 36 * 1_097_728  # 38.6 MiB per snapshot
    assert all(lay.fingerprint() in p.model_id for p in parts) and len({p.fingerprint() for p in parts}) == len(parts)
    if name.startswith("qwen3-next"):  # another snapshot interval: another fingerprint for every part
        other = hybrid_layout(model_shape(name), 16, snapshot_every=16)
        theirs = {group_layout(other, (g.kind,), gi).fingerprint() for gi, g in enumerate(other.groups)}
        assert theirs.isdisjoint({p.fingerprint() for p in parts})


def test_draft_planes_travel_with_the_full_group():
    lay = KVLayout(model_id="m", num_layers=4, num_kv_heads=2, head_dim=8, page_size=4, draft_layers=1,
                   groups=(LayerGroup("swa", (0, 2), window=6), LayerGroup("full", (1, 3))))
    assert group_layout(lay, ("full",)).draft_layers == 1 and group_layout(lay, ("swa",), 0).draft_layers == 0


def _tiers(l3=True):
    lay = KVLayout(model_id="g", num_layers=1, num_kv_heads=1, head_dim=4, page_size=2, dtype="float32")
    st = open_storage("memory://", fingerprint=lay.fingerprint()) if l3 else None
    return GroupTiers("swa0", lay, 3, 2, "cpu", st)


def _settle(t, load=False):
    """Run ``t``'s plans on the one transfer engine (its pools registered as group 0's) and
    complete each, with the plans that follow, as ``HiCache.poll`` does."""
    tc = TransferController(t.device, t.host, t.storage)
    tc.add_group(t.group, t.device, t.host, t.storage)
    todo, jobs = t.take_plans(), {}
    if load:
        plan = t.load_plan()
        jobs[tc.submit(plan)] = plan
        t.started(tc.load_handle(next(iter(jobs))))
    while todo or jobs:
        jobs.update({tc.submit(p): p for p in todo})
        tc.wait_all()
        todo = [n for r in tc.finished() for n in t.complete(jobs.pop(r.job), r.ok, r.pages)]
    tc.close()


def _load(t):
    """Start ``t``'s pending copies as ``HybridCache`` does (one ``LoadPlan`` of the group on
    the one transfer engine), wait, complete."""
    _settle(t, load=True)


def _fill(t, dev, value):
    t.device.buffers[0][dev * 2:(dev + 1) * 2] = value
    t.device.buffers[1][dev * 2:(dev + 1) * 2] = -value


def test_group_tiers_move_items_and_drop_what_no_boundary_needs():
    t = _tiers()
    h = [bytes([i]) * 16 for i in range(4)]
    for i in range(3):
        dev = t.alloc(1)[0]
        _fill(t, dev, float(i + 1))
        assert t.keep(h[i], dev) == dev
        t.check_integrity()  # its L1 -> L2 copy is planned: the item stays pinned until it completes
        _settle(t)
        t.unpin(h[i])
        t.check_integrity()
    # L2 holds 2: keeping the third evicted the least recently used L2 copy (h0; L3 has it)
    assert list(t.l2) == [h[1], h[2]] and t.counts() == TierCounts(3, 2, 3)
    with pytest.raises(OutOfPages, match="swa0: asked for 4 L1 pages"):
        t.alloc(4)
    assert t.evict_l1(10) == 3 and t.counts() == TierCounts(0, 2, 3)
    assert t.take(h[0]) is None and t.fetch([h[0]]) == 1  # only L3 holds it: a miss until fetched
    t.check_integrity()
    _settle(t)
    dev = t.take(h[0])  # fetched from L3 onto L2; indexed on L1, its L2 -> L1 copy pending
    assert dev is not None and t.stats().taken_l3 == 1 and t.pending == {h[0]: (t.l2[h[0]], dev)}
    t.check_integrity()
    with pytest.raises(IntegrityError, match="pinned by a request"):
        t.cancel_pending(set())
    _load(t)  # the copy goes the way HybridCache starts it; its pin holds the item until observed
    assert torch.equal(t.device.buffers[0][dev * 2:(dev + 1) * 2], torch.full((2, 1, 4), 1.0))
    assert t.pins == {h[0]: 1} and not t.loading
    t.unpin(h[0])
    assert t.take(h[3]) is None
    t.check_integrity()
    t.ref(h[1])
    t.unref(h[1])
    assert h[1] not in t.l2 and t.storage.exists([t.l3_key(h[1])]) == [True]  # L2 made room for h0
    t.unref(h[1])  # no boundary needs it: gone from every tier, L3 included
    assert h[1] not in t.l1 and h[1] not in t.l2 and t.storage.exists([t.l3_key(h[1])]) == [False]
    assert t.stats().dropped == 1
    t.check_integrity()
    with pytest.raises(IntegrityError, match="no request owns"):
        t.free([t.l1[h[0]]])
    t.need[h[0]] = 0
    with pytest.raises(IntegrityError, match="count is below 1"):
        t.check_integrity()


def _cache(layout, url=""):
    cfg = HiCacheConfig.load(env={}, overrides={"storage.url": url, "pool.device_pages": "48",
                                                "policy.prefetch_policy": "wait_complete",
                                                "pool.host_pages": "64", "pool.device": "cpu",
                                                "policy.write_policy": "write_through"})
    return HybridCache(cfg, layout=layout)


def _serve(hc, rid, tokens, upto=None):
    """Prefill ``tokens`` (no model: the pools' bytes stay as they are), finish."""
    req = hc.new_request(rid, tokens)
    adm = hc.admit(req)
    req.advance(req.computed_tokens)
    n = (upto or len(tokens)) - req.computed_tokens
    req.alloc(n)
    req.commit(n)
    hc.check_integrity()
    req.finish()
    hc.check_integrity()
    hc.drain()  # the write-through (L1 -> L2 -> L3) completes as the engine polls
    hc.check_integrity()
    return adm


def test_gpt_oss_windows_per_boundary_at_the_real_shape():
    lay = hybrid_layout(model_shape("gpt-oss-120b"), 16)
    hc = _cache(lay, "memory://")
    a = list(range(1, 641))  # 40 pages: resumable only at its end, so 8 of 40 SWA pages are kept
    _serve(hc, "a", a)
    hc.drain()
    st = hc.stores[0]
    ha = page_hashes(a, 16)
    assert swa_needed_pages([40], 128, 16) == set(range(32, 40))
    assert set(st.l1) == set(st.l2) == st.stored == set(ha[32:40])
    want = stored_bytes(lay, 40)
    assert hc.held_bytes() == {"L1": want.hybrid, "L2": want.hybrid, "L3": want.hybrid}
    assert want.saved == pytest.approx(0.4)
    # a fork at page 20 hits 20 pages but floors to 0 (no boundary there), then records it
    b = a[:320] + list(range(1000, 1320))
    adm = _serve(hc, "b", b)
    assert (adm.hit, adm.resume, adm.limited_by) == (320, 0, 0)
    assert sorted(r.pages for r in hc.boundaries.values()) == [20, 40, 40]
    adm = _serve(hc, "c", a[:320] + [7] * 40)
    assert (adm.hit, adm.resume, adm.limited_by) == (320, 320, None)
    # c ends at page 22: its window (pages 14..21) shares 14..19 with the fork's
    assert st.counts() == TierCounts(8 * 3 + 2, 8 * 3 + 2, 8 * 3 + 2)
    hc.close()


def test_qwen3_next_snapshots_at_the_real_shape():
    lay = hybrid_layout(model_shape("qwen3-next-80b-a3b"), 16, snapshot_every=4)
    hc = _cache(lay)
    st = hc.stores[1]
    snap = [torch.arange(st.layout.row_bytes, dtype=torch.int32).to(torch.uint8)]
    req = hc.new_request("a", list(range(1, 200)))  # 12 pages + 7 tokens
    hc.admit(req)
    req.alloc(199)
    req.commit(199, {4: snap, 8: snap, 12: snap})
    req.finish()
    hc.check_integrity()
    assert st.copies_in_flight()  # kept on L1 and L2; their L1 -> L2 copies were never waited for
    hc.drain()
    assert st.counts() == TierCounts(3, 3, 0)
    r2 = hc.new_request("b", list(range(1, 150)) + [5] * 40)
    adm = hc.admit(r2)
    assert (adm.hit, adm.resume) == (144, 128) and torch.equal(adm.state.reshape(-1), snap[0])
    with pytest.raises(ValueError, match="bytes, the state group holds"):
        r2.advance(144, {9: [torch.zeros(8, dtype=torch.uint8)]})
    r2.abort()
    hc.check_integrity()
    hc.close()


def test_service_mode_without_a_service_says_to_start_it():
    """Service mode is served (tests/service/test_hybrid_service.py); with no service at the
    socket the full groups' HiCache refuses to start, naming the fix."""
    lay = hybrid_layout(model_shape("gpt-oss-120b"), 16)
    url = "hicache+unix:///tmp/no-such-hybrid.sock"
    cfg = HiCacheConfig.load(env={}, overrides={"storage.url": url, "pool.device": "cpu"})
    with pytest.raises(ConfigError) as e:
        HybridCache(cfg, layout=lay)
    msg = str(e.value)
    assert "no hicache service answers there" in msg and "start `hicache serve` first" in msg, msg


def test_check_integrity_finds_a_record_that_disagrees_with_a_store():
    lay = hybrid_layout(model_shape("gpt-oss-120b"), 16)
    hc = _cache(lay)
    _serve(hc, "a", list(range(1, 200)))
    rec = next(iter(hc.boundaries.values()))
    window, rec.swa[0] = rec.swa[0], ()
    with pytest.raises(IntegrityError, match="need counts disagree with the record"):
        hc.check_integrity()
    rec.swa[0] = window
    hc.check_integrity()
    hc.boundaries._users.pop((0, window[0]))  # the reverse index (item -> boundaries) loses an entry
    with pytest.raises(IntegrityError, match=f"item -> boundaries index disagrees .*{window[0].hex()[:8]}"):
        hc.check_integrity()
    hc.close()


# ------------------------------------------------------------- the record stays bounded
def _pooled(layout, url="", *, max_boundaries=4, device_pages=48, host_pages=64, **more):
    cfg = HiCacheConfig.load(env={}, overrides={"storage.url": url, "pool.device_pages": str(device_pages),
                                                "pool.host_pages": str(host_pages), "pool.device": "cpu",
                                                "policy.write_policy": "write_through",
                                                "policy.prefetch_policy": "wait_complete", **more})
    return HybridCache(cfg, layout=layout, pools=HybridPools(max_boundaries=max_boundaries))


def _prompt(i, pages=10, extra=0):
    return [(i * 7919 + j) % 50_000 + 1 for j in range(pages * 16)] + [60_000 + i] * extra


def test_the_record_is_capped_least_recently_used_first_at_ten_times_the_cap():
    lay = hybrid_layout(model_shape("gpt-oss-120b"), 16)
    hc = _pooled(lay, "memory://", max_boundaries=4)
    st = hc.stores[0]
    for i in range(40):  # 40 prompts of 10 pages: one end boundary each, 10x the cap
        if i == 20:  # resume from prompt 18's end: used, so it outlives 17 and 19
            adm = _serve(hc, "again18", _prompt(18, extra=5))
            assert (adm.hit, adm.resume) == (160, 160)
        _serve(hc, f"p{i}", _prompt(i))
        hc.drain()
        assert len(hc.boundaries) <= 4 and len(st.need) <= 4 * 8 and len(hc.boundaries._users) <= 4 * 8
        assert st.counts().l3 <= 4 * 8 and st.counts().l2 <= 4 * 8  # (L1 also holds running requests' pages)
        if i == 21:
            assert [hc.boundaries.get(k).pages for k in hc.boundaries] == [10] * 4
            assert page_hashes(_prompt(18), 16)[9] in hc.boundaries
        hc.check_integrity()
    # the last four ends remain; what they need is all the group holds, on every tier
    ends = [page_hashes(_prompt(i), 16) for i in range(36, 40)]
    assert list(hc.boundaries) == [h[9] for h in ends]
    assert set(st.l2) == st.stored == set(st.need) == {x for h in ends for x in h[2:10]}
    assert hc.stats().boundaries == 4 and hc.stats().forgotten == 36
    want = stored_bytes(lay, 10)  # the SWA group's L3 objects: four windows' worth
    assert st.counts().l3 * st.layout.page_bytes == 4 * (want.hybrid - want.every_layer_full // 2)
    # a forgotten one resumes from 0 (its full pages are still in L3); a kept one at its end
    assert _serve(hc, "old", _prompt(3, extra=5)).resume == 0
    assert _serve(hc, "new", _prompt(39, extra=5)).resume == 160
    hc.close()


def test_a_boundary_whose_full_prefix_left_every_tier_is_forgotten():
    lay = hybrid_layout(model_shape("gpt-oss-120b"), 16)
    hc = _pooled(lay, max_boundaries=64, device_pages=24, host_pages=24)  # no L3: 2 prompts fit on L2
    st = hc.stores[0]
    first = page_hashes(_prompt(0), 16)
    _serve(hc, "p0", _prompt(0))
    assert first[9] in hc.boundaries
    for i in range(1, 4):
        _serve(hc, f"p{i}", _prompt(i))
        hc.drain()
        hc.check_integrity()
        # every boundary left is resumable: its prefix is still in the index
        for key in hc.boundaries:
            i_of = next(j for j in range(i + 1) if page_hashes(_prompt(j), 16)[9] == key)
            assert hc.hc.match(_prompt(i_of))[0].tokens == 160
    assert first[9] not in hc.boundaries and not set(first) & (set(st.need) | set(st.l1) | set(st.l2))
    assert 0 < len(hc.boundaries) < 4 and hc.stats().forgotten == 4 - len(hc.boundaries)
    assert _serve(hc, "again", _prompt(0, extra=5)).resume == 0
    hc.close()


def test_full_prefixes_stored_in_l3_keep_their_boundaries_and_resume_from_l3():
    lay = hybrid_layout(model_shape("gpt-oss-120b"), 16)
    hc = _pooled(lay, "memory://", max_boundaries=64, device_pages=24, host_pages=24)
    for i in range(4):
        _serve(hc, f"p{i}", _prompt(i))
        hc.drain()
    assert len(hc.boundaries) == 4 and hc.stats().forgotten == 0  # pages left L1/L2, L3 holds them
    assert hc.hc.match(_prompt(0))[0].tokens == 0
    adm = _serve(hc, "again", _prompt(0, extra=5))
    assert (adm.hit, adm.resume) == (160, 160) and hc.stores[0].stats().taken_l3 == 8
    hc.check_integrity()
    hc.close()


def test_a_boundary_whose_window_left_every_tier_is_forgotten():
    lay = hybrid_layout(model_shape("gpt-oss-120b"), 16)
    hc = _pooled(lay)  # no L3
    _serve(hc, "p0", _prompt(0))
    _serve(hc, "p1", _prompt(1))
    st = hc.stores[0]
    st.evict_l2(100)  # SWA pages on L1 only now; the full groups keep everything
    assert hc.evict(8) and len(hc.boundaries) == 1 and hc.stats().forgotten == 1
    assert list(hc.boundaries) == [page_hashes(_prompt(1), 16)[9]] and st.stats().lost == 8
    assert len(st.need) == 8 and st.counts() == TierCounts(8, 0, 0)
    hc.check_integrity()
    hc.close()


def test_accounted_bytes_equal_held_bytes_with_swa_and_state_groups():
    """gpt-oss-120b's layers with a state group added (snapshots every 16 pages): the
    prefix's end (page 40) has no snapshot, so no window is kept there; what the tiers
    hold equals ``stored_bytes`` and ``workload_bytes`` of the sequence."""
    base = hybrid_layout(model_shape("gpt-oss-120b"), 16)
    lay = base.replace(groups=base.groups + (LayerGroup("state", (0, 1), state_bytes=4096, snapshot_every=16),))
    hc = _cache(lay, "memory://")
    snap = [torch.arange(2 * 4096, dtype=torch.int32).to(torch.uint8)]
    tokens = list(range(1, 40 * 16 + 8))
    req = hc.new_request("a", tokens)
    hc.admit(req)
    req.alloc(len(tokens))
    req.commit(None, {16: snap, 32: snap})
    req.finish()
    hc.drain()
    hc.check_integrity()
    want = stored_bytes(lay, 40)
    assert want == workload_bytes(lay, [(tokens, "")])
    assert hc.held_bytes() == {"L1": want.hybrid, "L2": want.hybrid, "L3": want.hybrid}
    assert sorted(b.pages for b in hc.boundaries.values()) == [16, 32]
    assert set(hc.stores[0].l2) == {page_hashes(tokens, 16)[p] for p in swa_needed_pages([16, 32], 128, 16)}
    hc.close()


def test_record_cap_must_be_positive():
    with pytest.raises(ConfigError, match=r"max_boundaries=0: .*positive count"):
        _pooled(hybrid_layout(model_shape("gpt-oss-120b"), 16), max_boundaries=0)


def test_a_boundary_follows_its_page_through_a_split_of_its_index_node():
    """A's boundaries 4 and 8 are anchored at A's one index node. Another request of the
    full groups' index shares 6 pages with A: the node is split at 6, the object A's
    boundaries point at keeps the lower part (pages 6..9). When that part leaves every
    tier, boundary 8 goes and boundary 4 stays: its page is in the upper part, still held."""
    base = hybrid_layout(model_shape("gpt-oss-120b"), 16)
    lay = base.replace(groups=base.groups + (LayerGroup("state", (0,), state_bytes=64, snapshot_every=4),))
    lru = {"policy.device_eviction": "lru", "policy.host_eviction": "lru"}
    hc = _pooled(lay, max_boundaries=64, **lru)  # no L3
    a = _prompt(0)
    req = hc.new_request("a", a)
    hc.admit(req)
    req.alloc(len(a))
    req.commit(None, {4: [torch.zeros(64, dtype=torch.uint8)], 8: [torch.ones(64, dtype=torch.uint8)]})
    req.finish()
    other = hc.hc.new_request("b", a[:96] + _prompt(1)[:64])  # (no SWA or state layers run for it)
    hc.hc.admit(other).wait()
    other.alloc(other.num_tokens - other.computed_tokens)
    other.commit()
    other.finish()
    hc.drain()
    ha = page_hashes(a, 16)
    assert set(hc.boundaries) == {ha[3], ha[7]} and hc.sweep() == 0
    hc.hc.evict(4)  # A's tail leaves the full groups' L1 (the least recently used leaf) ...
    assert hc.sweep() == 0
    hc.hc.evict_host(4)  # ... and L2 (the group stores keep every item)
    assert hc.hc.match(a)[0].tokens == 96
    assert hc.sweep() == 1 and set(hc.boundaries) == {ha[3]} and hc.stats().forgotten == 1
    hc.check_integrity()
    r = hc.new_request("again", a[:70])
    adm = hc.admit(r)
    assert (adm.hit, adm.resume) == (69 // 16 * 16, 64) and torch.equal(adm.state, torch.zeros(1, 64, dtype=torch.uint8))
    r.abort()
    hc.check_integrity()
    hc.close()


def test_a_limited_sweep_checks_every_boundary_over_several_calls():
    lay = hybrid_layout(model_shape("gpt-oss-120b"), 16)
    hc = _pooled(lay, max_boundaries=64)  # no L3
    for i in range(4):
        _serve(hc, f"p{i}", _prompt(i, pages=3))
    hc.drain()
    assert len(hc.boundaries) == 4 and hc.sweep(1) == 0  # nothing left a tier since the last sweep
    hc.hc.evict(100)
    hc.hc.evict_host(100)  # every full page gone from every tier (the group stores keep theirs)
    assert [hc.sweep(1) for _ in range(5)] == [1, 1, 1, 1, 0]
    assert len(hc.boundaries) == 0 and hc.stores[0].counts() == TierCounts(0, 0, 0)
    hc.check_integrity()
    hc.close()


@pytest.mark.parametrize("then", ["abort", "finish"])
def test_an_item_l3_lost_is_found_at_admission(then):
    """L3 loses one page of a window held only there (its own eviction, say): the admission
    sees the miss and floors to 0. A request that then computes the page again and ends at
    the same boundary stores it again (the boundary is whole again); one that aborts leaves
    the boundary to the next sweep, which forgets it and frees the rest of its window."""
    lay = hybrid_layout(model_shape("gpt-oss-120b"), 16)
    hc = _pooled(lay, "memory://", max_boundaries=64)
    _serve(hc, "p0", _prompt(0))
    hc.drain()
    st, h = hc.stores[0], page_hashes(_prompt(0), 16)
    st.evict_l1(100)
    st.evict_l2(100)
    assert st.counts() == TierCounts(0, 0, 8) and st.stats().lost == 0
    st.storage.delete([st.l3_key(h[5])])
    req = hc.new_request("again", _prompt(0, extra=5))
    adm = hc.admit(req)
    assert (adm.hit, adm.resume, adm.limited_by) == (160, 0, 0) and st.stats().lost == 1
    if then == "abort":
        req.abort()
        assert hc.sweep() == 1 and len(hc.boundaries) == 0 and st.counts() == TierCounts(0, 0, 0)
    else:
        req.advance(req.computed_tokens)
        req.alloc(5)
        req.commit()
        req.finish()
        hc.drain()  # the window's write-through to L2 and L3 completes as the engine polls
        assert hc.stats().forgotten == 0 and list(hc.boundaries) == [h[9]]
        assert st.stored == set(h[2:10]) and st.storage.exists([st.l3_key(h[5])]) == [True]
    hc.check_integrity()
    hc.close()


def test_a_snapshot_l3_lost_is_stored_again_by_a_request_that_recomputes_it():
    base = hybrid_layout(model_shape("gpt-oss-120b"), 16)
    lay = base.replace(groups=base.groups + (LayerGroup("state", (0,), state_bytes=64, snapshot_every=4),))
    hc = _pooled(lay, "memory://", max_boundaries=64)
    a = _prompt(0, pages=4)
    snap = {4: [torch.full((64,), 7, dtype=torch.uint8)]}
    req = hc.new_request("a", a)
    hc.admit(req)
    req.alloc(len(a))
    req.commit(None, snap)
    req.finish()
    hc.drain()
    st, key = hc.stores[2], page_hashes(a, 16)[3]
    st.evict_l1(10)
    st.evict_l2(10)
    st.storage.delete([st.l3_key(key)])
    again = hc.new_request("b", a + [1, 2, 3])
    adm = hc.admit(again)  # the snapshot is gone from L3: floor 0
    assert (adm.hit, adm.resume, adm.limited_by) == (64, 0, 2) and st.lost(key)
    again.advance(64, snap)  # the engine replays 0..64 and hands the snapshot at page 4 again
    again.alloc(3)
    again.commit()
    again.finish()
    hc.drain()
    assert not st.lost(key) and list(hc.boundaries) == [key] and hc.stats().forgotten == 0
    assert st.need == {key: 1} and key in st.stored
    third = hc.new_request("c", a + [4, 5, 6])
    adm = hc.admit(third)
    assert adm.resume == 64 and torch.equal(adm.state.reshape(-1), snap[4][0])
    third.abort()
    hc.check_integrity()
    hc.close()
