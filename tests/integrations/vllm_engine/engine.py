"""One real ``vllm.LLM`` (vLLM's CPU build) with HiCacheConnector, in this process.

The engine core runs in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so the
tests can reach both connector halves (stats, integrity, the L2 bytes for the
negative control). Prompts are token ids; decoding is greedy with top-5
logprobs; block size 32 (CPU_ATTN refuses 16).

The exact reference for a warm run is vLLM's own prefix hit of the same length
(its CPU kernels are deterministic for one split of a prompt, not across
splits): ``Engine.reference`` serves a prompt once to fill vLLM's prefix cache
and then again from it.
"""
from __future__ import annotations

import os
import pathlib
import random
import signal
import subprocess
import time
from typing import NamedTuple

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

BLOCK = 32
VOCAB = 512
TOP = 5


class Out(NamedTuple):
    tokens: tuple[int, ...]
    logprobs: tuple[tuple[tuple[int, float], ...], ...]  # per generated token: its top-5 (id, logprob)
    cached: int  # prompt tokens served from a cache (vLLM's own or the connector's)


def prompt(seed: int, n: int) -> list[int]:
    r = random.Random(seed)
    return [r.randrange(3, VOCAB) for _ in range(n)]


class Engine:
    """``vllm.LLM`` on checkpoint ``model`` with HiCacheConnector (``extra``: its config;
    ``kv_role``: a cache, or one side of a P/D pair)."""

    def __init__(self, model: str, extra: dict, *, dtype: str = "float32", max_batched: int = 4096,
                 kv_bytes: int = 256 << 20, max_tokens: int = 6, max_model_len: int = 4096,
                 kv_role: str = "kv_both", **llm_kw):
        from vllm import LLM, SamplingParams
        from vllm.config import KVTransferConfig
        ktc = KVTransferConfig(kv_connector="HiCacheConnector",
                               kv_connector_module_path="hicache.integrations.vllm_connector",
                               kv_role=kv_role, kv_connector_extra_config=extra,
                               kv_load_failure_policy="recompute")
        self.llm = LLM(model=model, block_size=BLOCK, enforce_eager=True, max_model_len=max_model_len, dtype=dtype,
                       max_num_batched_tokens=max_batched, enable_prefix_caching=True, kv_transfer_config=ktc,
                       seed=0, kv_cache_memory_bytes=kv_bytes, **llm_kw)
        self.sampling = SamplingParams(max_tokens=max_tokens, temperature=0, logprobs=TOP, ignore_eos=True)
        self._tick = SamplingParams(max_tokens=1, temperature=0)

    def generate(self, prompts: list[list[int]]) -> list[Out]:
        outs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], self.sampling, use_tqdm=False)
        return [Out(tuple(o.outputs[0].token_ids),
                    tuple(tuple(sorted((k, v.logprob) for k, v in d.items())) for d in o.outputs[0].logprobs),
                    o.num_cached_tokens or 0) for o in outs]

    def generate_with(self, p: list[int], kv_transfer_params: dict | None = None, *, max_tokens: int = 0,
                      salt: str = ""):
        """One prompt, greedy with top-5 logprobs, with ``kv_transfer_params`` (what a P/D
        proxy sends) and ``salt`` (vLLM's ``cache_salt``): vLLM's ``RequestOutput`` (a
        producer's ``kv_transfer_params`` are in it)."""
        from vllm import SamplingParams
        extra = {"kv_transfer_params": dict(kv_transfer_params)} if kv_transfer_params else None
        sp = SamplingParams(max_tokens=max_tokens or self.sampling.max_tokens, temperature=0, logprobs=TOP,
                            ignore_eos=True, extra_args=extra)
        [o] = self.llm.generate([{"prompt_token_ids": p, **({"cache_salt": salt} if salt else {})}], sp,
                                use_tqdm=False)
        return o

    def forget_own(self) -> None:
        """Empty vLLM's own prefix cache (it refuses while a save still holds a request's blocks)."""
        for _ in range(200):
            if self.llm.reset_prefix_cache():
                return
            self.llm.llm_engine.step()  # vLLM steps while a finished request waits for its save
            time.sleep(0.005)
        raise AssertionError("vLLM's prefix cache would not reset")

    def reference(self, prompts: list[list[int]]) -> list[Out]:
        """vLLM's own prefix hit: serve the prompts (filling its cache), then again from it."""
        self.forget_own()
        self.generate(prompts)
        return self.generate(prompts)

    @property
    def scheduler(self):
        """The connector's scheduler half (``hicache.connector.scheduler.ConnectorScheduler``)."""
        return self.llm.llm_engine.engine_core.engine_core.scheduler.connector.scheduler

    @property
    def pd(self):
        """The connector's P/D side (``hicache.connector.pd.Handoffs``; None as ``kv_both``)."""
        return self.llm.llm_engine.engine_core.engine_core.scheduler.connector.pd

    @property
    def worker(self):
        """The connector's worker half (``hicache.connector.worker.ConnectorWorker``)."""
        from vllm.distributed.kv_transfer import get_kv_transfer_group
        return get_kv_transfer_group().worker

    def settle(self) -> None:
        """Run engine steps until the connector has no job in flight (saves reach L2 and L3).
        An idle vLLM takes no step, and workers report L3 stores in steps: a one-token
        request (no full page, nothing cached) drives them."""
        for _ in range(100):
            if not self.scheduler.in_flight:
                return
            self.llm.llm_engine.step()
            if not self.llm.llm_engine.has_unfinished_requests():
                self.llm.generate([{"prompt_token_ids": [1, 2]}], self._tick, use_tqdm=False)
            time.sleep(0.01)
        raise AssertionError(f"{self.scheduler.in_flight} connector jobs still in flight")

    def check_integrity(self) -> None:
        self.settle()
        self.scheduler.check_integrity()


def as_out(o) -> Out:
    """A ``RequestOutput`` (of ``Engine.generate_with``) as token ids, top-5 logprobs and cached prompt tokens."""
    return Out(tuple(o.outputs[0].token_ids),
               tuple(tuple(sorted((k, v.logprob) for k, v in d.items())) for d in o.outputs[0].logprobs or ()),
               o.num_cached_tokens or 0)


def run_group_bg(argv: list[str], env: dict, log: pathlib.Path) -> subprocess.Popen:
    """Start ``argv`` in its own process group, output to ``log`` (``stop_group`` ends it)."""
    return subprocess.Popen(argv, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True)


def stop_group(proc: subprocess.Popen) -> None:
    """End a process group: SIGTERM, then SIGKILL after 20 s."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
