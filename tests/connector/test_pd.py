"""The connector's P/D handoffs without vLLM (hicache.connector.pd): a producer's
scheduler and worker halves publish a prefill's blocks to L3, a consumer's load them
into its own blocks. On CPU here; the ``gpu`` variant runs the same on CUDA tensors,
a pinned L2 and the copy kernels (the partial last page zeroed in pinned memory)."""
from __future__ import annotations

import pytest
import torch

from hicache.connector.pd import (RECORD_BYTES, HELLO_FINGERPRINT, Handoffs, PDSettings, Record,
                                        handoff_keys, prompt_digest, record_key)
from hicache.core.errors import ConfigError, ContractMismatch
from hicache.core.hashing import tokens_to_bytes
from hicache.storage import open_storage
from tests.connector.test_connector_core import DEVICES, PS, fill, layout_of, page_bytes, rig


def side(role, layout, device, tmp_path, *, slots=2, group="g", **pd):
    sched, worker, pool = rig(layout, device, tmp_path / "l3")
    stores = [open_storage(f"file://{tmp_path}/l3", fingerprint=layout.fingerprint(), layout=layout)]
    hellos = open_storage(f"file://{tmp_path}/l3", fingerprint=HELLO_FINGERPRINT, key_prefix=b"hicache-pd:")
    h = Handoffs(role, layout, sched, stores, hellos, PDSettings(group=group, slots=slots, poll_s=0, **pd),
                 engine_id=role)
    return h, sched, worker, pool


def pd_step(h: Handoffs, worker, layers: int):
    worker.start(h.take_plan(h.core.take_plan()))
    for i in range(layers):
        worker.wait_layer(i)
    out = worker.drain()
    h.core.completed(h.completed(out.reports))
    return out


@pytest.mark.parametrize("device", DEVICES)
def test_publish_then_load_exact_with_the_tail_zeroed(device, tmp_path):
    layout = layout_of("deepseek-v3", layers=4).replace(draft_layers=1)
    prod, _, pw, ppool = side("kv_producer", layout, device, tmp_path)
    cons, _, cw, cpool = side("kv_consumer", layout, device, tmp_path)
    tokens = list(range(3, 3 + 2 * PS + 5))
    for b in range(3):
        fill(ppool, b, 40 + b)
    want = [page_bytes(ppool, b) for b in range(3)]
    assert prod.admit("r")
    delay, params = prod.publish("r", tokens_to_bytes(tokens), "", len(tokens), True, 77, [0, 1, 2])
    assert delay and params["do_remote_prefill"] and params["remote_num_tokens"] == len(tokens)
    out = pd_step(prod, pw, layout.num_layers + 1)
    assert pw.finish_step({"r"}).finished_saves == {"r"} and not out.load_errors
    assert (prod.c.published, prod.c.published_pages, prod.slots.num_free) == (1, 3, 1)
    rec = Record.unpack(prod.stores[0].get([record_key(params["hicache_handoff"])], [RECORD_BYTES])[0])
    assert rec == Record(params["hicache_handoff"], "r", len(tokens), prompt_digest(tokens_to_bytes(tokens)), layout.fingerprint(), 77)
    assert cons.lookup("d", params, tokens_to_bytes(tokens), "", 0) == (len(tokens), True)
    assert cons.allocated("d", params, [5, 6, 7], len(tokens)) and params["do_remote_prefill"] is False
    out = pd_step(cons, cw, layout.num_layers + 1)
    assert out.finished_loads == {"d"} and not out.load_errors
    got = [page_bytes(cpool, b) for b in (5, 6, 7)]
    for g, w in zip(got[:2], want[:2]):
        assert all(torch.equal(x, y) for x, y in zip(g, w))
    for x, y in zip(got[2], want[2]):  # the last page: 5 rows of tokens, the rest zeroed
        rows = x.view(PS, -1)
        assert torch.equal(rows[:5], y.view(PS, -1)[:5]) and rows[5:].count_nonzero() == 0
    assert (cons.c.loaded, cons.slots.num_free, cons.slots.stats.consumed) == (1, 2, 1)
    pd_step(prod, pw, 0)  # the producer's next step sees the record gone
    assert (prod.c.released, prod.slots.num_free) == (1, 2)
    for h in (prod, cons):
        h.check_integrity()
        h.core.check_integrity()


def test_settings_and_records_refuse_what_they_cannot_use(tmp_path):
    with pytest.raises(ConfigError, match="pd keys"):
        PDSettings.from_extra({"slot": 3})
    with pytest.raises(ConfigError, match="pd.slots"):
        PDSettings.from_extra({"slots": 0})
    assert Record.unpack(b"\x00" * RECORD_BYTES) is None and Record.unpack(b"\x93\x01\x02\x03") is None
    keys = handoff_keys("h", prompt_digest(tokens_to_bytes([1, 2])), 2)
    assert len(set(keys)) == 2 and keys != handoff_keys("h", prompt_digest(tokens_to_bytes([1, 3])), 2)
    assert prompt_digest(b"ab", "lora") != prompt_digest(b"ab")
    layout = layout_of("llama-3.1-8b", layers=2)
    prod = side("kv_producer", layout, "cpu", tmp_path)[0]
    with pytest.raises(ContractMismatch, match="num_layers"):
        side("kv_consumer", layout_of("llama-3.1-8b", layers=3), "cpu", tmp_path)
    prod.close()
    side("kv_consumer", layout_of("llama-3.1-8b", layers=3), "cpu", tmp_path)[0].close()
