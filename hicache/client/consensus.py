"""Hit consensus: every rank of a TP (and CP) group admits the same hit.

Each TP rank keeps its own planes (its heads) in its own cache, and each CP
rank its own pages, so the hits they find for one request can differ: an
eviction on one rank only, a prefetch that landed on one rank only. The
scheduler must see one number, and every rank must compute from the same
token: the group admits the minimum over its ranks, as SGLang does with an
all-reduce ``MIN`` over its TP group.
"""
from __future__ import annotations

import os
from typing import Any, Protocol, Sequence

from hicache.client.link import Link
from hicache.core.errors import ConfigError
from hicache.client.protocol import PROTOCOL_VERSION

# A scheduler admits a batch per step; this bounds one request's size.
MAX_VALUES = 65536
MAX_GROUP_CHARS = 200


class HitConsensus(Protocol):
    """Element-wise minimum of per-rank integer lists across a group of ranks."""

    rank: int
    world_size: int

    def agree(self, values: Sequence[int]) -> list[int]:
        """The minimum of ``values[i]`` over every rank, for each ``i``. Blocks until
        every rank called; a collective (see ``ServiceConsensus``)."""

    def close(self) -> None:
        """Release the transport (idempotent)."""


def admitted_hit(consensus: HitConsensus, hit_tokens: int, page_size: int) -> int:
    """The hit (tokens) every rank of the group admits, given this rank's.

    ``hit_tokens``: what this rank would take as its computed prefix. When all
    ranks found the same number it stands (a request's own partial page
    included); otherwise the group takes the minimum floored to a page, which
    every rank holds (any rank's hit covers at least its own floored pages).
    """
    lo, neg_hi = consensus.agree([hit_tokens, -hit_tokens])
    if lo == -neg_hi:
        return lo
    return lo // page_size * page_size


def check_values(values: Sequence[int]) -> list[int]:
    out = list(values)
    if len(out) > MAX_VALUES:
        raise ValueError(f"agree: {len(out)} values, at most {MAX_VALUES} per call; split the batch")
    for v in out:
        if not isinstance(v, int) or isinstance(v, bool) or not -(1 << 62) <= v < (1 << 62):
            raise ValueError(f"agree: value {v!r} is not an integer within +-2**62")
    return out


class TorchConsensus:
    """``all_reduce(MIN)`` over ``group`` (default: the whole world).

    ``device``: where the reduced tensor lives; default ``cuda`` (the current
    device) for an NCCL group, ``cpu`` otherwise. ``torch.distributed`` must be
    initialised.
    """

    def __init__(self, group: Any = None, device: Any = None):
        import torch
        import torch.distributed as dist
        if not dist.is_available() or not dist.is_initialized():
            raise ConfigError("TorchConsensus needs torch.distributed initialised "
                              "(dist.init_process_group) before it is built")
        self._torch, self._dist, self.group = torch, dist, group
        if device is None:
            device = "cuda" if dist.get_backend(group) == "nccl" else "cpu"
        self.device = torch.device(device)
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)

    def agree(self, values: Sequence[int]) -> list[int]:
        vals = check_values(values)
        if not vals or self.world_size == 1:
            return vals
        t = self._torch.tensor(vals, dtype=self._torch.int64, device=self.device)
        self._dist.all_reduce(t, op=self._dist.ReduceOp.MIN, group=self.group)
        return t.tolist()

    def close(self) -> None:
        pass  # the process group belongs to the caller


class ServiceConsensus(Link):
    """The minimum through the node's service: one connection per rank.

    ``group`` names the group on the service (e.g. ``"llama-8b/dp0"``): ranks
    of different groups never meet. Each ``ServiceConsensus`` numbers its
    rounds from 0, so the ranks of a group must make the same sequence of
    ``agree`` calls from construction on; a rank that restarts joins the
    restarted group under a new group name.
    A round that does not complete within ``timeout_s`` raises
    ``ServiceError('timeout')`` on every rank of it.

    ``HitConsensus.agree(values)`` is that element-wise minimum. Two transports:

    * ``TorchConsensus(group)``: ``torch.distributed.all_reduce(MIN)`` over a
      process group (gloo on CPU, NCCL on GPU);
    * ``ServiceConsensus(socket_path, group, rank, world_size)``: the node's
      ``hicache serve`` collects one contribution per rank and answers each with
      the minimum (op ``agree``; server side: ``hicache.node.ops.AgreeRounds``).

    Both are collectives: every rank of the group calls ``agree`` the same number
    of times, in the same order, with lists of the same length. A rank that does
    not call blocks the others (``ServiceConsensus``: until its timeout, after
    which that round fails on every rank, consistently).

    ``admitted_hit`` is the rule a cache applies on top: ranks that all found the
    same hit (a private partial page included) keep it; otherwise every rank
    falls back to the page-floored minimum, which every rank holds.
    """

    def __init__(self, socket_path: str, group: str, rank: int, world_size: int, *, timeout_s: float = 30.0):
        if not isinstance(world_size, int) or world_size < 1 or not isinstance(rank, int) or not 0 <= rank < world_size:
            raise ConfigError(f"ServiceConsensus: rank={rank!r} must be in [0, world_size={world_size!r})")
        if not isinstance(group, str) or not 0 < len(group) <= MAX_GROUP_CHARS:
            raise ConfigError(f"ServiceConsensus: group={group!r:.80} must be 1-{MAX_GROUP_CHARS} characters")
        self.group, self.rank, self.world_size, self.timeout_s = group, rank, world_size, timeout_s
        self._round = 0
        self._sock = None
        try:
            # The socket waits a little longer than the server, so its timeout reply arrives.
            self._connect(socket_path, timeout_s + 5.0)
            self._call({"op": "hello", "protocol": PROTOCOL_VERSION, "role": "consensus", "pid": os.getpid()})
        except BaseException:
            self.close(send_bye=False)
            raise

    def agree(self, values: Sequence[int]) -> list[int]:
        vals = check_values(values)
        if not vals or self.world_size == 1:
            return vals
        r = self._round
        self._round += 1
        rep = self._call({"op": "agree", "group": self.group, "round": r, "rank": self.rank,
                          "world": self.world_size, "values": vals, "wait_ms": self.timeout_s * 1000})
        return rep["values"]

    def __enter__(self) -> "ServiceConsensus":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
