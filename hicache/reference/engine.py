"""A small continuous-batching engine loop that uses ``HiCache`` as its cache
backend exactly as a production scheduler would: admit (match + prefetch +
load back), allocate, chunked prefill, commit after every chunk, decode,
finish, and ``poll`` once per step.

With a draft head (the layout has draft planes and the model a NextN head)
the engine runs speculative decoding: ``speculate_k`` drafted tokens per step,
verified greedily by the target (the same tokens as plain greedy decoding),
writing draft rows into the cache's draft planes; each request reports its
accept lengths. Its requests are draft requests, so the cache serves them only
pages whose draft planes are complete.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from hicache.index.prefix_cache import Request
from hicache.reference.model import verify_greedy
from hicache.core.errors import OutOfPages
from hicache.cache.hicache import HiCache


@dataclass(slots=True)
class RequestResult:
    rid: str
    prompt_tokens: int
    output: list[int]
    device_hit: int  # tokens hit on L1 at admission (page-floored)
    host_hit: int  # tokens loaded back from L2 (incl. those prefetched from L3)
    storage_hit: int  # tokens that came from L3
    computed: int  # prompt tokens recomputed
    ttft_s: float  # admission -> first token (wall clock)
    last_logits: torch.Tensor | None = None
    full: list[int] = field(default_factory=list)  # prompt + output, set at finish
    admitted: int = -1  # admission order (0, 1, ...)
    namespace: str = ""
    accept_lengths: list[int] = field(default_factory=list)  # per speculative step (draft head only)


@dataclass
class StepSample:
    """One point of the occupancy/hit-rate time series."""

    step: int
    t: float
    finished: int
    hit_rate: float  # cumulative scheduler-visible hit / prompt tokens
    l1_used: int
    l2_used: int
    admitted: int = 0  # requests admitted so far (the x axis that compares across runs)
    prompt_tokens: int = 0  # prompt tokens admitted so far
    l3_hit_tokens: int = 0  # cumulative hit tokens served from L3 (prefetched into L2)


@dataclass
class EngineRun:
    results: dict[str, RequestResult] = field(default_factory=dict)
    samples: list[StepSample] = field(default_factory=list)
    wall_s: float = 0.0

    def mean_accept_length(self) -> float | None:
        """Mean accepted drafts per speculative step over every request (None without a draft head)."""
        a = [x for r in self.results.values() for x in r.accept_lengths]
        return sum(a) / len(a) if a else None


class Engine:
    """Runs requests through ``model`` with ``cache`` as the KV cache backend.

    With ``model=None`` it runs the same schedule without computing anything
    (outputs are taken from ``forced_outputs``): that is how ``hicache replay``
    measures the baselines (L1-only cache, infinite cache) on the very same
    token streams.
    """

    def __init__(self, cache: HiCache, model=None, *, chunk_tokens: int = 256, max_running: int = 4,
                 keep_logits: bool = False, use_draft: bool | None = None, speculate_k: int = 3,
                 drain_each_step: bool = False):
        self.cache = cache
        self.model = model
        self.chunk_tokens = chunk_tokens
        self.max_running = max_running
        self.keep_logits = keep_logits
        # Observe every transfer at the end of each step instead of whenever it
        # happens to finish: tier contents then evolve identically run after
        # run, so a replay's figures are reproducible (costs the overlap).
        self.drain_each_step = drain_each_step
        self.pool = cache.device_pool
        can = self.pool.layout.draft_layers > 0 and (model is None or model.has_draft)
        if use_draft and not can:
            raise ValueError(f"use_draft=True needs draft planes (layout draft_layers="
                             f"{self.pool.layout.draft_layers}) and a model with a draft head")
        self.draft = can if use_draft is None else use_draft  # run the draft head, speculate
        if speculate_k < 1:
            raise ValueError(f"speculate_k must be >= 1, got {speculate_k}")
        self.speculate_k = speculate_k

    def run(self, items: Sequence, resolve: Callable[[object, dict[str, RequestResult]], list[int] | None],
            *, forced_outputs: dict[str, list[int]] | None = None,
            on_finish: Callable[[RequestResult], None] | None = None,
            l2_used: Callable[[], int] | None = None) -> EngineRun:
        """Serve ``items`` in arrival order. ``resolve(item, results)`` returns the
        prompt tokens, or None while the item waits on an unfinished parent.
        ``l2_used``: what each sample reads as L2 occupancy (default: the cache's own
        host pool; service mode passes the shared segment's)."""
        run = EngineRun()
        self._admitted = 0
        t0 = time.perf_counter()
        waiting = list(items)
        running: list[_Live] = []
        step = 0
        hit = prompt = l3_hit = 0
        while waiting or running:
            step += 1
            for live in self._admit_waiting(waiting, running, resolve, run):
                hit += live.result.device_hit + live.result.host_hit
                l3_hit += live.result.storage_hit
                prompt += live.result.prompt_tokens
            if not running:
                raise RuntimeError(f"{len(waiting)} requests wait on parents that never run; "
                                   f"first: {waiting[0]!r}")
            self._step_running(running, run, forced_outputs, on_finish)
            if self.drain_each_step:
                self.cache.drain()
            else:
                self.cache.poll()
            s = self.cache.cache.stats()
            run.samples.append(StepSample(step, time.perf_counter() - t0, len(run.results),
                                          hit / prompt if prompt else 0.0,
                                          s.device_pages_cached + s.device_pages_private,
                                          s.host_pages_cached if l2_used is None else l2_used(),
                                          self._admitted, prompt, l3_hit))
        self.cache.drain()
        run.wall_s = time.perf_counter() - t0
        return run

    def _admit_waiting(self, waiting: list, running: list[_Live], resolve, run: EngineRun) -> list[_Live]:
        """One step's admission: FIFO, skipping items whose parent has not finished
        yet, while the running requests' footprints leave room. Returns the admitted."""
        admitted = []
        i = 0
        while len(running) < self.max_running and i < len(waiting):
            prompt_ids = resolve(waiting[i], run.results)
            if prompt_ids is None:
                i += 1
                continue
            need = self._footprint(len(prompt_ids), waiting[i].max_new_tokens)
            if sum(r.footprint for r in running) + need > self.pool.num_pages:
                if not running:
                    raise OutOfPages(f"request {waiting[i].rid!r} needs up to {need} L1 pages "
                                     f"({len(prompt_ids)} prompt + {waiting[i].max_new_tokens} new "
                                     f"tokens), the pool has {self.pool.num_pages}; raise "
                                     "pool.device_pages")
                break  # admission control: wait until running requests finish
            item = waiting.pop(i)
            live = self._admit(item, prompt_ids)
            live.footprint = need
            running.append(live)
            admitted.append(live)
        return admitted

    def _step_running(self, running: list[_Live], run: EngineRun, forced_outputs: dict[str, list[int]] | None,
                      on_finish: Callable[[RequestResult], None] | None) -> None:
        """One decode (or prefill) step of every running request; finished ones leave ``running``."""
        for live in list(running):
            try:
                done = self._step(live, forced_outputs)
            except OutOfPages:
                # Admission reserved room for every running request; only pages
                # pinned by in-flight backups can be short. Let them finish once.
                self.cache.drain()
                done = self._step(live, forced_outputs)
            if done:
                live.result.full = live.prompt + live.result.output
                live.req.finish()
                running.remove(live)
                run.results[live.result.rid] = live.result
                if on_finish is not None:
                    on_finish(live.result)

    def _footprint(self, prompt_tokens: int, max_new: int) -> int:
        """Worst-case L1 pages a request holds over its life (shared prefix included)."""
        extra = self.speculate_k + 1 if self.draft else 1
        return -(-(prompt_tokens + max_new + extra) // self.pool.page_size)

    # ----------------------------------------------------------------- steps
    def _admit(self, item, prompt_ids: list[int]) -> "_Live":
        t = time.perf_counter()
        req = self.cache.new_request(item.rid, prompt_ids, item.namespace, draft=self.draft)
        adm = self.cache.admit(req)
        adm.wait()
        res = RequestResult(item.rid, len(prompt_ids), [], adm.device_tokens, adm.host_tokens,
                            adm.storage_tokens, 0, 0.0, admitted=self._admitted, namespace=req.namespace)
        self._admitted += 1
        return _Live(item, req, prompt_ids, res, t, req.computed_tokens)

    def _slots(self, req: Request, upto: int) -> torch.Tensor:
        """The page table of ``req`` up to token ``upto`` (a host tensor: the model
        checks it on the host and uploads it once)."""
        return self.pool.slot_ids(req.pages)[:upto]

    def _step(self, live: "_Live", forced: dict[str, list[int]] | None) -> bool:
        """One scheduler step for one request; True when it has finished."""
        req, n_prompt = live.req, len(live.prompt)
        if req.computed_tokens < n_prompt:  # chunked prefill
            start = req.computed_tokens
            n = min(self.chunk_tokens, n_prompt - start)
            req.alloc(n)
            out = None
            end = start + n
            nxt = live.prompt[end] if self.draft and end < n_prompt else None
            if self.model is not None:
                out = self.model.forward_chunk(self.pool, live.prompt[start:end], start,
                                               self._slots(req, end), draft=self.draft, next_token=nxt)
            if self.draft:  # a draft row needs the next token: the last one waits for it
                req.commit(n, draft_tokens=end if nxt is not None else end - 1)
            else:
                req.commit(n)
            live.result.computed += n
            if req.computed_tokens < n_prompt:
                return False
            live.result.ttft_s = time.perf_counter() - live.t_admit
            live.logits = None if out is None else out.logits_last
            live.hidden = None if out is None else out.hidden_last
            if self.keep_logits and out is not None:
                live.result.last_logits = out.logits_last.clone()
        max_new = live.item.max_new_tokens
        if len(live.result.output) >= max_new:
            return True
        if self.draft and self.model is not None:
            return self._speculative_step(live, max_new)
        # decode one token
        if self.model is None:
            tok = forced[live.result.rid][len(live.result.output)] if forced else 0
        else:
            tok = int(live.logits.argmax())
        live.result.output.append(tok)
        if len(live.result.output) >= max_new:
            return True
        pos = req.num_tokens
        req.extend([tok])
        req.alloc(1)
        if self.model is not None:
            out = self.model.decode_step(self.pool, tok, pos, self._slots(req, pos + 1), draft=False)
            live.logits = out.logits_last
        req.commit(1)
        return False

    def _speculative_step(self, live: "_Live", max_new: int) -> bool:
        """Draft ``k`` tokens, verify them in one target chunk, keep the accepted ones."""
        req, out, k, m = live.req, live.result.output, self.speculate_k, self.model
        if not out:
            out.append(int(live.logits.argmax()))  # first token, from the prefill
            if len(out) >= max_new:
                return True
        tok, pos = out[-1], req.num_tokens  # tok sits at pos; the target hidden at pos - 1 is live.hidden
        req.extend([tok] + [0] * k)  # slots for the verify chunk; drafts are filled in below
        req.alloc(k + 1)
        slots = self._slots(req, pos + k + 1)
        d = m.speculate(self.pool, live.hidden, tok, pos - 1, slots, k)
        v = m.forward_chunk(self.pool, [tok, *d.tokens], pos, slots, all_logits=True)
        verdict = verify_greedy(v.logits, d.tokens)
        live.result.accept_lengths.append(verdict.accept_length)
        a = min(verdict.accept_length, max_new - len(out) - 1)  # never feed past the output
        req.replace_uncommitted([tok, *d.tokens[:a]])
        req.commit(a + 1)
        out += verdict.tokens[:a + 1]
        live.hidden, live.logits = v.hidden[a], v.logits[a]
        return len(out) >= max_new


@dataclass
class _Live:
    item: object
    req: Request
    prompt: list[int]
    result: RequestResult
    t_admit: float
    hit_tokens: int
    logits: torch.Tensor | None = None
    hidden: torch.Tensor | None = None  # target hidden of the last fed token (draft head input)
    footprint: int = 0  # worst-case L1 pages reserved by admission control


def iter_progress(total: int, enabled: bool):
    """A tqdm progress bar on stderr (quiet when disabled)."""
    from tqdm import tqdm
    return tqdm(total=total, disable=not enabled, unit="req", dynamic_ncols=True, leave=False)


__all__ = ["Engine", "EngineRun", "RequestResult", "StepSample", "iter_progress"]

