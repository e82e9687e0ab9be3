import os
import subprocess
import sys

import pytest
import torch

from hicache.errors import ContractMismatch, LayoutError
from hicache.layout import BytePlane, KVLayout

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
    code = ("from hicache.layout import KVLayout, BytePlane;"
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
