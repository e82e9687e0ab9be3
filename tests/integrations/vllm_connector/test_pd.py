"""Prefill/decode disaggregation through vLLM's own schedulers: a ``kv_producer`` engine
prefills with the params vLLM's toy P/D proxy sends it, the params vLLM hands back go
to a ``kv_consumer`` engine, which loads the handoff from L3 and decodes. Every
forward checks every computed token's bytes (``harness.Engine``), so a consumer that
decodes over a wrong page fails. Each metadata slot is released on success, on an
abort on either side and on a load failure (the counts below fail if one is not)."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from vllm.v1.request import RequestStatus

from hicache.connector.pd import RECORD_BYTES, handoff_keys, prompt_digest, record_key
from hicache.core.errors import ContractMismatch
from hicache.core.hashing import tokens_to_bytes
from tests.integrations.vllm_connector.harness import BLOCK, TOY, TOY_MLA, Engine, real_shape, tokens
from tests.integrations.vllm_connector.test_scheduler_path import extra, finish_idle

# vLLM's toy proxy (tests/v1/kv_connector/nixl_integration/toy_proxy_server.py,
# send_request_to_service) sends these to the prefill instance, with max_tokens=1.
TO_PREFILL = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
              "remote_block_ids": None, "remote_host": None, "remote_port": None}
SLOTS = 4


def tokens_digest(tokens: list[int]) -> str:
    """A text prompt's handoff digest (no namespace)."""
    return prompt_digest(tokens_to_bytes(tokens))


def pd_extra(tmp_path, **pd):
    return extra(tmp_path, pd={"slots": SLOTS, "poll_s": 0, "wait_s": 0, **pd})


def pair(tmp_path, shape=TOY, policy="recompute", pd=None, draft=0, **kw):
    ex = pd_extra(tmp_path, **(pd or {}))
    if draft:
        ex["draft_layers"] = draft
    prod = Engine(ex, shape, kv_role="kv_producer", **kw)
    for t in prod.kvs[0].values():  # stale bytes in every block: padding must never travel
        t.view(torch.uint8).fill_(0x5A)
    cons = Engine(ex, shape, kv_role="kv_consumer", policy=policy, **kw)
    return prod, cons


def prefill(prod: Engine, rid: str, prompt: list[int]) -> dict:
    """The prefill leg of the proxy: max_tokens=1, then the params vLLM returns."""
    prod.add(rid, prompt, max_tokens=1, kv_transfer_params=dict(TO_PREFILL))
    prod.run(integrity=True)
    return prod.transfer_params[rid]


def free_slots(eng: Engine) -> int:
    eng.check_integrity()
    return eng.connector.pd.slots.num_free


def counters(eng: Engine, *names: str) -> tuple[int, ...]:
    c = eng.connector.pd.c
    return tuple(getattr(c, n) for n in names)


def settle(prod: Engine) -> None:
    """One producer step: it notices the handoffs consumers released."""
    prod.step()
    prod.check_integrity()


def test_handoff_loads_byte_exact_and_releases_both_slots(tmp_path):
    prod, cons = pair(tmp_path)
    p = tokens(90, 5 * BLOCK + 7)
    params = prefill(prod, "p1", p)
    assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
    assert params["remote_num_tokens"] == len(p) and params["remote_engine_id"] == prod.vllm_config.kv_transfer_config.engine_id
    assert counters(prod, "published", "published_pages") == (1, 6)
    assert free_slots(prod) == SLOTS - 1  # owned until the consumer releases it
    # The partial last page travelled with its 9 padding rows zeroed (the blocks held 0x5A).
    pd = prod.connector.pd
    key = handoff_keys(params["hicache_handoff"], tokens_digest(p), 6)[5]
    sizes = [s.page_bytes for s in pd.layout.planes]
    payload = torch.frombuffer(bytearray(pd.stores[0].get([key], sizes)[0]), dtype=torch.uint8)
    off = 0
    for s in pd.layout.planes:
        page = payload[off:off + s.page_bytes].view(BLOCK, -1)
        assert page[7:].count_nonzero() == 0 and page[:7].count_nonzero() > 0
        off += s.page_bytes
    d = cons.add("d1", p, max_tokens=3, kv_transfer_params=params)
    cons.run(integrity=True)
    assert cons.lookups[0] == ("d1", 0, len(p), True)
    assert d.status == RequestStatus.FINISHED_LENGTH_CAPPED and cons.checked_tokens >= len(p) - 1
    assert counters(cons, "loaded", "loaded_pages", "load_failed") == (1, 6, 0)
    assert cons.core.stats().load_error_pages == 0
    assert free_slots(cons) == SLOTS and cons.connector.pd.slots.stats.consumed == 1
    settle(prod)
    assert counters(prod, "released", "expired") == (1, 0) and free_slots(prod) == SLOTS
    assert pd.stores[0].exists([key, record_key(params["hicache_handoff"])]) == [False, False]
    finish_idle(prod)
    finish_idle(cons)


def test_consumer_waits_for_the_handoff_to_be_complete(tmp_path):
    prod, cons = pair(tmp_path, pd={"wait_s": 3600})
    p = tokens(91, 3 * BLOCK + 1)
    prod.add("p1", p, max_tokens=1, kv_transfer_params=dict(TO_PREFILL))
    prod.step()
    prod.step()  # the prefill finished; its publish is queued, not stored yet
    params = prod.transfer_params["p1"]
    assert params["do_remote_prefill"] and counters(prod, "published") == (0,)
    cons.add("d1", p, max_tokens=2, kv_transfer_params=params)
    cons.step()
    assert cons.lookups == [("d1", 0, None, False)]  # not complete in L3: vLLM asks again
    prod.run()
    cons.run(integrity=True)
    assert counters(cons, "loaded", "load_failed") == (1, 0)
    settle(prod)
    assert free_slots(prod) == free_slots(cons) == SLOTS
    finish_idle(prod)
    finish_idle(cons)


def test_producer_abort_releases_its_slot(tmp_path):
    prod, _ = pair(tmp_path, tokens_per_step=BLOCK)
    prod.add("p1", tokens(92, 4 * BLOCK), max_tokens=1, kv_transfer_params=dict(TO_PREFILL))
    prod.step()  # one chunk of four
    assert free_slots(prod) == SLOTS - 1
    prod.scheduler.finish_requests("p1", RequestStatus.FINISHED_ABORTED)
    prod.run(integrity=True)
    assert free_slots(prod) == SLOTS and counters(prod, "producer_aborted", "published") == (1, 0)
    assert prod.transfer_params.get("p1") is None
    finish_idle(prod)


@pytest.mark.parametrize("when", ["load_in_flight", "before_the_handoff_is_complete"])
def test_consumer_abort_releases_both_slots(tmp_path, when):
    prod, cons = pair(tmp_path, pd={"wait_s": 3600, "ttl_s": 60})
    now = [0.0]
    prod.connector.pd.clock = lambda: now[0]
    p = tokens(93, 4 * BLOCK + 3)
    if when == "load_in_flight":
        params = prefill(prod, "p1", p)
        cons.add("d1", p, kv_transfer_params=params)

        def abort(so):
            assert cons.scheduler.requests["d1"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
            cons.scheduler.finish_requests("d1", RequestStatus.FINISHED_ABORTED)
        cons.step(between=abort)
        cons.run(integrity=True)
        settle(prod)
        assert counters(prod, "released", "expired") == (1, 0)
    else:
        prod.add("p1", p, max_tokens=1, kv_transfer_params=dict(TO_PREFILL))
        prod.step()
        prod.step()  # the prefill finished; its record is written at a later step
        cons.add("d1", p, kv_transfer_params=prod.transfer_params["p1"])
        cons.step()
        cons.scheduler.finish_requests("d1", RequestStatus.FINISHED_ABORTED)
        cons.run(integrity=True)
        prod.run()
        assert free_slots(prod) == SLOTS - 1  # published after the consumer left: held until ttl_s
        now[0] = 61.0
        settle(prod)
        assert counters(prod, "released", "expired") == (0, 1)
    assert counters(cons, "consumer_aborted", "loaded") == (1, 0)
    assert free_slots(prod) == free_slots(cons) == SLOTS
    assert "d1" not in cons.scheduler.requests
    finish_idle(prod)
    finish_idle(cons)


def test_no_l2_room_answers_without_a_handoff_and_the_decode_side_computes(tmp_path):
    ex = pd_extra(tmp_path)
    ex["pool"] = {"host_pages": 2}
    prod = Engine(ex, kv_role="kv_producer")
    cons = Engine(pd_extra(tmp_path), kv_role="kv_consumer")
    p = tokens(100, 4 * BLOCK + 1)  # 5 pages to stage, 2 in L2
    params = prefill(prod, "p1", p)
    assert params["do_remote_prefill"] is False and params["hicache_handoff"] is None
    assert counters(prod, "publish_dropped", "published") == (1, 0) and free_slots(prod) == SLOTS
    d = cons.add("d1", p, kv_transfer_params=params)
    cons.run(integrity=True)
    assert d.status == RequestStatus.FINISHED_LENGTH_CAPPED and cons.lookups[0] == ("d1", 0, 0, False)
    assert counters(cons, "loaded", "load_failed") == (0, 0)
    finish_idle(prod)
    finish_idle(cons)


def test_no_l2_room_on_the_consumer_is_a_load_error_and_releases_both(tmp_path, caplog):
    prod = Engine(pd_extra(tmp_path), kv_role="kv_producer")
    ex = pd_extra(tmp_path)
    ex["pool"] = {"host_pages": 2}
    cons = Engine(ex, kv_role="kv_consumer")
    p = tokens(102, 4 * BLOCK + 1)  # 5 pages to stage, 2 in the consumer's L2
    params = prefill(prod, "p1", p)
    d = cons.add("d1", p, kv_transfer_params=params)
    with caplog.at_level("WARNING", logger="hicache.connector.pd"):
        logs = cons.run(integrity=True)
    assert len(set().union(*(g.invalid for g in logs))) == 5 and d.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert counters(cons, "loaded", "load_failed") == (0, 1) and free_slots(cons) == SLOTS
    assert cons.connector.pd.slots.stats.released == 1
    assert [r.getMessage() for r in caplog.records if r.name == "hicache.connector.pd"] == [
        f"hicache connector: P/D handoff {params['hicache_handoff']} of request 'd1' not loaded: no L2 room to stage "
        "its 5 pages (host_bytes); vLLM recomputes the request or fails it, as kv_load_failure_policy says"]
    settle(prod)
    assert counters(prod, "released") == (1,) and free_slots(prod) == SLOTS
    finish_idle(prod)
    finish_idle(cons)


def test_a_store_l3_refuses_fails_the_publish_and_releases(tmp_path):
    prod = Engine(extra(storage={"url": "redis://127.0.0.1:9/0", "timeout_ms": 20, "max_retries": 0},
                        pd={"slots": SLOTS, "poll_s": 0}), kv_role="kv_producer")
    params = prefill(prod, "p1", tokens(101, 3 * BLOCK + 2))  # nothing listens there: every put is dropped
    assert params["do_remote_prefill"] is True  # answered before the store; the consumer's load will fail
    assert counters(prod, "publish_failed", "published") == (1, 0) and free_slots(prod) == SLOTS
    finish_idle(prod)


def _lose_page(prod: Engine, params: dict, prompt: list[int], page: int) -> None:
    pd = prod.connector.pd
    keys = handoff_keys(params["hicache_handoff"], tokens_digest(prompt), page + 1)
    assert pd.stores[0].delete([keys[page]]) == 1


def test_partial_handoff_is_a_load_error_recomputed_once(tmp_path):
    prod, cons = pair(tmp_path)
    p = tokens(94, 5 * BLOCK + 2)
    params = prefill(prod, "p1", p)
    _lose_page(prod, params, p, 3)
    d = cons.add("d1", p, kv_transfer_params=params)
    logs = cons.run(integrity=True)
    assert len(set().union(*(g.invalid for g in logs))) == 3  # pages 3, 4, 5: the leading 3 loaded
    assert d.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert [x for x in cons.lookups if x[0] == "d1"] == [("d1", 0, len(p), True)]  # not asked again
    assert counters(cons, "loaded", "load_failed") == (0, 1) and free_slots(cons) == SLOTS
    assert cons.connector.pd.slots.stats.released == 1  # a failed load's slot is released, not consumed
    settle(prod)
    assert counters(prod, "released") == (1,) and free_slots(prod) == SLOTS
    finish_idle(prod)
    finish_idle(cons)


@pytest.mark.parametrize("broken", ["missing", "corrupt_record", "other_prompt"])
def test_missing_or_unverifiable_handoff_recomputed_never_looped(tmp_path, broken):
    prod, cons = pair(tmp_path)
    p = tokens(95, 3 * BLOCK + 5)
    params = prefill(prod, "p1", p)
    pd = prod.connector.pd
    prompt = p
    if broken == "missing":
        params = {**params, "hicache_handoff": "0" * 32}
    elif broken == "corrupt_record":
        [raw] = pd.stores[0].get([record_key(params["hicache_handoff"])], [RECORD_BYTES])
        bad = bytearray(raw)
        bad[:4] = b"\x93\x01\x02\x03"  # a valid object whose payload is no record
        pd.stores[0].put([(record_key(params["hicache_handoff"]), bytes(bad), [RECORD_BYTES])])
    else:
        prompt = p[:-1] + [p[-1] + 1]
    d = cons.add("d1", prompt, kv_transfer_params=params)
    cons.run(integrity=True)
    assert [x for x in cons.lookups if x[0] == "d1"] == [("d1", 0, len(p), True), ("d1", 0, 0, False)]
    assert d.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert counters(cons, "load_failed") == (1,) and cons.core.stats().load_error_pages == 4
    assert free_slots(cons) == SLOTS
    finish_idle(cons)
    if broken != "missing":  # the consumer deleted what it could not load: the producer's slot is free
        settle(prod)
        assert free_slots(prod) == SLOTS
    finish_idle(prod)


def test_policy_fail_fails_the_request_and_releases(tmp_path):
    prod, cons = pair(tmp_path, policy="fail")
    p = tokens(96, 4 * BLOCK)
    params = prefill(prod, "p1", p)
    _lose_page(prod, params, p, 0)
    d = cons.add("d1", p, kv_transfer_params=params)
    cons.run(integrity=True)
    assert d.status == RequestStatus.FINISHED_ERROR and cons.checked_tokens == 0
    assert counters(cons, "load_failed") == (1,) and free_slots(cons) == SLOTS
    settle(prod)
    assert free_slots(prod) == SLOTS
    finish_idle(prod)
    finish_idle(cons)


def test_pair_of_other_layouts_refuses_to_start(tmp_path):
    prod = Engine(pd_extra(tmp_path), TOY, kv_role="kv_producer")
    with pytest.raises(ContractMismatch, match="kv_producer registered"):
        Engine(pd_extra(tmp_path), TOY_MLA, kv_role="kv_consumer")
    other_group = Engine(pd_extra(tmp_path, group="other"), TOY_MLA, kv_role="kv_consumer")
    finish_idle(other_group)
    finish_idle(prod)
    # A producer that stopped cleanly withdrew its hello: the consumer starts.
    finish_idle(Engine(pd_extra(tmp_path), TOY_MLA, kv_role="kv_consumer"))


DSV3 = real_shape("deepseek-v3")
DSV3_NEXTN = dataclasses.replace(DSV3, name="deepseek-v3+nextn", layers=DSV3.layers + 1)


def test_draft_planes_travel_with_the_target_or_not_at_all(tmp_path):
    """DeepSeek-V3 MLA (61 layers, 512 latent + 64 rope, bf16) and its NextN layer's planes."""
    prod, cons = pair(tmp_path, DSV3_NEXTN, draft=1, num_blocks=12)
    lay = cons.connector.pd.layout
    assert (lay.num_layers, lay.draft_layers, sum(s.draft for s in lay.planes)) == (61, 1, 1)
    p = tokens(97, 3 * BLOCK + 4)
    cons.add("d1", p, kv_transfer_params=prefill(prod, "p1", p))
    cons.run(integrity=True)  # every layer's latent, the NextN layer's included, checked byte for byte
    assert counters(cons, "loaded", "loaded_pages") == (1, 4) and cons.checked_tokens >= len(p) - 1
    # A flipped byte in page 1's draft plane (the payload's last bytes) fails page 1 whole:
    # pages 1-3 are recomputed, never a target page without its draft.
    p2 = tokens(98, 3 * BLOCK + 4)
    params = prefill(prod, "p2", p2)
    key = handoff_keys(params["hicache_handoff"], tokens_digest(p2), 2)[1]
    [obj] = list(tmp_path.rglob(key.hex()))
    raw = bytearray(obj.read_bytes())
    raw[-3] ^= 0xFF
    obj.write_bytes(bytes(raw))
    cons.add("d2", p2, kv_transfer_params=params)
    logs = cons.run(integrity=True)
    assert len(set().union(*(g.invalid for g in logs))) == 3
    assert counters(cons, "loaded", "load_failed") == (1, 1)
    settle(prod)
    assert free_slots(prod) == free_slots(cons) == SLOTS
    finish_idle(prod)
    finish_idle(cons)


def test_a_decode_side_without_the_draft_planes_refuses_to_start(tmp_path):
    ex = pd_extra(tmp_path)
    prod = Engine({**ex, "draft_layers": 1}, DSV3_NEXTN, kv_role="kv_producer", num_blocks=4)
    with pytest.raises(ContractMismatch, match="draft_layers"):
        Engine(ex, DSV3_NEXTN, kv_role="kv_consumer", num_blocks=4)  # NextN counted as a 62nd target layer
    finish_idle(prod)


def _serve_configs(tmp_path):
    """docs/vllm-connector.md's two P/D lines through vLLM's CLI parser, with the model
    (this box has opt-125m's config) and the store (this test's directory) replaced."""
    import json
    import pathlib
    import shlex

    from vllm.engine.arg_utils import EngineArgs
    from vllm.entrypoints.common.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from tests.test_readme import block
    doc = pathlib.Path(__file__).resolve().parents[3] / "docs" / "vllm-connector.md"
    lines = [x for x in block(doc, "test_pd_docs_serve_lines", "bash").splitlines() if x.startswith("vllm")]
    out = []
    for line, role in zip(lines, ("kv_producer", "kv_consumer")):
        argv = shlex.split(line)
        rest = argv[3:]
        i = rest.index("--kv-transfer-config")
        kv = json.loads(rest[i + 1])
        assert kv["kv_role"] == role and kv["kv_connector_extra_config"]["pd"] == {"group": "llama-8b"}
        kv["kv_connector_extra_config"]["storage"]["url"] = f"file://{tmp_path}/l3"
        kv["kv_connector_extra_config"]["pd"].update(poll_s=0, wait_s=0)
        rest[i + 1] = json.dumps(kv)
        args = make_arg_parser(FlexibleArgumentParser()).parse_args([*rest, "--model", "facebook/opt-125m",
                                                                 "--attention-backend", "FLASH_ATTN"])
        out.append(EngineArgs.from_cli_args(args).create_engine_config())
    return out


def test_pd_docs_serve_lines(tmp_path):
    shape = real_shape("opt-125m")
    pcfg, ccfg = _serve_configs(tmp_path)
    prod = Engine(None, shape, num_blocks=16, vllm_config=pcfg)
    cons = Engine(None, shape, num_blocks=16, vllm_config=ccfg)
    assert prod.connector.requires_kv_delivery and not cons.connector.requires_kv_delivery
    assert prod.scheduler.requires_kv_delivery  # vLLM's scheduler read it
    p = tokens(99, 4 * BLOCK + 9)
    d = cons.add("d1", p, max_tokens=4, kv_transfer_params=prefill(prod, "p1", p))
    cons.run(integrity=True)
    settle(prod)
    assert d.status == RequestStatus.FINISHED_LENGTH_CAPPED
    # What each side's /metrics gets (the kv_connector_stats vLLM's scheduler reported):
    def total(eng, event):
        return sum(s.get(f"connector_handoffs,event={event}", 0) for s in eng.connector_stats)
    assert [total(prod, k) for k in ("published", "published_pages", "released")] == [1, 5, 1]
    assert [total(cons, k) for k in ("loaded", "loaded_pages", "load_failed")] == [1, 5, 0]
    assert cons.hits_by_source == {"external_unspecified": len(p)}
    finish_idle(prod)
    finish_idle(cons)
