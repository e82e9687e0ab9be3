"""Hybrid layouts (``hicache.core.groups``): layer groups in ``KVLayout`` and its fingerprint,
the resumable floor against a brute-force oracle over every holding pattern, SWA
pages that may be freed, and the bytes a hybrid stores at the real shapes."""
import itertools

import pytest

from hicache.core.errors import LayoutError
from hicache.core.groups import (LayerGroup, gdn_state_bytes, hybrid_layout, resumable_floor, snapshot_boundaries,
                            stored_bytes, swa_needed_pages, workload_bytes)
from hicache.core.layout import KVLayout
from hicache.core.shapes import model_shape, model_shapes

SWA = lambda w, *layers: LayerGroup("swa", layers, window=w)  # noqa: E731
FULL = lambda *layers: LayerGroup("full", layers)  # noqa: E731
STATE = lambda every, n=1, b=64: LayerGroup("state", tuple(range(n)), state_bytes=b, snapshot_every=every)  # noqa: E731


def small(**kw):
    return KVLayout(model_id="m", num_layers=4, num_kv_heads=2, head_dim=8, page_size=4, **kw)


# ------------------------------------------------------------------ layout
def test_groups_absent_keep_every_fingerprint_and_dict():
    for m in model_shapes():
        lay = m.kv_layout(16)
        assert "groups" not in lay.contract_fields()
        assert lay.replace(groups=()).fingerprint() == lay.fingerprint()
        assert KVLayout.from_dict(lay.to_dict()) == lay


def test_groups_enter_the_fingerprint_and_round_trip():
    g = (SWA(128, 0, 2), FULL(1, 3))
    lay = small(groups=g)
    assert lay.contract_fields()["groups"] == [["swa", [0, 2], 128, 0, 0], ["full", [1, 3], 0, 0, 0]]
    assert KVLayout.from_dict(lay.to_dict()) == lay and lay.groups == g
    fps = {small().fingerprint(), lay.fingerprint(), small(groups=(SWA(64, 0, 2), FULL(1, 3))).fingerprint(),
           small(groups=(SWA(128, 1, 3), FULL(0, 2))).fingerprint(),
           small(groups=(FULL(0, 1, 2, 3), STATE(4))).fingerprint(),
           small(groups=(FULL(0, 1, 2, 3), STATE(8))).fingerprint(),
           small(groups=(FULL(0, 1, 2, 3), STATE(8, b=65))).fingerprint()}
    assert len(fps) == 7
    with pytest.raises(Exception) as e:
        small().check_compatible(lay)
    assert "groups" in str(e.value)


@pytest.mark.parametrize("groups, says", [
    ((SWA(128, 0, 2),), "cover layers 0 .. 3 exactly once"),
    ((SWA(128, 0, 1, 2), FULL(2, 3)), "exactly once"),
    ((SWA(0, 0, 2), FULL(1, 3)), "window in [1"),
    ((LayerGroup("full", (0, 1, 2, 3), window=5),), "has no window"),
    ((FULL(0, 1, 2, 3), STATE(0)), "snapshot_every"),
    ((FULL(0, 1, 2, 3), STATE(2, b=0)), "state_bytes"),
    ((FULL(0, 1, 2, 3), LayerGroup("state", (1, 2), state_bytes=4, snapshot_every=1)), "0 .. n-1"),
    ((FULL(0, 1, 2, 3), STATE(2), STATE(4)), "at most one state group"),
    ((LayerGroup("mamba", (0, 1, 2, 3)),), "kind must be"),
    ((LayerGroup("full", ()),), "non-empty"),
    ((LayerGroup("full", (0, 1, 2, 3), state_bytes=9),), "for state groups"),
])
def test_bad_groups_are_named(groups, says):
    with pytest.raises(LayoutError) as e:
        small(groups=groups)
    assert says in str(e.value) and e.value.field == "groups"


def test_real_hybrid_layouts():
    oss = hybrid_layout(model_shape("gpt-oss-120b"), 16)
    assert [g.kind for g in oss.groups] == ["swa", "full"]
    assert oss.groups[0].layers == tuple(range(0, 36, 2)) and oss.groups[0].window == 128
    assert oss.groups[0].window_pages(16) == 8 and oss.groups[0].window_pages(1) == 127
    nxt = hybrid_layout(model_shape("qwen3-next-80b-a3b"), 16, snapshot_every=4)
    assert [g.kind for g in nxt.groups] == ["full", "state"] and nxt.num_layers == 12
    st = nxt.groups[1]
    assert len(st.layers) == 36 and st.snapshot_every == 4
    # 32 value heads x 128 x 128 recurrent matrix + 3 conv taps x (2 x 16 x 128 + 32 x 128) channels, bf16
    assert st.state_bytes == (32 * 128 * 128 + 3 * 8192) * 2 == 1_097_728
    assert gdn_state_bytes(16, 32, 128, 128, 4, 4) == 2 * st.state_bytes
    fps = {oss.fingerprint(), nxt.fingerprint(), model_shape("gpt-oss-120b").kv_layout(16).fingerprint(),
           model_shape("qwen3-next-80b-a3b").kv_layout(16).fingerprint(),
           hybrid_layout(model_shape("qwen3-next-80b-a3b"), 16, snapshot_every=8).fingerprint()}
    assert len(fps) == 5
    with pytest.raises(LayoutError, match="llama-3.1-8b"):
        hybrid_layout(model_shape("llama-3.1-8b"), 16)


# ------------------------------------------------------------------- floor
def oracle(groups, ps, holds):
    """The floor by definition: the largest b whose needed (group, page) set is held."""
    n = len(holds[0])
    for b in range(n, -1, -1):
        ok = True
        for g, row in zip(groups, holds):
            if b == 0:
                break
            if g.kind == "full":
                need = range(b)
            elif g.kind == "swa":
                first_key = max(0, b * ps - g.window + 1)  # the oldest key the query at b*ps sees
                need = [p for p in range(b) if (p + 1) * ps > first_key]
            else:
                need = [b - 1]
            ok = ok and all(row[p] for p in need)
        if ok:
            return b
    raise AssertionError("boundary 0 is always resumable")


CASES = [
    ((FULL(0),), 4),
    ((SWA(1, 0),), 4),
    ((SWA(5, 0),), 4),
    ((SWA(8, 0),), 4),
    ((SWA(9, 0),), 4),
    ((SWA(3, 0),), 1),
    ((SWA(6, 0), FULL(1)), 4),
    ((FULL(0), STATE(2)), 4),
    ((SWA(6, 0), FULL(1), STATE(1)), 4),
]


@pytest.mark.parametrize("groups, ps", CASES)
def test_floor_matches_the_oracle_on_every_holding(groups, ps):
    n = 5
    rows = list(itertools.product((False, True), repeat=n))
    count = 0
    for holds in itertools.product(rows, repeat=len(groups)):
        got = resumable_floor(groups, ps, holds)
        want = oracle(groups, ps, holds)
        assert (got.pages, got.tokens) == (want, want * ps), (holds, got)
        assert (got.limited_by is None) == (want == n)
        count += 1
    assert count == 32 ** len(groups)


def test_floor_limited_by_names_the_group_and_swa_window_pages():
    g = (SWA(9, 0), FULL(1))
    # window 9 at page 4: resuming at page b needs pages b-2, b-1 (keys from b*4-8)
    assert resumable_floor(g, 4, [[False, False, False, True, True], [True] * 5]) == (5, 20, None)
    assert resumable_floor(g, 4, [[False, False, False, False, True], [True] * 5]) == (0, 0, 0)
    assert resumable_floor(g, 4, [[True] * 5, [True, True, True, False, True]]) == (3, 12, 1)
    assert resumable_floor(g, 4, [[], []]) == (0, 0, None)


def test_floor_exact_accounting_of_a_partial_page():
    full, hyb = (FULL(0),), (FULL(0), STATE(2))
    assert resumable_floor(full, 4, [[True] * 3], exact_tokens=14).tokens == 14
    assert resumable_floor(full, 4, [[True, False, True]], exact_tokens=14).tokens == 4
    # with state: the partial page is kept only while the request holds its own live state
    assert resumable_floor(hyb, 4, [[True] * 4, [False, True, False, True]], exact_tokens=18,
                           live_state_tokens=18).tokens == 18
    assert resumable_floor(hyb, 4, [[True] * 4, [False, True, False, True]], exact_tokens=18).tokens == 16
    assert resumable_floor(hyb, 4, [[True] * 4, [False, True, False, False]], exact_tokens=18,
                           live_state_tokens=18) == (2, 8, 1)
    assert resumable_floor(full, 4, [[True] * 3], exact_tokens=10).tokens == 12  # never below the floor


def test_floor_rejects_ragged_rows():
    with pytest.raises(ValueError, match="lengths"):
        resumable_floor((FULL(0), FULL(1)), 4, [[True], [True, True]])
    with pytest.raises(ValueError, match="2 groups but 1"):
        resumable_floor((FULL(0), FULL(1)), 4, [[True]])


# ---------------------------------------------------------------- freeing
@pytest.mark.parametrize("window, ps", [(1, 4), (4, 4), (5, 4), (9, 4), (128, 16), (3, 1)])
def test_swa_needed_pages_keep_exactly_what_some_boundary_needs(window, ps):
    n = 12
    for bounds in ([], [n], [4, n], [3, 7, 11]):
        need = swa_needed_pages(bounds, window, ps)
        assert need <= set(range(n))
        for b in bounds:  # each boundary stays resumable when only the needed pages are held
            assert resumable_floor((SWA(window, 0),), ps, [[p in need for p in range(b)]]).pages == b
        for p in need:  # and freeing any kept page loses some boundary
            lost = [b for b in bounds if resumable_floor((SWA(window, 0),), ps,
                                                         [[q in need and q != p for q in range(b)]]).pages < b]
            assert lost, (p, bounds)


# -------------------------------------------------------------- accounting
def test_stored_bytes_gpt_oss():
    lay = hybrid_layout(model_shape("gpt-oss-120b"), 16)
    layer_page = 2 * 8 * 64 * 2 * 16  # K and V, 8 KV heads x 64, bf16, 16 tokens
    for pages in (1, 8, 9, 256, 2048):
        s = stored_bytes(lay, pages)
        assert s.every_layer_full == 36 * layer_page * pages
        assert s.hybrid == 18 * layer_page * pages + 18 * layer_page * min(pages, 8)
        assert (s.snapshots, s.state_every_page) == (0, 0)
    assert round(stored_bytes(lay, 2048).saved, 4) == round(1 - (2048 + 8) / (2 * 2048), 4)


def test_stored_bytes_qwen3_next():
    lay = hybrid_layout(model_shape("qwen3-next-80b-a3b"), 16, snapshot_every=64)
    kv_page = 12 * 2 * 2 * 256 * 2 * 16
    snap = 36 * 1_097_728
    s = stored_bytes(lay, 256)
    assert s.every_layer_full == kv_page * 256 and s.snapshots == 4
    assert s.hybrid == kv_page * 256 + 4 * snap and s.state_every_page == 256 * snap
    assert snapshot_boundaries(256, 64) == [64, 128, 192, 256]
    assert stored_bytes(small(), 3) == (small().page_bytes * 3, small().page_bytes * 3, 0, 0)


def test_to_dict_carries_groups_only_for_hybrids():
    assert "groups" not in small().to_dict()
    lay = small(groups=(SWA(128, 0, 2), FULL(1, 3)))
    assert lay.to_dict()["groups"] == [["swa", [0, 2], 128, 0, 0], ["full", [1, 3], 0, 0, 0]]
    assert lay.replace(page_size=8).groups == lay.groups and lay.replace(groups=()).to_dict() == small().to_dict()


@pytest.mark.parametrize("name", ["gpt-oss-120b", "qwen3-next-80b-a3b"])
def test_workload_bytes_of_one_sequence_is_stored_bytes(name):
    lay = hybrid_layout(model_shape(name), 16, snapshot_every=4)
    for n in (0, 5, 16, 37):
        tokens = list(range(1, 16 * n + 7))
        assert workload_bytes(lay, [(tokens, "")]) == stored_bytes(lay, n)


def test_workload_bytes_counts_shared_pages_once_and_keeps_each_windows_pages():
    lay = small(groups=(SWA(5, 0, 2), FULL(1, 3)))
    layer_page = 2 * 2 * 8 * 2 * 4  # K and V, 2 heads x 8, bf16, 4 tokens
    shared = list(range(1, 33))  # 8 pages
    a, b = shared + [40] * 8, shared + [50] * 8  # two forks of 10 pages each; 12 distinct pages
    got = workload_bytes(lay, [(a, ""), (b, ""), (a, "")])
    # SWA window 5 at page 4: resuming at token 40 needs keys 36..39, page 9 of each fork
    assert got == (2 * layer_page * 12 + 2 * layer_page * 2, 4 * layer_page * 12, 0, 0)
    # a namespace is a different tree
    assert workload_bytes(lay, [(a, ""), (a, "lora")]).every_layer_full == 4 * layer_page * 20
    # the shared prefix's own end, cached as a sequence of its own, keeps its window too
    assert workload_bytes(lay, [(a, ""), (b, ""), (shared, "")]).hybrid == got.hybrid + 2 * layer_page * 1
    wide = small(groups=(SWA(9, 0, 2), FULL(1, 3)))  # keys 32..39: pages 8 and 9 of each fork
    assert workload_bytes(wide, [(a, ""), (b, "")]).hybrid == 2 * layer_page * 12 + 2 * layer_page * 4


def test_workload_bytes_end_snapshots():
    lay = small(groups=(FULL(0, 1, 2, 3), STATE(4, n=2, b=100)))
    shared = list(range(1, 33))  # 8 pages: snapshots at pages 4 and 8 (shared by both forks)
    a, b = shared + [40] * 11, shared + [50] * 8  # 10 pages each (a's last 3 tokens: no full page)
    plain = workload_bytes(lay, [(a, ""), (b, "")])
    assert (plain.snapshots, plain.hybrid) == (2, lay.page_bytes * 12 + 2 * 2 * 100)
    ends = workload_bytes(lay, [(a, ""), (b, ""), (shared, "")], end_snapshots=True)
    assert (ends.snapshots, ends.hybrid) == (4, lay.page_bytes * 12 + 4 * 2 * 100)  # + page 10 of each fork


def test_with_a_state_group_swa_windows_are_accounted_only_where_a_snapshot_is():
    """``HybridCache`` keeps no SWA window at a boundary without a snapshot (it cannot
    resume there): a prefix's end is accounted only when it is a snapshot boundary
    (or, in a workload, with ``end_snapshots``)."""
    lay = small(groups=(SWA(5, 0, 2), FULL(1, 3), STATE(4, n=2, b=100)))
    layer_page = 2 * 2 * 8 * 2 * 4  # K and V, 2 heads x 8, bf16, 4 tokens
    # 10 pages: snapshots at 4 and 8; resuming there reads keys 12..15 and 28..31: pages 3 and 7
    s = stored_bytes(lay, 10)
    assert swa_needed_pages([4, 8], 5, 4) == {3, 7}
    assert s == (2 * layer_page * 10 + 2 * layer_page * 2 + 2 * 2 * 100, 4 * layer_page * 10, 2, 10 * 2 * 100)
    assert stored_bytes(lay, 3).hybrid == 2 * layer_page * 3  # no snapshot boundary: no window at all
    assert stored_bytes(lay, 8) == stored_bytes(lay, 8, boundaries=[4, 8])  # the end is a snapshot boundary
    seq = list(range(1, 43))  # 10 pages + 2 tokens
    assert workload_bytes(lay, [(seq, "")]) == s
    ends = workload_bytes(lay, [(seq, "")], end_snapshots=True)  # + the snapshot and window at page 10
    assert (ends.snapshots, ends.hybrid) == (3, s.hybrid + 2 * layer_page * 1 + 2 * 100)
