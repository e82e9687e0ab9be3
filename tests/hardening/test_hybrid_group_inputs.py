"""Hybrid layer groups take integers only, and malformed ones are LayoutErrors (issue 36, row 12).

Before the fix ``LayerGroup(kind="swa", window=1.5, ...)`` and ``window=True``
were accepted, a string window raised TypeError and a malformed group from a
config or a handshake TypeError/ValueError, and ``--snapshot-every 0`` was
silently ignored for gpt-oss (which has no state group).
"""
from __future__ import annotations

import pytest

from hicache.cli import main
from hicache.core.errors import LayoutError
from hicache.core.groups import LayerGroup, hybrid_groups
from hicache.core.layout import KVLayout
from hicache.core.shapes import model_shape

BASE = dict(model_id="g", num_layers=2, num_kv_heads=1, head_dim=4, dtype="float32", page_size=4)


@pytest.mark.parametrize("field,value", [("window", 1.5), ("window", True), ("window", "4"),
                                         ("state_bytes", 2.0), ("snapshot_every", False)])
def test_group_counts_must_be_integers(field, value):
    kind = "swa" if field == "window" else "state"
    with pytest.raises(LayoutError, match=f"{field}: must be an integer, got {type(value).__name__}"):
        LayerGroup(kind, (0,), **{field: value})


@pytest.mark.parametrize("group", [["swa", [0], 1.5], ["swa", [0], True], ["swa", [0], "4"]])
def test_a_layout_from_lists_refuses_non_integer_windows(group):
    with pytest.raises(LayoutError, match="window: must be an integer"):
        KVLayout(**BASE, groups=(group, ["full", [1]]))


@pytest.mark.parametrize("group", [["swa"], [], 5, "swa", ["swa", 5], ["swa", "01"], ["swa", [0], 4, 0, 0, 9],
                                   None, {"kind": "swa"}])
def test_malformed_groups_are_layout_errors(group):
    with pytest.raises(LayoutError, match="KVLayout.groups: a group"):
        KVLayout(**BASE, groups=(group,))


@pytest.mark.parametrize("shape", ["gpt-oss-120b", "qwen3-next-80b-a3b"])
@pytest.mark.parametrize("k", [0, -1, 1.5, True])
def test_snapshot_every_is_checked_for_every_hybrid_shape(shape, k):
    with pytest.raises(LayoutError, match=r"snapshot_every=.*must be an integer in \[1, "):
        hybrid_groups(model_shape(shape), snapshot_every=k)


def test_hybrid_replay_refuses_snapshot_every_0(capsys):
    with pytest.raises(SystemExit) as e:
        main(["replay", "--hybrid", "gpt-oss-120b", "--snapshot-every", "0"])
    assert e.value.code == 2 and "argument --snapshot-every: must be at least 1, got 0" in capsys.readouterr().err
