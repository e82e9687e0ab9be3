"""``hicache replay --hybrid SHAPE``: a built-in workload through ``HybridCache`` at the
published gpt-oss-120b and Qwen3-Next shapes; the bytes it reports held are the
group stores' and the index's real pages, checked against the group layouts' sizes."""
import json

import pytest

from hicache.cli import main
from hicache.core.groups import hybrid_layout
from hicache.cache.hybrid import group_layout
from hicache.core.shapes import model_shape

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.mark.parametrize("shape, every", [("gpt-oss-120b", 8), ("qwen3-next-80b-a3b", 2)])
def test_replay_hybrid_reports_realised_bytes_and_the_floored_hit_rate(shape, every, tmp_path, capsys):
    out = tmp_path / "r.json"
    assert main(["replay", "--hybrid", shape, "--scale", "tiny", "--snapshot-every", str(every),
                 "--set", "storage.url=", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert f"{shape} on mixed-tiny" in text and "saved:" in text and "floored to where every group resumes" in text
    r = json.loads(out.read_text())
    lay = hybrid_layout(model_shape(shape), 16, snapshot_every=every, draft=False)
    (name, c), = r["groups"].items()
    gi = int(name[-1])
    item = group_layout(lay, (lay.groups[gi].kind,), gi).page_bytes
    full_pages = r["every_layer_full_bytes"] // sum(p.page_bytes for p in lay.planes)
    full = group_layout(lay, ("full",)).page_bytes
    # L2 holds the whole workload: every distinct page of the full layers plus the group's items
    assert r["held_bytes"]["L2"] == full_pages * full + c["l2"] * item
    assert 0 < r["held_bytes"]["L2"] <= r["every_layer_full_bytes"] + r["state_every_page_bytes"]
    assert 0 < r["floored_hit_rate"] <= r["hit_rate"] < 1
    # the workload fits the record (default cap 4096): nothing forgotten, what is held is all needed
    assert r["boundaries"] > 0 and r["forgotten_boundaries"] == 0 and "boundaries recorded:" in text
    if shape == "gpt-oss-120b":  # tiny's sequences are shorter than the 128-token window: every page kept
        assert c["l2"] == full_pages and r["saved"] == pytest.approx(0.0)
    else:  # one 38.6 MiB snapshot per kept boundary instead of one per page
        assert r["saved"] > 0.2


def test_replay_hybrid_keeps_only_the_windows_of_long_sequences(tmp_path):
    """Three 640-token requests (+1 generated: 40 full pages each) sharing their first 320
    tokens (20 pages), page 16, window 128 (8 pages before a boundary). ``a`` keeps its
    end's window; ``b`` hits 20 pages but no boundary is there yet (floored to 0), so it
    records the fork's window on the way, and its end's; ``c`` resumes at the fork and
    keeps its end's window: 4 windows of 8 SWA pages of the 80 distinct pages."""
    a = list(range(1, 641))
    b = a[:320] + list(range(1000, 1320))
    c = a[:320] + list(range(2000, 2320))
    lines = [{"hicache_trace": 1, "name": "forks", "vocab": 4096}]
    lines += [{"rid": r, "arrival": i, "max_new_tokens": 1, "prompt": p} for i, (r, p) in
              enumerate((("a", a), ("b", b), ("c", c)))]
    trace = tmp_path / "t.jsonl"
    trace.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    out = tmp_path / "r.json"
    assert main(["replay", str(trace), "--hybrid", "gpt-oss-120b", "--set", "storage.url=",
                 "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["groups"]["swa0"]["l2"] == 4 * 8
    assert (r["hit_tokens"], r["resumed_tokens"]) == (2 * 320, 320)
    lay = hybrid_layout(model_shape("gpt-oss-120b"), 16, draft=False)
    half = group_layout(lay, ("full",)).page_bytes  # full and SWA layers: 18 each
    assert half == group_layout(lay, ("swa",), 0).page_bytes
    assert r["every_layer_full_bytes"] == 80 * 2 * half
    assert r["held_bytes"]["L2"] == (80 + 32) * half and r["saved"] == pytest.approx(1 - 112 / 160)
