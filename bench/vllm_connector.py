"""KV connectors side by side in vLLM 0.33's own scheduler harness, on a Mooncake conversation slice.

    PYTHONPATH=. VLLM_TARGET_DEVICE=cpu HF_HUB_OFFLINE=1 HF_HOME=.engines/hf \\
        .venv-vllm/bin/python bench/vllm_connector.py [--limit 300] [--connectors offloading,offloading-fs,simple-cpu,hicache]

Each connector is built by vLLM's scheduler from its ``--kv-transfer-config`` fields
(``create_vllm_config`` / ``create_scheduler`` of tests/v1/kv_connector/unit/utils.py) with the
same host bytes, and the trace's requests (arrival order, ``--concurrency`` in flight, prompts
from the trace's hash blocks) run through it. vLLM's OffloadingConnector and
SimpleCPUOffloadConnector need CUDA on the worker side, so a stand-in worker completes each step's
jobs at once; HiCacheConnector's worker is its own (CPU copies). Scheduler host time is
``schedule()`` + ``update_from_output()``: wall time, and the CPU time of the scheduler's thread
in them (on a shared box the wall time's tail is mostly waiting for a core; the CPU time is
the step's own cost). Prints a table.
"""
from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / ".engines" / "vllm-0.33.0"))  # vLLM's tests package (its harness)

import torch  # noqa: E402
from tqdm import tqdm  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.kv_cache_interface import (FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec,  # noqa: E402
                                        KVCacheTensor)
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request  # noqa: E402

from tests.v1.kv_connector.unit.utils import EOS_TOKEN_ID, create_scheduler, create_vllm_config  # noqa: E402

from hicache.core.shapes import model_shape  # noqa: E402
from hicache.memory.paged_kv import vllm_kv_caches  # noqa: E402
from hicache.reference.hash_trace import iter_hash_trace  # noqa: E402

BLOCK = 16
TRACE = pathlib.Path("/work/shared/traces/mooncake_conversation_trace.jsonl")
CONNECTORS = ("offloading", "offloading-fs", "simple-cpu", "hicache")
WARMUP_STEPS = 2  # a connector's first steps allocate its host memory: not a step's cost


@dataclass
class Tally:
    """What one connector's replay did."""

    prompt_tokens: int = 0
    local_hit: int = 0  # vLLM's own prefix cache
    connector_hit: int = 0  # served by the connector (vLLM's connector_prefix_cache_stats)
    loaded_bytes: int = 0
    stored_bytes: int = 0
    step_s: list[float] = field(default_factory=list)  # scheduler host time per step that scheduled tokens
    step_cpu: list[float] = field(default_factory=list)  # the same steps' CPU time on the scheduler's thread
    steps: int = 0
    skipped: int = 0  # requests longer than max_model_len


def extra_config(name: str, host_bytes: int, tmp: str) -> tuple[str, str | None, dict]:
    """(kv_connector, module path, kv_connector_extra_config) of one connector at ``host_bytes``."""
    if name == "offloading":
        return "OffloadingConnector", None, {"cpu_bytes_to_use": host_bytes}
    if name == "offloading-fs":
        return "OffloadingConnector", None, {"spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": host_bytes,
                                             "secondary_tiers": [{"type": "fs", "root_dir": f"{tmp}/fs"}]}
    if name == "simple-cpu":
        return "SimpleCPUOffloadConnector", None, {"cpu_bytes_to_use": host_bytes}
    if name == "hicache":
        # always_load: the stand-in forward takes no time, so a measured prefill rate would be
        # infinite and the cost model would (rightly, for that "engine") recompute every hit.
        return "HiCacheConnector", "hicache.integrations.vllm_connector", {
            "host_bytes": host_bytes, "storage": {"url": ""}, "admission": {"policy": "always_load"}}
    raise SystemExit(f"unknown connector {name!r}; choose from {', '.join(CONNECTORS)}")


class StandInWorker:
    """vLLM's connectors' workers need CUDA: complete every job of a step at once, as their
    workers report it (OffloadingWorkerMetadata / SimpleCPUOffloadWorkerMetadata, finished_recving)."""

    def __init__(self, block_bytes: int):
        self.block_bytes = block_bytes

    def step(self, meta, tally: Tally, finished: set[str]) -> KVConnectorOutput:
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
            OffloadingConnectorMetadata, OffloadingWorkerMetadata)
        from vllm.v1.simple_kv_offload.metadata import SimpleCPUOffloadMetadata, SimpleCPUOffloadWorkerMetadata
        recving: set[str] = set()
        wmeta = None
        if isinstance(meta, OffloadingConnectorMetadata):
            wmeta = OffloadingWorkerMetadata()
            for jid, job in meta.load_jobs.items():
                wmeta.mark_completed(jid)
                recving.add(job.req_id)
                tally.loaded_bytes += len(job.dst_spec.block_ids) * self.block_bytes
            for jid, job in meta.store_jobs.items():
                wmeta.mark_completed(jid)
                tally.stored_bytes += len(job.src_spec.block_ids) * self.block_bytes
            wmeta = wmeta if wmeta.completed_jobs else None
        elif isinstance(meta, SimpleCPUOffloadMetadata):
            if meta.load_event >= 0:
                recving.update(meta.load_event_to_reqs.get(meta.load_event, ()))
                tally.loaded_bytes += len(meta.load_gpu_blocks) * self.block_bytes
            if meta.store_event >= 0:
                wmeta = SimpleCPUOffloadWorkerMetadata(completed_store_events={meta.store_event: 1})
                tally.stored_bytes += len(meta.store_gpu_blocks) * self.block_bytes
        return KVConnectorOutput(finished_sending=set(), finished_recving=recving, invalid_block_ids=set(),
                                 kv_connector_worker_meta=wmeta)


class OwnWorker:
    """A connector's own worker role (KVConnectorFactory), driven in the model runner's order."""

    def __init__(self, vllm_config, kv_config: KVCacheConfig, layout, num_blocks: int):
        self.w = KVConnectorFactory.create_connector(vllm_config, KVConnectorRole.WORKER, kv_config)
        self.names = list(kv_config.kv_cache_groups[0].layer_names)
        self.w.register_kv_caches(dict(zip(self.names, vllm_kv_caches(layout, num_blocks).values())))
        self.page_bytes = layout.page_bytes

    def step(self, meta, tally: Tally, finished: set[str]) -> KVConnectorOutput:
        w = self.w
        w.bind_connector_metadata(meta)
        w.start_load_kv(None)
        for name in self.names:
            w.wait_for_layer_load(name)
        w.wait_for_save()
        sending, recving = w.get_finished(finished)
        out = KVConnectorOutput(finished_sending=sending, finished_recving=recving,
                                invalid_block_ids=w.get_block_ids_with_load_errors(),
                                kv_connector_worker_meta=w.build_connector_worker_meta())
        w.clear_connector_metadata()
        return out

    def moved(self, tally: Tally) -> None:
        """Bytes its transfer engine moved (hicache's TransferController counters)."""
        tc = self.w.worker._tc  # the ConnectorWorker's TransferController (no public accessor yet)
        tally.loaded_bytes, tally.stored_bytes = tc.bytes_moved["h2d"], tc.bytes_moved["d2h"]

    def close(self) -> None:
        self.w.shutdown()


def trace_requests(limit: int, max_len: int) -> tuple[list[list[int]], int]:
    """A multi-turn slice: whole conversations of two or more turns (a turn continues the
    conversation that already has its second block), earliest first, until ``limit`` requests,
    replayed in arrival order. Returns the prompts (hash blocks of 512 tokens) and how many
    of the slice's requests were longer than ``max_len`` (left out)."""
    reqs = list(iter_hash_trace(TRACE))
    root_of_block: dict[int, int] = {}
    turns: dict[int, list[int]] = {}
    for r in reqs:
        root = root_of_block.get(r.hash_ids[1], r.index) if len(r.hash_ids) > 1 else r.index
        turns.setdefault(root, []).append(r.index)
        for h in r.hash_ids[1:]:
            root_of_block.setdefault(h, root)
    picked: list[int] = []
    for members in turns.values():  # dicts keep insertion order: conversations by first arrival
        if len(members) > 1 and len(picked) + len(members) <= limit:
            picked += members
    keep = [reqs[i] for i in sorted(picked)]
    out = [[int(t) for t in r.tokens(512, BLOCK)] for r in keep if r.input_length <= max_len]
    return out, len(keep) - len(out)


def make_request(rid: str, tokens: list[int], max_tokens: int) -> Request:
    sp = SamplingParams(max_tokens=max_tokens)
    sp.update_from_generation_config({}, EOS_TOKEN_ID)
    return Request(request_id=rid, prompt_token_ids=tokens, sampling_params=sp, pooling_params=None,
                   mm_features=None, block_hasher=get_request_block_hasher(BLOCK, sha256))


def build(name: str, a, layout, tmp: str):
    """vLLM's scheduler with connector ``name`` (built by vLLM from the config), and its worker."""
    connector, module, extra = extra_config(name, a.host_mib << 20, tmp)
    cfg = create_vllm_config(kv_connector=connector, kv_connector_module_path=module, kv_role="kv_both",
                             kv_connector_extra_config=extra, kv_load_failure_policy="recompute",
                             max_num_batched_tokens=a.tokens_per_step, max_model_len=a.max_model_len,
                             max_num_seqs=a.concurrency, block_size=BLOCK,
                             hf_overrides={"max_position_embeddings": a.max_model_len})  # opt-125m's is 2048
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
    cfg.attention_config.backend = AttentionBackendEnum.FLASH_ATTN  # a GPU server's (the tensors below are its)
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=layout.num_kv_heads, head_size=layout.head_dim,
                             dtype=getattr(torch, layout.dtype))
    names = [f"model.layers.{i}.self_attn" for i in range(layout.num_layers)]
    page = spec.page_size_bytes  # one layer-outer tensor over every layer, as vLLM's planner lays LBNHC out
    tensor = KVCacheTensor(size=page * a.gpu_blocks * len(names), layers=names, layer_stride=page * a.gpu_blocks,
                           block_stride=page)
    kv_config = KVCacheConfig(num_blocks=a.gpu_blocks, kv_cache_tensors=[tensor],
                              kv_cache_groups=[KVCacheGroupSpec(names, spec)])
    sched = create_scheduler(cfg, num_blocks=a.gpu_blocks, kv_cache_config=kv_config)
    worker = (OwnWorker(cfg, kv_config, layout, a.gpu_blocks) if name == "hicache"
              else StandInWorker(layout.page_bytes))
    return sched, worker


def step(sched, worker, t: Tally, max_tokens: int) -> tuple[list, bool]:
    """One engine step; returns (finished request ids, whether it scheduled tokens)."""
    t0, c0 = time.perf_counter(), time.thread_time()
    so = sched.schedule()
    t1, c1 = time.perf_counter(), time.thread_time()
    kvo = worker.step(so.kv_connector_metadata, t, so.finished_req_ids)
    ids, sampled = [], []
    for rid in so.num_scheduled_tokens:
        req = sched.requests[rid]
        ids.append(rid)
        sampled.append([EOS_TOKEN_ID if req.num_output_tokens + 1 >= max_tokens else 7]
                       if req.num_computed_tokens >= req.num_tokens else [])
    mro = ModelRunnerOutput(req_ids=ids, req_id_to_index={r: k for k, r in enumerate(ids)},
                            sampled_token_ids=sampled, logprobs=None, prompt_logprobs_dict={},
                            pooler_output=None, kv_connector_output=kvo)
    t2, c2 = time.perf_counter(), time.thread_time()
    outs = sched.update_from_output(so, mro)
    t.steps += 1
    if so.num_scheduled_tokens and t.steps > WARMUP_STEPS:  # steps that ran a forward
        t.step_s.append(t1 - t0 + time.perf_counter() - t2)
        t.step_cpu.append(c1 - c0 + time.thread_time() - c2)
    finished = []
    for eco in outs.values():
        finished += [o.request_id for o in eco.outputs if o.finish_reason is not None]
        st = eco.scheduler_stats
        if st is not None and st.prefix_cache_stats is not None:
            t.local_hit += st.prefix_cache_stats.hits
        if st is not None and st.connector_prefix_cache_stats is not None:
            t.connector_hit += st.connector_prefix_cache_stats.hits
    return finished, bool(so.num_scheduled_tokens)


def replay(name: str, prompts: list[list[int]], a, layout, tmp: str) -> Tally:
    """One connector through vLLM's scheduler over the whole slice, ``a.concurrency`` in flight."""
    sched, worker = build(name, a, layout, tmp)
    t = Tally()
    todo, live, done = list(enumerate(prompts)), set(), 0
    bar = tqdm(total=len(prompts), desc=name, unit="req", file=sys.stderr, leave=False)
    while todo or live:
        while todo and len(live) < a.concurrency:
            i, p = todo.pop(0)
            sched.add_request(make_request(f"r{i}", p, a.max_tokens))
            live.add(f"r{i}")
            t.prompt_tokens += len(p)
        finished, busy = step(sched, worker, t, a.max_tokens)
        for rid in finished:
            if rid in live:
                live.discard(rid)
                done += 1
                bar.update(1)
        if not busy:
            time.sleep(0.001)  # a connector's copies run on its own threads
    bar.close()
    sched.shutdown()  # the connector's threads (fs tier writers) stop before its directory goes
    if isinstance(worker, OwnWorker):
        worker.moved(t)
        worker.close()
    assert done == len(prompts), f"{name}: {done} of {len(prompts)} requests finished"
    return t


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--connectors", default=",".join(CONNECTORS), help=f"comma-separated: {', '.join(CONNECTORS)}")
    ap.add_argument("--limit", type=int, default=150, help="requests of the multi-turn slice")
    ap.add_argument("--shape", default="llama-3.2-1b", help="model shape (hicache/data/real_models.json)")
    ap.add_argument("--host-mib", type=int, default=4096, help="host bytes every connector gets")
    ap.add_argument("--gpu-blocks", type=int, default=3000, help="vLLM's GPU blocks (its own prefix cache)")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--tokens-per-step", type=int, default=8192)
    ap.add_argument("--max-model-len", type=int, default=32768)
    ap.add_argument("--max-tokens", type=int, default=2, help="tokens generated per request")
    a = ap.parse_args()
    init_none_hash(sha256)
    layout = model_shape(a.shape).kv_layout(BLOCK)
    prompts, skipped = trace_requests(a.limit, a.max_model_len - a.max_tokens)
    names = [c for c in a.connectors.split(",") if c]
    total = sum(map(len, prompts))
    print(f"# vLLM connectors, vLLM 0.33 scheduler harness, {len(prompts)} Mooncake conversation requests (multi-turn) "
          f"({total} prompt tokens; {skipped} longer than {a.max_model_len} left out), {a.shape} at block "
          f"{BLOCK} ({layout.page_bytes >> 10} KiB/block), {a.host_mib} MiB host each, {a.gpu_blocks} GPU blocks, "
          f"{a.concurrency} in flight, {a.tokens_per_step} tokens/step\n")
    print("| connector | tokens from connector | vLLM prefix hit | tokens recomputed | step host ms "
          "median | p99 | step CPU ms median | p99 | host s, all forward steps | forward steps / all steps "
          "| GiB loaded | GiB stored |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|", flush=True)
    with tempfile.TemporaryDirectory(prefix="hicache-bench-conn-", ignore_cleanup_errors=True) as tmp:
        for name in names:
            t = replay(name, prompts, a, layout, tmp)
            s, c = sorted(t.step_s), sorted(t.step_cpu)
            p99, c99 = (x[min(len(x) - 1, int(0.99 * len(x)))] for x in (s, c))
            print(f"| {name} | {t.connector_hit} | {t.local_hit} | {t.prompt_tokens - t.local_hit - t.connector_hit} "
                  f"| {statistics.median(s) * 1e3:.3f} | {p99 * 1e3:.3f} | {statistics.median(c) * 1e3:.3f} "
                  f"| {c99 * 1e3:.3f} | {sum(s):.2f} | {len(s) + WARMUP_STEPS} / "
                  f"{t.steps} | {t.loaded_bytes / 2**30:.2f} "
                  f"| {t.stored_bytes / 2**30:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
