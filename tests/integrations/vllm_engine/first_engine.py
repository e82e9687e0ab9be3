"""The first engine of a restart: ``python first_engine.py MODEL EXTRA_JSON SEED:LEN ...``
serves each prompt (``engine.prompt(SEED, LEN)``) once with HiCacheConnector, waits until
every save reached L3, prints its outputs (token ids, top-5 logprobs) as JSON and exits.
``FIRST_ENGINE_LLM``: more ``vllm.LLM`` arguments as a JSON object (a model's dtype, its cache mode)."""
import json
import os
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[3]))

from tests.integrations.vllm_engine.engine import Engine, prompt  # noqa: E402


def main(model: str, extra: str, specs: list[str]) -> None:
    eng = Engine(model, json.loads(extra), **json.loads(os.environ.get("FIRST_ENGINE_LLM", "{}")))
    prompts = [prompt(int(s), int(n)) for s, n in (x.split(":") for x in specs)]
    outs = [eng.generate([p])[0] for p in prompts]
    eng.check_integrity()  # settles: every save stored to L3
    s = eng.scheduler.stats()
    print("FIRST-ENGINE", json.dumps({"stored": s.stored_pages, "outs": [[o.tokens, o.logprobs] for o in outs]}))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3:])
