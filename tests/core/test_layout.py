import os
import subprocess
import sys

import pytest
import torch

from hicache.core.errors import ContractMismatch, LayoutError
from hicache.core.layout import BytePlane, KVLayout

MHA = dict(model_id="m", num_layers=2, kind="mha", num_kv_heads=2, head_dim=8, dtype="bfloat16", page_size=4)
MLA = dict(model_id="m", num_layers=2, kind="mla", kv_lora_rank=16, rope_dim=4, dtype="bfloat16", page_size=4)


@pytest.mark.parametrize("field,value,needle", [
    ("model_id", "", "model_id"),
    ("num_layers", 0, "num_layers=0"),
    ("page_size", -1, "page_size=-1"),
    ("num_kv_heads", 0, "num_kv_heads >= 1"),
    ("dtype", "int4", "dtype='int4'"),
    ("tp_rank", 2, "tp_rank=2"),
    ("cp_rank", 1, "cp_rank=1"),
    ("kind", "gqa", "kind='gqa'"),
    ("host_layout", "weird", "host_layout='weird'"),
    ("kv_lora_rank", 8, "MLA-only"),
    ("extra_planes", (BytePlane("k", 4),), "'k'"),
    ("extra_planes", (BytePlane("idx", 0),), "bytes_per_token in [1, "),
])
def test_validation_names_field_and_value(field, value, needle):
    with pytest.raises(LayoutError) as e:
        KVLayout(**{**MHA, field: value})
    assert needle in str(e.value)
    assert f"KVLayout.{field}" in str(e.value)


def test_mla_rejects_mha_fields():
    with pytest.raises(LayoutError, match="MHA-only"):
        KVLayout(**{**MLA, "num_kv_heads": 2})


def test_planes_mha_with_extra_and_draft():
    lay = KVLayout(**MHA, extra_planes=(BytePlane("idx", 3),), draft_layers=1)
    names = [(p.name, p.layer, p.draft) for p in lay.planes]
    assert names == [("k", 0, False), ("v", 0, False), ("idx", 0, False),
                     ("k", 1, False), ("v", 1, False), ("idx", 1, False),
                     ("draft_k", 0, True), ("draft_v", 0, True), ("draft_idx", 0, True)]
    assert lay.planes[0].row_bytes == 2 * 8 * 2 and lay.planes[0].page_bytes == 4 * 32
    assert lay.planes[2].dtype == torch.uint8 and lay.planes[2].page_bytes == 12
    assert lay.page_bytes == sum(p.page_bytes for p in lay.planes) == 3 * (128 + 128 + 12)


def test_planes_mla_fp8_is_bytes():
    lay = KVLayout(**{**MLA, "dtype": "float8_e4m3fn"})
    assert [p.name for p in lay.planes] == ["latent", "latent"]
    assert lay.planes[0].dtype == torch.uint8 and lay.planes[0].row_bytes == 20


# Every field that changes a page's bytes must change the fingerprint.
BYTE_FIELDS = [
    ("model_id", "other"), ("num_layers", 3), ("num_kv_heads", 4), ("head_dim", 16),
    ("dtype", "float16"), ("page_size", 8), ("extra_planes", (BytePlane("idx", 2),)),
    ("draft_layers", 1), ("tp_rank", 1), ("tp_size", 4),
]


@pytest.mark.parametrize("field,value", BYTE_FIELDS)
def test_fingerprint_sensitive(field, value):
    base = KVLayout(**MHA, tp_size=2)
    other = base.replace(**{field: value})
    assert other.fingerprint() != base.fingerprint()
    diff = base.diff(other)
    assert [d[0] for d in diff] == [field]


def test_fingerprint_sensitive_mla_fields():
    base = KVLayout(**MLA)
    assert base.replace(kv_lora_rank=32).fingerprint() != base.fingerprint()
    assert base.replace(rope_dim=8).fingerprint() != base.fingerprint()
    assert base.replace(kind="mha", kv_lora_rank=0, rope_dim=0, num_kv_heads=1, head_dim=20).fingerprint() \
        != base.fingerprint()


def test_fingerprint_ignores_cp_and_host_layout():
    # CP decides which rank holds a page, not its bytes; host layout is not part of the page encoding.
    base = KVLayout(**MHA)
    assert base.replace(cp_size=4, cp_rank=3).fingerprint() == base.fingerprint()
    assert base.replace(host_layout="page_first").fingerprint() == base.fingerprint()
    with pytest.raises(ContractMismatch, match="host_layout"):
        base.check_compatible(base.replace(host_layout="page_first"), shared_l2=True)


def test_contract_mismatch_lists_every_field_with_both_values():
    a = KVLayout(**MHA)
    b = a.replace(page_size=8, dtype="float16")
    with pytest.raises(ContractMismatch) as e:
        a.check_compatible(b)
    msg = str(e.value)
    assert "page_size: ours=4 theirs=8" in msg and "dtype: ours='bfloat16' theirs='float16'" in msg
    assert {d[0] for d in e.value.differences} == {"page_size", "dtype"}


def test_fingerprint_stable_across_processes_and_hash_seeds():
    lay = KVLayout(**MHA, extra_planes=(BytePlane("idx", 3),), draft_layers=1)
    code = ("from hicache.core.layout import KVLayout, BytePlane;"
            "print(KVLayout(model_id='m', num_layers=2, kind='mha', num_kv_heads=2, head_dim=8,"
            " dtype='bfloat16', page_size=4, extra_planes=(BytePlane('idx', 3),), draft_layers=1).fingerprint())")
    outs = set()
    for seed in ("0", "12345"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        outs.add(subprocess.check_output([sys.executable, "-c", code], env=env, text=True).strip())
    assert outs == {lay.fingerprint()}
    # A pinned value guards against accidental changes of the encoding itself.
    assert len(lay.fingerprint()) == 32


def test_round_trip_dict():
    lay = KVLayout(**MHA, extra_planes=(BytePlane("idx", 3),))
    assert KVLayout.from_dict(lay.to_dict()) == lay
    with pytest.raises(LayoutError, match="unknown KVLayout field"):
        KVLayout.from_dict({**lay.to_dict(), "heads": 3})


# ---------------------------------------------------------------- kind="rows"
ROWS = dict(model_id="vllm:m", row_bytes=589824, engine_layout={"engine": "vllm", "block": 16})


def test_rows_layout_is_one_uint8_plane_of_the_row():
    lay = KVLayout.rows(**ROWS)
    assert (lay.kind, lay.num_layers, lay.page_size, lay.dtype) == ("rows", 1, 1, "uint8")
    (p,) = lay.planes
    assert (p.name, p.layer, p.draft, p.row_shape, p.dtype, p.row_bytes, p.page_bytes) == \
        ("row", 0, False, (589824,), torch.uint8, 589824, 589824)
    assert lay.page_bytes == lay.token_bytes == 589824
    assert lay.engine_layout == '{"block":16,"engine":"vllm"}'


@pytest.mark.parametrize("row_bytes", [1, 64 << 20, 1 << 30])
def test_rows_accepts_rows_up_to_the_bound(row_bytes):
    assert KVLayout.rows(**{**ROWS, "row_bytes": row_bytes}).page_bytes == row_bytes == \
        KVLayout.rows(**{**ROWS, "row_bytes": row_bytes}).planes[0].page_bytes


@pytest.mark.parametrize("changes,field,needle", [
    ({"row_bytes": 0}, "row_bytes", "row_bytes >= 1"),
    ({"row_bytes": (1 << 30) + 1}, "row_bytes", f"must be an integer in [0, {1 << 30}]"),
    ({"row_bytes": True}, "row_bytes", "must be an integer"),
    ({"row_bytes": 2.0}, "row_bytes", "must be an integer"),
    ({"engine_layout": "x" * ((1 << 16) + 1)}, "engine_layout", "at most 65536 characters"),
    ({"engine_layout": "not json"}, "engine_layout", "must be a JSON object"),
    ({"engine_layout": "[1]"}, "engine_layout", "non-empty JSON object"),
    ({"engine_layout": "{}"}, "engine_layout", "non-empty JSON object"),
    ({"engine_layout": '{"b": 1, "a": 2}'}, "engine_layout", "canonical JSON"),
    ({"engine_layout": 7}, "engine_layout", "must be a string"),
    ({"page_size": 16}, "page_size", "page_size must be 1"),
    ({"num_layers": 2}, "num_layers", "num_layers must be 1"),
    ({"dtype": "bfloat16"}, "dtype", "dtype must be 'uint8'"),
    ({"kv_lora_rank": 8}, "kv_lora_rank", "kv_lora_rank must be 0"),
    ({"num_kv_heads": 1}, "num_kv_heads", "num_kv_heads must be 0"),
    ({"draft_layers": 1}, "draft_layers", "draft_layers must be 0"),
    ({"extra_planes": (BytePlane("idx", 3),)}, "extra_planes", "extra_planes must be ()"),
])
def test_rows_bounds_name_field_and_value(changes, field, needle):
    base = KVLayout.rows(**ROWS).to_dict()
    with pytest.raises(LayoutError) as e:
        KVLayout.from_dict({**base, **changes})
    assert needle in str(e.value) and f"KVLayout.{field}" in str(e.value)
    assert e.value.field == field


@pytest.mark.parametrize("lay,field", [(MHA, "row_bytes"), (MLA, "engine_layout")])
def test_rows_fields_are_refused_on_mha_and_mla(lay, field):
    with pytest.raises(LayoutError, match=f"KVLayout.{field}=.*kind='rows' only"):
        KVLayout(**lay, **{field: 64 if field == "row_bytes" else '{"a":1}'})


def test_rows_engine_layout_must_be_json():
    with pytest.raises(LayoutError, match="not JSON-serialisable"):
        KVLayout.rows("m", 64, {"x": object()})


def test_rows_fingerprint_covers_row_bytes_and_the_engine_description():
    base = KVLayout.rows(**ROWS)
    assert KVLayout.rows(**{**ROWS, "row_bytes": 589825}).fingerprint() != base.fingerprint()
    other = KVLayout.rows(**{**ROWS, "engine_layout": {"engine": "vllm", "block": 32}})
    assert other.fingerprint() != base.fingerprint()
    assert [d[0] for d in base.diff(other)] == ["engine_layout"]
    # One description, one fingerprint, whatever the key order the engine used.
    same = KVLayout.rows(**{**ROWS, "engine_layout": {"block": 16, "engine": "vllm"}})
    assert same.fingerprint() == base.fingerprint() and same == base
    fields = base.contract_fields()
    assert fields["kind"] == "rows" and fields["row_bytes"] == 589824
    assert fields["engine_layout"] == '{"block":16,"engine":"vllm"}'
    # The old abuse (a one-layer MLA whose kv_lora_rank is the row) is another layout.
    assert base.fingerprint() != KVLayout(model_id="vllm:m", num_layers=1, kind="mla", kv_lora_rank=64,
                                          dtype="uint8", page_size=1).fingerprint()


def test_mha_and_mla_fingerprints_and_dicts_do_not_carry_the_rows_fields():
    """Adding kind="rows" changed no existing fingerprint: objects already in L3 stay readable,
    and peers that predate the fields still parse our handshake."""
    for d in (MHA, MLA):
        lay = KVLayout(**d)
        assert not {"row_bytes", "engine_layout"} & set(lay.contract_fields())
        assert not {"row_bytes", "engine_layout"} & set(lay.to_dict())
    # The fingerprint of MHA as computed before the fields existed (the same JSON blob).
    import hashlib
    import json
    lay = KVLayout(**MHA)
    old = {"contract_version": 1, **{k: v for k, v in lay.to_dict().items()
                                     if k not in ("cp_rank", "cp_size", "host_layout")}}
    blob = json.dumps(old, sort_keys=True, separators=(",", ":"))
    assert lay.fingerprint() == hashlib.blake2b(blob.encode(), digest_size=16).hexdigest()


def test_rows_round_trips_through_dict_and_config():
    from hicache.core.config import ModelConfig
    lay = KVLayout.rows(**ROWS, host_layout="page_first")
    d = lay.to_dict()
    assert d["row_bytes"] == 589824 and d["engine_layout"] == lay.engine_layout
    assert KVLayout.from_dict(d) == lay
    assert ModelConfig(**{**d, "extra_planes": []}).to_layout() == lay
    assert lay.host_addressing(3) == ([0], [589824], 3 * 589824)
