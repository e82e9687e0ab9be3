"""Seeded workload generators, the built-in replay trace, and an infinite-cache oracle.

Three workloads, each a frozen config whose ``generate(seed, vocab)`` returns
requests sorted by arrival (deterministic: Python's ``random.Random`` seeded
with a string, stable across platforms and versions):

* ``ChatWorkload``: multi-turn conversations behind one short system prompt;
  turn ``i > 0`` is a follow-up (``parent`` = turn ``i - 1``, ``append`` = the
  new user tokens), so its prompt is the previous turn's prompt + answer +
  new tokens, resolved at replay time (see ``trace_format``);
* ``SystemPromptWorkload``: many requests behind a few long system prompts
  (Zipf-skewed popularity), each with its own user suffix;
* ``DocumentQAWorkload``: several questions over each of a few long documents.
"""
from __future__ import annotations
import dataclasses
import random
from dataclasses import dataclass
from typing import NamedTuple, Sequence
from hicache.reference.trace_format import (TRACE_VERSION, PromptResolver, Trace, TraceRequest, check_requests,
                                         read_trace, request_from_json, write_trace)
import argparse
import heapq
import json
import math
import os
from typing import Iterator


__all__ = ["TRACE_VERSION", "PromptResolver", "Trace", "TraceRequest", "check_requests", "read_trace",
           "request_from_json", "write_trace", "ChatWorkload", "SystemPromptWorkload", "DocumentQAWorkload",
           "mix", "builtin_trace", "SCALES", "ReuseStats", "oracle_reuse"]


def _tokens(rng: random.Random, n: int, vocab: int) -> tuple[int, ...]:
    return tuple(rng.randrange(1, vocab) for _ in range(n))  # 0 is left for padding


def _at(t: float) -> float:
    return round(t, 3)


@dataclass(frozen=True, slots=True)
class ChatWorkload:
    """ChatWorkload.

    The trace format, ``read_trace``/``write_trace`` and ``PromptResolver`` live in
    ``hicache.reference.trace_format`` and are re-exported here.
    """
    conversations: int = 12
    turns: int = 4
    system_tokens: int = 32  # shared by every conversation (0: none)
    user_tokens: tuple[int, int] = (16, 48)  # inclusive range per turn
    answer_tokens: int = 16  # max_new_tokens of every turn
    rate: float = 0.5  # conversation starts per second (Poisson)
    think_time: tuple[float, float] = (1.0, 4.0)  # seconds between a turn's and the next turn's arrival
    namespace: str = ""
    prefix: str = "chat"

    def generate(self, seed: int, vocab: int) -> list[TraceRequest]:
        rng = random.Random(f"{seed}:{self.prefix}:chat")
        system = _tokens(rng, self.system_tokens, vocab)
        out, t = [], 0.0
        for c in range(self.conversations):
            t += rng.expovariate(self.rate)
            conv, at, parent = f"{self.prefix}-{c:03d}", t, None
            for turn in range(self.turns):
                user = _tokens(rng, rng.randint(*self.user_tokens), vocab)
                rid = f"{conv}-t{turn}"
                if parent is None:
                    req = TraceRequest(rid, _at(at), self.answer_tokens, prompt=system + user,
                                       namespace=self.namespace, conversation=conv)
                else:
                    req = TraceRequest(rid, _at(at), self.answer_tokens, parent=parent, append=user,
                                       namespace=self.namespace, conversation=conv)
                out.append(req)
                parent, at = rid, at + rng.uniform(*self.think_time)
        return sorted(out, key=lambda r: r.arrival)  # stable: a turn never precedes its parent


@dataclass(frozen=True, slots=True)
class SystemPromptWorkload:
    system_prompts: int = 3
    requests: int = 64
    system_tokens: int = 256
    user_tokens: tuple[int, int] = (8, 40)
    answer_tokens: int = 8
    rate: float = 2.0  # requests per second (Poisson)
    skew: float = 1.0  # popularity of system prompt i is proportional to 1 / (i + 1) ** skew
    namespace: str = ""
    prefix: str = "sys"

    def generate(self, seed: int, vocab: int) -> list[TraceRequest]:
        rng = random.Random(f"{seed}:{self.prefix}:system")
        systems = [_tokens(rng, self.system_tokens, vocab) for _ in range(self.system_prompts)]
        weights = [1.0 / (i + 1) ** self.skew for i in range(self.system_prompts)]
        out, t = [], 0.0
        for i in range(self.requests):
            t += rng.expovariate(self.rate)
            system = rng.choices(systems, weights)[0]
            user = _tokens(rng, rng.randint(*self.user_tokens), vocab)
            out.append(TraceRequest(f"{self.prefix}-{i:04d}", _at(t), self.answer_tokens, prompt=system + user,
                                    namespace=self.namespace))
        return out


@dataclass(frozen=True, slots=True)
class DocumentQAWorkload:
    documents: int = 4
    questions: int = 6  # per document
    document_tokens: int = 1024
    question_tokens: tuple[int, int] = (12, 32)
    answer_tokens: int = 12
    rate: float = 0.8  # questions per second (Poisson), documents interleaved
    namespace: str = ""
    prefix: str = "doc"

    def generate(self, seed: int, vocab: int) -> list[TraceRequest]:
        rng = random.Random(f"{seed}:{self.prefix}:docqa")
        docs = [_tokens(rng, self.document_tokens, vocab) for _ in range(self.documents)]
        order = [d for d in range(self.documents) for _ in range(self.questions)]
        rng.shuffle(order)
        out, t, asked = [], 0.0, [0] * self.documents
        for d in order:
            t += rng.expovariate(self.rate)
            q = _tokens(rng, rng.randint(*self.question_tokens), vocab)
            out.append(TraceRequest(f"{self.prefix}-{d}-q{asked[d]}", _at(t), self.answer_tokens, prompt=docs[d] + q,
                                    namespace=self.namespace))
            asked[d] += 1
        return out


Workload = ChatWorkload | SystemPromptWorkload | DocumentQAWorkload


def mix(*parts: Sequence[TraceRequest]) -> list[TraceRequest]:
    """Merge request lists by arrival (stable: ties keep argument order)."""
    merged = [r for part in parts for r in part]
    rids = [r.rid for r in merged]
    if len(set(rids)) != len(rids):
        raise ValueError("mix(): request ids collide across workloads; give each workload its own prefix")
    return sorted(merged, key=lambda r: r.arrival)


# name -> workloads per scale. "small" replays in ~20-40 s on a 2-core CPU with the
# tiny reference model (page 16): ~3K prompt pages + ~1.6K decode steps computed cold.
SCALES: dict[str, dict[str, Workload]] = {
    "tiny": {
        "chat": ChatWorkload(conversations=2, turns=3, system_tokens=8, user_tokens=(6, 12), answer_tokens=4),
        "system": SystemPromptWorkload(system_prompts=2, requests=6, system_tokens=48, user_tokens=(4, 10),
                                       answer_tokens=4),
        "docs": DocumentQAWorkload(documents=1, questions=3, document_tokens=96, question_tokens=(4, 8),
                                   answer_tokens=4),
    },
    "small": {"chat": ChatWorkload(), "system": SystemPromptWorkload(), "docs": DocumentQAWorkload()},
    "medium": {
        "chat": ChatWorkload(conversations=48, turns=6, system_tokens=128, user_tokens=(32, 128), answer_tokens=64,
                             rate=2.0),
        "system": SystemPromptWorkload(system_prompts=8, requests=256, system_tokens=1024, answer_tokens=32,
                                       rate=8.0),
        "docs": DocumentQAWorkload(documents=8, questions=12, document_tokens=4096, answer_tokens=32, rate=3.0),
    },
}
_VOCAB = 512  # the builtin traces' token ids lie in [1, 512)


def builtin_trace(name: str = "mixed", scale: str = "small", seed: int = 0) -> Trace:
    """A deterministic built-in trace: ``name`` is ``mixed`` (all three workloads,
    the document questions under namespace ``"rag"``) or one of ``chat``,
    ``system``, ``docs``; ``scale`` is one of ``SCALES``. Token ids < 512."""
    if scale not in SCALES:
        raise ValueError(f"unknown trace scale {scale!r}; choose one of {sorted(SCALES)}")
    parts = SCALES[scale]
    if name == "mixed":
        docs = parts["docs"]
        assert isinstance(docs, DocumentQAWorkload), f"SCALES[{scale!r}]['docs'] is {type(docs).__name__}"
        parts = {**parts, "docs": dataclasses.replace(docs, namespace="rag")}
        reqs = mix(*(w.generate(seed, _VOCAB) for w in parts.values()))
    elif name in parts:
        reqs = parts[name].generate(seed, _VOCAB)
    else:
        raise ValueError(f"unknown builtin trace {name!r}; choose 'mixed' or one of {sorted(parts)}")
    check_requests(reqs, _VOCAB, where=f"builtin_trace({name!r}, {scale!r})")
    return Trace(f"{name}-{scale}", _VOCAB, reqs)


# ---------------------------------------------------------------------- oracle
class ReuseStats(NamedTuple):
    requests: int
    prompt_tokens: int  # sum of resolved prompt lengths
    hit_tokens: int  # prompt tokens an infinite page-granular cache serves (page-floored)
    generated_tokens: int

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def oracle_reuse(requests: Sequence[TraceRequest], page_size: int) -> ReuseStats:
    """What an infinite cache would serve, replaying ``requests`` one at a time in order.

    Every request inserts the full pages of the tokens it computed (prompt +
    generated tokens but the last, which is never fed back); a request hits the
    longest run of whole pages already inserted under its namespace, capped so
    that at least one prompt token is computed (the engine needs its logits). Answers are
    placeholders (distinct per request): only their length matters here, and the
    reference model always generates exactly ``max_new_tokens``.
    """
    children: dict[str, int] = {}
    for r in requests:
        if r.parent:
            children[r.parent] = children.get(r.parent, 0) + 1
    pages: dict[tuple, int] = {}  # (parent node id, page tokens) -> node id; node 0..: per namespace roots
    roots: dict[str, int] = {}
    seqs: dict[str, list] = {}
    prompt_tokens = hit_tokens = generated = 0
    for r in requests:
        prompt = list(r.prompt) if r.parent is None else seqs[r.parent] + list(r.append)
        node = roots.setdefault(r.namespace, -1 - len(roots))
        full = prompt + [("answer", r.rid, i) for i in range(r.max_new_tokens)]
        computed = full[:-1]
        hit, matching = 0, True
        for p in range(len(computed) // page_size):
            key = (node, tuple(computed[p * page_size:(p + 1) * page_size]))
            nxt = pages.get(key)
            if nxt is None:
                matching = False
                nxt = pages[key] = len(pages)
            elif matching and (p + 1) * page_size < len(prompt):
                hit = (p + 1) * page_size
            node = nxt
        prompt_tokens += len(prompt)
        hit_tokens += hit
        generated += r.max_new_tokens
        if children.get(r.rid):
            seqs[r.rid] = full
    return ReuseStats(len(requests), prompt_tokens, hit_tokens, generated)


BLOCK = 512  # tokens per hash id, as in Mooncake's release
MAX_CONTEXT = 131072  # a session ends when its next prompt would not fit a 128K context


class _Blocks:
    """Fresh block ids, and the blocks of a prompt that extends an earlier one."""

    def __init__(self) -> None:
        self.next = 0

    def new(self, n: int) -> list[int]:
        self.next += n
        return list(range(self.next - n, self.next))

    def extend(self, prev_ids: list[int], prev_tokens: int, tokens: int) -> list[int]:
        """Ids of a ``tokens``-token prompt whose first ``prev_tokens`` are the prompt of ``prev_ids``."""
        keep = prev_ids[:prev_tokens // BLOCK]  # its full blocks; the partial one is rewritten
        return keep + self.new(-(-tokens // BLOCK) - len(keep))


def _lognormal(rng: random.Random, median: float, p90: float) -> float:
    return median * math.exp(rng.gauss(0.0, math.log(p90 / median) / 1.2816))


def _zipf(rng: random.Random, n: int, s: float) -> int:
    return rng.choices(range(n), [1.0 / (i + 1) ** s for i in range(n)])[0]


def _line(at_s: float, tokens: int, out: int, ids: list[int]) -> dict:
    return {"timestamp": int(at_s * 1000), "input_length": tokens, "output_length": out, "hash_ids": ids}


def _sessions(rng: random.Random, starts: float, duration_s: float) -> Iterator[float]:
    t = rng.expovariate(starts)
    while t < duration_s:
        yield t
        t += rng.expovariate(starts)


def _ordered(events: list[tuple[float, int, dict]]) -> list[dict]:
    return [e[2] for e in heapq.nsmallest(len(events), events)]


@dataclass(frozen=True, slots=True)
class LongSystemChat:
    """Multi-turn chat behind a few long system prompts."""

    duration_s: float = 1800.0
    conversations_per_s: float = 1.5
    system_prompts: int = 4
    system_tokens: int = 3072
    system_skew: float = 1.0  # Zipf exponent of system prompt popularity
    user_tokens: tuple[float, float] = (300.0, 4000.0)  # median, p90 of a turn's new input (pasted text)
    answer_tokens: tuple[float, float] = (250.0, 700.0)  # median, p90 (mean ~343)
    think_s: tuple[float, float] = (123.0, 483.0)  # median, p90 between turns
    continue_p: tuple[float, float, float] = (0.31, 0.1, 0.8)  # P(another turn) after turn k: min(c, a + b k)

    def generate(self, seed: int) -> list[dict]:
        rng = random.Random(f"{seed}:long-system-chat")
        ids = _Blocks()
        systems = [ids.new(self.system_tokens // BLOCK) for _ in range(self.system_prompts)]
        events: list[tuple[float, int, dict]] = []
        for t in _sessions(rng, self.conversations_per_s, self.duration_s):
            prev = systems[_zipf(rng, self.system_prompts, self.system_skew)]
            tokens, k = len(prev) * BLOCK, 0
            while t < self.duration_s:
                new = tokens + max(1, int(_lognormal(rng, *self.user_tokens)))
                if new > MAX_CONTEXT:
                    break
                cur = ids.extend(prev, tokens, new)
                out = max(1, int(_lognormal(rng, *self.answer_tokens)))
                events.append((t, len(events), _line(t, new, out, cur)))
                a, b, c = self.continue_p
                if rng.random() >= min(c, a + b * k):
                    break
                prev, tokens, k = cur, new + out, k + 1
                t += _lognormal(rng, *self.think_s)
        return _ordered(events)


@dataclass(frozen=True, slots=True)
class ToolAgentLoop:
    """Agent tasks: a long shared prefix (system prompt + tool definitions), then steps that
    each append the model's action and the tool's result, seconds apart."""

    duration_s: float = 1800.0
    tasks_per_s: float = 0.5
    agents: int = 3
    prefix_tokens: int = 6144  # system prompt + tool schemas, shared by every task of an agent
    agent_skew: float = 1.0
    task_tokens: tuple[float, float] = (600.0, 2000.0)
    steps: float = 6.0  # mean steps per task (geometric)
    action_tokens: tuple[float, float] = (120.0, 400.0)  # median, p90 of the model's output (mean ~182)
    tool_tokens: tuple[float, float] = (600.0, 4000.0)  # median, p90 of a tool result
    step_s: tuple[float, float] = (4.0, 20.0)  # median, p90 between steps (decode + tool run)

    def generate(self, seed: int) -> list[dict]:
        rng = random.Random(f"{seed}:tool-agent")
        ids = _Blocks()
        prefixes = [ids.new(self.prefix_tokens // BLOCK) for _ in range(self.agents)]
        events: list[tuple[float, int, dict]] = []
        for t in _sessions(rng, self.tasks_per_s, self.duration_s):
            prev = prefixes[_zipf(rng, self.agents, self.agent_skew)]
            tokens = len(prev) * BLOCK
            new = tokens + int(_lognormal(rng, *self.task_tokens))
            while t < self.duration_s and new <= MAX_CONTEXT:
                cur = ids.extend(prev, tokens, new)
                out = max(1, int(_lognormal(rng, *self.action_tokens)))
                events.append((t, len(events), _line(t, new, out, cur)))
                if rng.random() < 1.0 / self.steps:
                    break
                prev, tokens = cur, new + out
                new = tokens + max(1, int(_lognormal(rng, *self.tool_tokens)))
                t += _lognormal(rng, *self.step_s)
        return _ordered(events)


@dataclass(frozen=True, slots=True)
class RAGMix:
    """Retrieval-augmented questions: a system prompt, ``k`` retrieved documents in rank
    order (Zipf-popular in a corpus), then the question; a few follow-ups per session."""

    duration_s: float = 1200.0
    questions_per_s: float = 4.0
    system_tokens: int = 1024
    documents: int = 2000
    document_blocks: tuple[int, int] = (1, 4)  # inclusive range of a document's 512-token blocks
    doc_skew: float = 1.0
    k: int = 3
    question_tokens: tuple[float, float] = (60.0, 250.0)
    answer_tokens: tuple[float, float] = (200.0, 500.0)
    followup_p: float = 0.3
    think_s: tuple[float, float] = (40.0, 200.0)

    def generate(self, seed: int) -> list[dict]:
        rng = random.Random(f"{seed}:rag-mix")
        ids = _Blocks()
        system = ids.new(self.system_tokens // BLOCK)
        sizes = [rng.randint(*self.document_blocks) for _ in range(self.documents)]
        weights = [1.0 / (i + 1) ** self.doc_skew for i in range(self.documents)]
        chain: dict[tuple[int, ...], list[int]] = {}  # (docs so far) -> block ids after the system prompt
        events: list[tuple[float, int, dict]] = []
        for t in _sessions(rng, self.questions_per_s, self.duration_s):
            docs: list[int] = []
            while len(docs) < self.k:
                d = rng.choices(range(self.documents), weights)[0]
                docs += [] if d in docs else [d]
            prev = list(system)
            for i in range(len(docs)):  # a document's blocks depend on every document before it
                key = tuple(docs[:i + 1])
                if key not in chain:
                    chain[key] = ids.new(sizes[docs[i]])
                prev += chain[key]
            tokens = len(prev) * BLOCK
            while t < self.duration_s:
                new = tokens + max(1, int(_lognormal(rng, *self.question_tokens)))
                cur = ids.extend(prev, tokens, new)
                out = max(1, int(_lognormal(rng, *self.answer_tokens)))
                events.append((t, len(events), _line(t, new, out, cur)))
                if rng.random() >= self.followup_p:
                    break
                prev, tokens = cur, new + out
                t += _lognormal(rng, *self.think_s)
        return _ordered(events)


WORKLOADS = {"long_system_chat": LongSystemChat(), "tool_agent": ToolAgentLoop(), "rag_mix": RAGMix()}


def write_hash_trace(path: str, lines: list[dict]) -> None:
    with open(path, "w") as f:
        for d in lines:
            f.write(json.dumps(d) + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m hicache.reference.workloads",
                                 description="write the generated hash-block workloads as JSONL")
    ap.add_argument("outdir")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    os.makedirs(a.outdir, exist_ok=True)
    for name, w in WORKLOADS.items():
        lines = w.generate(a.seed)
        path = os.path.join(a.outdir, f"{name}.jsonl")
        write_hash_trace(path, lines)
        tok = sum(d["input_length"] for d in lines)
        print(f"{path}: {len(lines):,} requests, {tok:,} input tokens, "
              f"{len({h for d in lines for h in d['hash_ids']}):,} distinct blocks")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
