"""Seeded hash-block workloads for ``--simulate``, shaped after published traffic.

Each generator is a frozen config whose ``generate(seed)`` returns requests in the
hash-block format of Mooncake's trace release (``hicache.reference.hash_trace``):
``timestamp`` (ms), ``input_length``, ``output_length``, ``hash_ids`` (one id per
512-token block; equal ids = an equal block with an equal prefix). A turn's prompt
is the previous prompt, its answer and the new input, so it shares every full
block of the previous prompt and nothing after (its last block was partial).
Parameters and their sources: docs/traces.md ("Generated workloads").
Deterministic: ``random.Random`` seeded with a string, as in ``workloads``.

    python -m hicache.reference.sim_workloads OUTDIR [--seed N]
"""
from __future__ import annotations

import argparse
import heapq
import json
import math
import os
import random
from dataclasses import dataclass
from typing import Iterator

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
    ap = argparse.ArgumentParser(prog="python -m hicache.reference.sim_workloads",
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
