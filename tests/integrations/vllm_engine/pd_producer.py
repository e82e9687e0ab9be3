"""The prefill side of a P/D pair: ``python pd_producer.py MODEL EXTRA_JSON`` starts a
``vllm.LLM`` with HiCacheConnector as ``kv_producer`` and answers one JSON line on
stdout (``PD-PRODUCER {...}``) per JSON line on stdin:

* ``{"op": "prefill", "seed": S, "len": N}``: ``engine.prompt(S, N)`` with the
  ``kv_transfer_params`` vLLM's toy P/D proxy sends and ``max_tokens=1``, as the proxy
  does; steps until the handoff is complete in L3; answers the ``kv_transfer_params``
  vLLM returned and the token it sampled;
* ``{"op": "state"}``: one scheduler step (the producer notices the handoffs consumers
  took), the integrity checks, then the P/D counters and the metadata slots' figures;
* ``{"op": "quit"}``: shuts the engine down (its hello is withdrawn) and exits.

An engine per process (vLLM's); the test process runs the consumer.
"""
import json
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[3]))

from tests.integrations.vllm_engine.engine import Engine, prompt  # noqa: E402

# vLLM's toy proxy (tests/v1/kv_connector/nixl_integration/toy_proxy_server.py,
# send_request_to_service) sends these to the prefill instance, with max_tokens=1.
TO_PREFILL = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
              "remote_block_ids": None, "remote_host": None, "remote_port": None}


def answer(obj: dict) -> None:
    print("PD-PRODUCER", json.dumps(obj), flush=True)


def state(eng: Engine) -> dict:
    eng.llm.generate([{"prompt_token_ids": [1, 2]}], eng._tick, use_tqdm=False)  # a step: the producer polls
    eng.check_integrity()
    eng.pd.check_integrity()
    st = eng.pd.slots.stats
    return {"counters": eng.pd.stats(), "free_slots": eng.pd.slots.num_free,
            "slots": {"consumed": st.consumed, "released": st.released}}


def main(model: str, extra: str) -> None:
    eng = Engine(model, json.loads(extra), kv_role="kv_producer")
    answer({"ready": True, "engine_id": eng.pd.engine_id})
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "prefill":
            out = eng.generate_with(prompt(cmd["seed"], cmd["len"]), TO_PREFILL, max_tokens=1)
            while eng.pd.publishing:  # vLLM keeps stepping for them (has_pending_push_work); so do we
                eng.llm.llm_engine.step()
            answer({"params": out.kv_transfer_params, "token": out.outputs[0].token_ids[0]})
        elif cmd["op"] == "state":
            answer(state(eng))
        else:
            break
    eng.llm.llm_engine.engine_core.shutdown()
    answer({"bye": True})


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
