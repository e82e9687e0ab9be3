"""A request's handle on the prefix cache (``Request``), its states, and the
per-tier hits of one lookup (``MatchResult``). See ``hicache.index.prefix_cache`` for the
call order; the cache builds handles (``PrefixCache.new_request``).
"""
from __future__ import annotations

import enum
from typing import NamedTuple, Protocol, Sequence

import numpy as np
import torch

from hicache.core.errors import CacheStateError
from hicache.core.hashing import tokens_to_bytes
from hicache.index.node import DraftCut, InsertResult, Node
from hicache.index.radix import RadixTree

Tokens = Sequence[int] | np.ndarray | torch.Tensor | bytes


def as_key(tokens: Tokens) -> bytes:
    """Token ids as the index's key (uint32 LE bytes); ``bytes`` pass through."""
    if isinstance(tokens, (bytes, bytearray)):
        if len(tokens) % 4:
            raise ValueError(f"a bytes key holds uint32 ids: length {len(tokens)} is not a multiple of 4")
        return bytes(tokens)
    if isinstance(tokens, torch.Tensor):
        tokens = tokens.detach().cpu().numpy()
    return tokens_to_bytes(tokens)


class MatchResult(NamedTuple):
    """Per-tier hits of one lookup. Valid until the next eviction (``epoch``);
    ``Request.lock`` raises ``StaleMatch`` on an older one."""

    device_tokens: int  # scheduler-visible L1 hit, a whole number of pages
    host_tokens: int  # scheduler-visible L2 hit continuing it, whole pages
    exact_tokens: int  # device + host + the asking request's own private tail continuing them
    device_node: Node | None  # node holding the last device-hit page (lock target)
    host_node: Node | None  # node holding the last host-hit page (== device_node when none)
    epoch: int  # tree epoch when computed
    tree: RadixTree  # to list page ids on demand
    draft_cut: DraftCut = DraftCut.NONE  # where the hit stopped for missing draft planes
    draft_cut_tokens: int = 0  # whole-page tokens the hit lost to that cut

    @property
    def tokens(self) -> int:
        """Scheduler-visible hit over L1 and L2."""
        return self.device_tokens + self.host_tokens

    @property
    def device_pages(self) -> list[int]:
        """Owned L1 ids of the device hit, logical order (built on each access)."""
        return self.tree.pages(self.device_node, self.device_tokens // self.tree.page_size)

    @property
    def host_pages(self) -> list[int]:
        """Owned L2 ids of the host hit (built on each access); load these back."""
        ps = self.tree.page_size
        return self.tree.pages(self.host_node, self.tokens // ps, self.device_tokens // ps, host=True)


class RequestOwner(Protocol):
    """What a ``Request`` asks of the cache that owns it (``hicache.index.prefix_cache.PrefixCache``,
    the one owner of the tree and of every request's locks). A handle never
    reaches into the tree: it asks for a lock, a share, an unlock."""

    page_size: int

    def refresh(self, req: "Request") -> MatchResult: ...

    def lock(self, req: "Request", m: MatchResult) -> None: ...

    def owned(self, start_page: int, num_pages: int) -> int: ...

    def alloc_device(self, n: int) -> list: ...

    def free_device(self, ids: list) -> None: ...

    def share(self, req: "Request", num_pages: int, draft_pages: int) -> InsertResult: ...

    def unlock(self, node: Node) -> None: ...

    def adopted(self, res: InsertResult) -> None: ...

    def request_ended(self, req: "Request", state: "RequestState") -> None: ...


class RequestState(enum.Enum):
    WAITING = "waiting"  # holds nothing
    RUNNING = "running"  # holds a locked prefix and private pages
    PREEMPTED = "preempted"  # holds at most its private partial page
    FINISHED = "finished"
    ABORTED = "aborted"


class Request:
    """One request's handle. Built by ``PrefixCache.new_request``; every method
    may mutate the cache. ``pages`` is this rank's page table: owned L1 ids for
    logical pages ``[0, ceil(allocated_tokens / page_size))``, the first
    ``shared_pages`` of them held by the index. It is a live list, replaced by
    ``lock`` and rewritten by ``commit`` (duplicates swap to the index's ids):
    re-read it after either."""

    def __init__(self, cache: RequestOwner, rid: str, key: bytes, namespace: str, draft: bool = False):
        self.cache, self.rid, self.namespace = cache, rid, namespace
        self.draft = draft  # runs the draft head: needs and writes draft rows
        self.draft_tokens = 0  # leading tokens whose draft rows are valid in self.pages
        self._draft_shared = 0  # shared pages the index knows as draft-complete
        self._buf = bytearray(key)
        self._key: bytes | None = key
        self.state = RequestState.WAITING
        self.pages: list[int] = []
        self.shared_pages = 0  # logical pages [0, shared_pages) belong to the index
        self.computed_tokens = 0  # exact: tokens whose KV is in self.pages
        self.allocated_tokens = 0  # tokens with a reserved slot (>= computed)
        self.node: Node | None = None  # the locked node (RUNNING)
        self._tail: list[int] = []  # PREEMPTED: owned id of the private partial page
        self._tail_page = 0  # PREEMPTED: its logical index
        self._tail_tokens = 0  # PREEMPTED: its computed tokens

    # ----------------------------------------------------------------- tokens
    @property
    def key(self) -> bytes:
        if self._key is None:
            self._key = bytes(self._buf)
        return self._key

    @property
    def num_tokens(self) -> int:
        return len(self._buf) // 4

    @property
    def tokens(self) -> list[int]:
        return np.frombuffer(self.key, dtype="<u4").tolist()

    def extend(self, tokens: Tokens) -> None:
        """Append tokens (e.g. the sampled token before a decode step)."""
        self._check(RequestState.WAITING, RequestState.RUNNING, RequestState.PREEMPTED, op="extend")
        self._buf += as_key(tokens)
        self._key = None

    @property
    def private_pages(self) -> list[int]:
        """Owned L1 ids this request holds outside the index (a fresh list)."""
        if self.state is RequestState.PREEMPTED:
            return list(self._tail)
        return self.pages[self.cache.owned(0, self.shared_pages):]

    # ------------------------------------------------------------- lifecycle
    def match(self) -> MatchResult:
        """Refresh: the cache's hit for this request's tokens (at most all but the last).

        Pure apart from ``stats.lookups``. ``exact_tokens`` adds this request's
        own private partial page when it continues the hit (chunked prefill,
        or after ``preempt`` when its prefix survived); other requests never
        see that page. The cache does it (``PrefixCache.refresh``).
        """
        return self.cache.refresh(self)

    def exact_tokens_for(self, hit: int) -> int:
        """``match``'s ``exact_tokens`` for a page-floored ``hit`` of this request: ``hit``
        plus this request's own private tokens continuing it (pure). A load back
        that extends the hit after ``match`` asks this for the extended hit."""
        cap = max(0, self.num_tokens - 1)
        if self.state is RequestState.RUNNING:  # its locked prefix + private pages are its own
            return max(min(self.computed_tokens, cap), hit)
        if self.state is RequestState.PREEMPTED and self._tail_tokens and hit == self._tail_page * self.cache.page_size:
            return max(min(hit + self._tail_tokens, cap), hit)
        return hit

    def lock(self, m: MatchResult) -> None:
        """Pin ``m``'s device hit and take it as this request's computed prefix.

        WAITING or PREEMPTED -> RUNNING. Afterwards ``pages`` holds the hit's
        ids and ``computed_tokens == m.device_tokens`` (+ the private tail when
        ``m`` counted it; a tail that no longer continues the device hit is
        freed). Load an L2 hit back before locking to use it. Raises
        ``StaleMatch`` if an eviction happened since ``m`` was computed. The cache
        does it (``PrefixCache.lock``).
        """
        self.cache.lock(self, m)

    def alloc(self, num_tokens: int) -> list[int]:
        """Reserve slots for the next ``num_tokens`` tokens; returns the new owned
        L1 ids (appended to ``pages``). Evicts unlocked index pages when the pool
        is short; raises ``OutOfPages`` (and allocates nothing) if that is not enough.
        ``extend`` tokens before allocating their slots."""
        self._check(RequestState.RUNNING, op="alloc")
        end = self.allocated_tokens + num_tokens
        if num_tokens < 0 or end > self.num_tokens:
            raise CacheStateError(f"request {self.rid!r}: alloc({num_tokens}) would reserve {end} "
                                  f"tokens but it has {self.num_tokens}; extend() first")
        ids = self.cache.alloc_device(self._pages_for(end))
        self.pages += ids
        self.allocated_tokens = end
        return ids

    def _pages_for(self, end: int) -> int:
        """Owned L1 pages that reserving slots up to token ``end`` allocates."""
        ps = self.cache.page_size
        first, last = -(-self.allocated_tokens // ps), -(-end // ps)
        return self.cache.owned(first, last - first)

    def commit(self, num_tokens: int | None = None, *, draft_tokens: int | None = None) -> int:
        """Mark ``num_tokens`` more tokens computed (default: all allocated) and
        share their full pages through the index; the partial page stays
        private. Moves this request's lock to the new deepest node. Returns
        ``computed_tokens``.

        ``draft_tokens`` (draft requests): how many leading tokens have valid
        draft rows now. Default ``computed_tokens - 1``: a draft row needs the
        next token, so the last one is pending. Only pages whose draft rows are
        all valid are shared as draft-complete."""
        self._check(RequestState.RUNNING, op="commit")
        self._advance(num_tokens, draft_tokens)
        self._adopt(self._share())
        return self.computed_tokens

    def _advance(self, num_tokens: int | None, draft_tokens: int | None) -> None:
        """``commit``'s accounting: more computed tokens and draft rows."""
        n = self.allocated_tokens - self.computed_tokens if num_tokens is None else num_tokens
        if not 0 <= n <= self.allocated_tokens - self.computed_tokens:
            raise CacheStateError(f"request {self.rid!r}: commit({num_tokens}) but only "
                                  f"{self.allocated_tokens - self.computed_tokens} tokens are allocated "
                                  "and not yet computed")
        self.computed_tokens += n
        if draft_tokens is not None:
            if not self.draft or not 0 <= draft_tokens <= self.computed_tokens:
                raise CacheStateError(f"request {self.rid!r}: commit(draft_tokens={draft_tokens}) needs a "
                                      f"draft request (draft={self.draft}) and 0 <= draft_tokens <= "
                                      f"computed_tokens={self.computed_tokens}")
            self.draft_tokens = draft_tokens
        elif self.draft:
            self.draft_tokens = max(self.draft_tokens, self.computed_tokens - 1)

    def replace_uncommitted(self, tokens: Tokens) -> None:
        """Replace the tokens after ``computed_tokens`` with ``tokens`` (speculative
        decoding: placeholders while drafting, then the accepted drafts). Slots
        already allocated keep their ids up to the new length; pages that no
        longer hold an allocated slot are freed. RUNNING only; mutates ``pages``."""
        self._check(RequestState.RUNNING, op="replace_uncommitted")
        c, ps = self.cache, self.cache.page_size
        self._buf = self._buf[:self.computed_tokens * 4] + as_key(tokens)
        self._key = None
        self.allocated_tokens = min(self.allocated_tokens, self.num_tokens)
        keep = c.owned(0, -(-self.allocated_tokens // ps))
        c.free_device(self.pages[keep:])
        del self.pages[keep:]

    def finish(self) -> None:
        """Share the computed full pages, free every private page, unlock. -> FINISHED."""
        self._check(RequestState.WAITING, RequestState.RUNNING, RequestState.PREEMPTED, op="finish")
        if self.state is RequestState.RUNNING:
            self._adopt(self._share())
        self._end_finish()

    def _end_finish(self) -> None:
        self._release()
        self.state = RequestState.FINISHED
        self.cache.request_ended(self, self.state)

    def abort(self) -> None:
        """Release everything held without sharing anything new. -> ABORTED."""
        self._check(RequestState.WAITING, RequestState.RUNNING, RequestState.PREEMPTED, op="abort")
        self._release()
        self.state = RequestState.ABORTED
        self.cache.request_ended(self, self.state)

    def preempt(self) -> None:
        """Share the computed full pages, unlock, free private pages except the
        partial last page (at most one page, kept for an exact refresh).
        RUNNING -> PREEMPTED; resume with ``match`` + ``lock``."""
        self._check(RequestState.RUNNING, op="preempt")
        self._adopt(self._share())
        self._end_preempt()

    def _end_preempt(self) -> None:
        c = self.cache
        ps = c.page_size
        tail_tokens = self.computed_tokens - self.shared_pages * ps
        private = self.private_pages
        keep = c.owned(self.shared_pages, 1) if tail_tokens else 0
        tail, rest = private[:keep], private[keep:]
        c.free_device(rest)
        self._unlock()
        self._tail, self._tail_page, self._tail_tokens = tail, self.shared_pages, tail_tokens
        self.pages, self.shared_pages, self.computed_tokens, self.allocated_tokens = [], 0, 0, 0
        self.state = RequestState.PREEMPTED
        c.request_ended(self, self.state)

    # ---------------------------------------------------------------- helpers
    def _check(self, *ok: RequestState, op: str) -> None:
        if self.state not in ok:
            raise CacheStateError(f"request {self.rid!r}: {op}() needs state "
                                  f"{'/'.join(s.value for s in ok)}, it is {self.state.value}")

    def _share(self) -> InsertResult | None:
        """Insert the computed full pages (and newly valid draft rows); move the lock
        to the new deepest node and take the index's ids. Returns what the insert
        did (None if nothing changed); the caller acts on it (``_adopt``)."""
        c = self.cache
        ps = c.page_size
        full = self.computed_tokens // ps
        dp = min(full, self.draft_tokens // ps)
        if full <= self.shared_pages and dp <= self._draft_shared:
            return None  # (a shared page whose pending draft row was just written is re-inserted)
        res = c.share(self, full, dp)  # (locks res.node)
        self._draft_shared = dp
        self.pages[:c.owned(0, full)] = res.pages
        self._unlock()
        self.node, self.shared_pages = res.node, full
        return res

    def _adopt(self, res: InsertResult | None) -> None:
        """Free the duplicates of a share: call after the draft planes listed in
        ``res.draft_copies`` were copied (their sources are those duplicates)."""
        if res is None:
            return
        self.cache.adopted(res)

    def _unlock(self) -> None:
        if self.node is not None:
            self.cache.unlock(self.node)
            self.node = None

    def _release(self) -> None:
        c = self.cache
        c.free_device(self.private_pages)
        self._unlock()
        self.pages, self._tail, self._tail_tokens = [], [], 0
        self.shared_pages = self.computed_tokens = self.allocated_tokens = 0

    def __repr__(self) -> str:
        return (f"Request({self.rid!r}, {self.state.value}, tokens={self.num_tokens}, "
                f"computed={self.computed_tokens}, allocated={self.allocated_tokens}, "
                f"draft={self.draft_tokens if self.draft else None}, "
                f"shared_pages={self.shared_pages}, pages={self.pages})")
