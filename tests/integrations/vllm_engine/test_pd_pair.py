"""Prefill/decode disaggregation between two real vLLM engines (vLLM's CPU build).

A prefill ``vllm.LLM`` (``kv_producer``, its own process: ``pd_producer.py``) and a
decode ``vllm.LLM`` (``kv_consumer``, this process) share one ``file://`` L3. The
prefill side gets each prompt with the ``kv_transfer_params`` vLLM's toy P/D proxy
sends and ``max_tokens=1``; the params it answers go to the decode side unchanged,
as the proxy sends them on.

The reference for a decode is this decode engine serving the same prompt from vLLM's
own prefix cache with a hit of the same length: a prompt of 3 blocks + 1 token hands
off 97 tokens, of which vLLM recomputes the last, so the decode runs over a 96-token
hit, as vLLM's own hit of that prompt does. Reference runs carry a ``cache_salt``:
vLLM and the connector key them apart from the handoff requests, so no handoff
request can be served by a reference's pages. A broken handoff recomputed from its
first page is a cold pass, so it must equal the cold reference bit for bit. (Here the
cold pass and the 96-token hit agree bit for bit too, so the counters say which path
ran, and a negative control shows the comparison sees a handoff off by 0.1%.)

The decode engine is started with ``kv_load_failure_policy=recompute`` (as the docs'
decode line); the policy ``fail`` case sets the one scheduler field vLLM derives from
that setting at start (``Scheduler.recompute_kv_load_failures``), so one decode
engine serves every case.
"""
from __future__ import annotations

import json
import logging
import os
import pathlib
import re
import subprocess
import sys

import pytest
import torch

from hicache.connector.pd import handoff_keys, prompt_digest, record_key
from hicache.core.hashing import tokens_to_bytes
from tests.integrations.vllm_engine.checkpoint import write_checkpoint
from tests.integrations.vllm_engine.engine import BLOCK, Engine, as_out, prompt

HERE = pathlib.Path(__file__).resolve().parent
SLOTS = 4
LEN = 3 * BLOCK + 1  # 4 pages hand off, the last of them partial


class Producer:
    """The prefill engine's process (``pd_producer.py``), one JSON line each way."""

    def __init__(self, model: str, extra: dict, log: pathlib.Path):
        self.log = log
        self.proc = subprocess.Popen([sys.executable, str(HERE / "pd_producer.py"), model, json.dumps(extra)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=open(log, "w"),
                                     text=True, env=os.environ)

    def read(self) -> dict:
        for line in self.proc.stdout:
            if line.startswith("PD-PRODUCER "):
                return json.loads(line.split(" ", 1)[1])
        raise AssertionError(f"the producer exited {self.proc.wait()}:\n{self.log.read_text()[-4000:]}")

    def ask(self, **cmd) -> dict:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self.read()

    def prefill(self, seed: int) -> tuple[dict, int]:
        out = self.ask(op="prefill", seed=seed, len=LEN)
        return out["params"], out["token"]

    def close(self) -> None:
        if self.proc.poll() is None:
            assert self.ask(op="quit") == {"bye": True}
            rc = self.proc.wait(timeout=60)
            log = self.log.read_text()
            assert rc == 0 and "Traceback" not in log, log[-4000:]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    model = str(write_checkpoint(tmp_path_factory.mktemp("llama"), "llama-gqa", seed=0))
    l3 = tmp_path_factory.mktemp("l3")
    extra = {"storage": {"url": f"file://{l3}"}, "host_bytes": 32 << 20,
             "pd": {"group": "pair", "slots": SLOTS, "poll_s": 0, "wait_s": 0}}
    prod = Producer(model, extra, tmp_path_factory.mktemp("logs") / "producer.log")
    try:
        cons = Engine(model, extra, kv_role="kv_consumer", max_tokens=6)  # starts while the producer loads
        ready = prod.read()
        assert ready["ready"], ready
        yield prod, cons, l3
        cons.check_integrity()
        cons.pd.check_integrity()
        cons.llm.llm_engine.engine_core.shutdown()
    finally:
        prod.close()
    assert [f for f in (l3 / "hicache-pd").rglob("*") if f.is_file()] == []  # both sides withdrew their hellos


def _reference(cons: Engine, p: list[int]):
    """(cold pass, vLLM's own prefix hit) of ``p``, salted apart from handoff requests."""
    cons.forget_own()
    cold = as_out(cons.generate_with(p, salt="ref"))
    return cold, as_out(cons.generate_with(p, salt="ref"))


def _decode(cons: Engine, p: list[int], params: dict):
    cons.settle()
    cons.forget_own()  # vLLM's own cache holds nothing of p: the handoff supplies all of it
    return cons.generate_with(p, params)


def counters(cons: Engine, *names: str) -> tuple[int, ...]:
    return tuple(cons.pd.stats()[n] for n in names)


def test_decode_from_the_handoff_equals_vllm_own_hit(pair):
    prod, cons, _ = pair
    p = prompt(61, LEN)
    cold, ref = _reference(cons, p)
    assert ref.cached == 3 * BLOCK and ref.tokens == cold.tokens
    params, first = prod.prefill(61)
    assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
    assert params["remote_num_tokens"] == LEN and params["tp_size"] == 1
    handoff = params["hicache_handoff"]
    assert cons.pd.stores[0].exists([record_key(handoff)]) == [True]
    assert prod.ask(op="state")["free_slots"] == SLOTS - 1  # owned until the consumer takes the handoff
    before = cons.scheduler.stats().load_error_pages
    got = as_out(_decode(cons, p, params))
    assert got.tokens[0] == first  # the token the prefill side sampled
    assert (got.tokens, got.logprobs) == (ref.tokens, ref.logprobs)  # bit for bit
    assert counters(cons, "loaded", "loaded_pages", "load_failed") == (1, 4, 0)
    assert cons.scheduler.stats().load_error_pages == before
    # Consumed: the consumer's slot, the handoff's record and pages in L3, then the producer's slot.
    assert cons.pd.slots.num_free == SLOTS and cons.pd.slots.stats.consumed == 1
    keys = handoff_keys(handoff, prompt_digest(tokens_to_bytes(p)), 4)
    assert cons.pd.stores[0].exists([record_key(handoff), *keys]) == [False] * 5
    st = prod.ask(op="state")
    assert st["free_slots"] == SLOTS and st["slots"]["consumed"] == 1
    assert (st["counters"]["published"], st["counters"]["published_pages"], st["counters"]["released"]) == (1, 4, 1)
    cons.pd.check_integrity()


def test_negative_control_sees_a_handoff_off_by_a_thousandth(pair):
    """The comparison above can fail: the handoff's pages rewritten (valid objects) with
    every value scaled by 1.001 load in full, and the logprobs differ from the reference."""
    prod, cons, _ = pair
    p = prompt(65, LEN)
    _, ref = _reference(cons, p)
    params, _ = prod.prefill(65)
    store, sizes = cons.pd.stores[0], [s.page_bytes for s in cons.pd.layout.planes]
    for key in _handoff_pages(params["hicache_handoff"], p):
        [raw] = store.get([key], sizes)
        scaled = torch.frombuffer(bytearray(raw), dtype=torch.float32).mul(1.001)
        assert store.put([(key, scaled.numpy().tobytes(), sizes)]) == 1
    loaded = counters(cons, "loaded")[0]
    got = as_out(_decode(cons, p, params))
    assert counters(cons, "loaded")[0] == loaded + 1
    assert got.logprobs != ref.logprobs


def _flip(l3: pathlib.Path, key: bytes) -> None:
    [obj] = list(l3.rglob(key.hex()))
    raw = bytearray(obj.read_bytes())
    raw[len(raw) // 2] ^= 0x10
    obj.write_bytes(bytes(raw))


def _handoff_pages(handoff: str, p: list[int]) -> tuple[bytes, ...]:
    return handoff_keys(handoff, prompt_digest(tokens_to_bytes(p)), 4)


@pytest.mark.parametrize("broken", ["flipped_page", "missing_record"])
def test_a_broken_handoff_is_recomputed_as_a_cold_pass(pair, broken):
    """A flipped byte in the handoff's first page, or its record gone: every block fails,
    vLLM recomputes the prompt from token 0 in one pass, as the cold reference did."""
    prod, cons, l3 = pair
    seed = {"flipped_page": 62, "missing_record": 63}[broken]
    p = prompt(seed, LEN)
    cold, _ = _reference(cons, p)
    params, _ = prod.prefill(seed)
    handoff = params["hicache_handoff"]
    if broken == "flipped_page":
        _flip(l3, _handoff_pages(handoff, p)[0])
    else:
        assert cons.pd.stores[0].delete([record_key(handoff)]) == 1
    failed, errors = counters(cons, "load_failed")[0], cons.scheduler.stats().load_error_pages
    released = cons.pd.slots.stats.released
    got = as_out(_decode(cons, p, params))
    assert (got.tokens, got.logprobs) == (cold.tokens, cold.logprobs)  # bit for bit
    assert counters(cons, "load_failed", "loaded")[0] == failed + 1
    assert cons.scheduler.stats().load_error_pages == errors + 4
    assert cons.pd.slots.num_free == SLOTS and cons.pd.slots.stats.released == released + 1
    # The consumer deleted the handoff (without its record, it knows no page keys: the
    # producer deletes the pages once it sees the record gone); the producer's slot is free.
    st = prod.ask(op="state")
    assert st["free_slots"] == SLOTS and st["counters"]["expired"] == 0
    assert cons.pd.stores[0].exists([record_key(handoff), *_handoff_pages(handoff, p)]) == [False] * 5
    cons.pd.check_integrity()


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def test_policy_fail_fails_the_request_and_says_why(pair):
    prod, cons, l3 = pair
    p = prompt(64, LEN)
    params, _ = prod.prefill(64)
    handoff = params["hicache_handoff"]
    _flip(l3, _handoff_pages(handoff, p)[1])
    sched = cons.llm.llm_engine.engine_core.engine_core.scheduler
    logs, logger = _Records(), logging.getLogger("hicache.connector.pd")
    logger.addHandler(logs)
    sched.recompute_kv_load_failures = False  # what kv_load_failure_policy=fail sets at start
    try:
        out = _decode(cons, p, params).outputs[0]
    finally:
        sched.recompute_kv_load_failures = True
        logger.removeHandler(logs)
    assert (out.finish_reason, list(out.token_ids)) == ("error", [])
    [line] = logs.lines
    assert re.fullmatch(rf"hicache connector: P/D handoff {handoff} of request '[^']+' not loaded: 3 of its 4 pages "
                        r"not loaded \(one missing or failing verification in L3, and every later one\); vLLM "
                        "recomputes the request or fails it, as kv_load_failure_policy says", line), line
    assert cons.pd.slots.num_free == SLOTS and prod.ask(op="state")["free_slots"] == SLOTS
    cons.pd.check_integrity()
