"""The connector's view of an engine's KV cache groups (hicache.connector.groups): the
floor every group resumes from and what each group moves, at real hybrid shapes."""
from __future__ import annotations

import pytest

from hicache.connector.groups import EngineGroup, check_groups, floor_hit, needed
from hicache.core.errors import ConfigError
from hicache.core.groups import resumable_floor
from hicache.core.shapes import model_shape

PS = 16
OSS = model_shape("gpt-oss-120b")  # 18 sliding (window 128) + 18 full layers
NEXT = model_shape("qwen3-next-80b-a3b")  # 36 Gated DeltaNet (state) + 12 full layers


def oss_groups() -> tuple[EngineGroup, ...]:
    half = OSS.layers // 2
    return (EngineGroup(0, "swa", tuple(f"l{2 * i}" for i in range(half)), OSS.sliding_window),
            EngineGroup(1, "full", tuple(f"l{2 * i + 1}" for i in range(half))))


def next_groups() -> tuple[EngineGroup, ...]:
    full = NEXT.layers // NEXT.full_attention_every
    return (EngineGroup(0, "full", tuple(f"a{i}" for i in range(full))),
            EngineGroup(1, "state", tuple(f"m{i}" for i in range(NEXT.layers - full))))


def test_sliding_window_moves_only_its_window():
    swa, full = oss_groups()
    # window 128 tokens at page 16: resuming at page 20 needs pages 12 .. 19 (token 193 .. 319)
    assert needed(swa, PS, 0, 20) == range(12, 20) and needed(full, PS, 0, 20) == range(0, 20)
    assert needed(swa, PS, 15, 20) == range(15, 20)  # the engine holds the rest
    assert needed(swa, PS, 5, 5) == range(5, 5)


def test_state_moves_the_snapshot_at_the_boundary():
    full, state = next_groups()
    assert needed(state, PS, 3, 9) == range(8, 9) and needed(full, PS, 3, 9) == range(3, 9)


def test_floor_is_where_every_group_resumes_gpt_oss():
    groups = oss_groups()
    n = 24
    full = [True] * n
    swa = [True] * n
    swa[17] = False  # a hole in the window of boundaries 18 .. 24
    hit = floor_hit(groups, PS, 0, [swa, full])
    # boundary 17 needs pages 9 .. 16 (all held); 18 .. 24 need page 17
    assert hit.end == 17 and hit.limited_by == 0
    assert hit.moves == (range(9, 17), range(0, 17))
    assert hit.pages() == 8 + 17


def test_pages_before_the_engine_hit_are_the_engines():
    groups = oss_groups()
    n = 12
    swa = [False] * 6 + [True] * 6  # the connector lacks the first six pages' window rows
    hit = floor_hit(groups, PS, 6, [swa, [True] * n])
    assert hit.end == 12 and hit.moves == (range(6, 12), range(6, 12))
    assert floor_hit(groups, PS, 6, [[False] * n, [True] * n]).end == 6  # no hit past the engine's


def test_floor_matches_resumable_floor_when_the_engine_holds_nothing():
    groups = next_groups()
    n = 16
    state = [i % 4 == 3 for i in range(n)]  # snapshots every fourth boundary
    full = [True] * 14 + [False] * 2
    hit = floor_hit(groups, PS, 0, [full, state])
    want = resumable_floor([g.resume_rule() for g in groups], PS, [full, state])
    assert (hit.end, hit.limited_by) == (want.pages, want.limited_by) == (12, 0)
    assert hit.moves == (range(0, 12), range(11, 12))


def test_floor_rows_must_agree():
    with pytest.raises(ValueError, match="one per page"):
        floor_hit(oss_groups(), PS, 0, [[True] * 3, [True] * 4])


@pytest.mark.parametrize("groups, why", [
    ((), "at least one"),
    ((EngineGroup(0, "swa", ("a",), 128),), "full-attention group"),
    ((EngineGroup(0, "full", ("a",)), EngineGroup(0, "swa", ("b",), 8)), "repeated"),
    ((EngineGroup(0, "full", ("a",), 8),), "window is for swa"),
    ((EngineGroup(0, "full", ("a",)), EngineGroup(1, "swa", ("b",))), "window is for swa"),
])
def test_check_groups_names_what_cannot_be_served(groups, why):
    with pytest.raises(ConfigError, match=why):
        check_groups(groups)
    check_groups(oss_groups())
    check_groups(next_groups())
