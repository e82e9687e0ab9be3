"""Random engine operations against a reference model, invariants after every step.

The model is the KV memory itself: every L1/L2 page id maps to what a real
engine would have written there (namespace + the token prefix the page ends
at). A hit that hands out a page whose content is not exactly that prefix is a
bug, whatever the bookkeeping says. Alongside: exact per-request accounting,
completeness of hits while nothing was evicted, and ``check_integrity()``.
"""
from __future__ import annotations

import hypothesis.strategies as st
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from hicache.memory.allocator import PageAllocator
from hicache.index.prefix_cache import PrefixCache, RequestState
from hicache.core.errors import OutOfPages
from hicache.core.layout import KVLayout

PS = 4
PB = 4 * PS
BASES = [[], [7, 7, 7, 7, 7, 7, 7, 7], [7, 7, 7, 7, 9, 9, 9, 9, 9, 9]]


class CacheMachine(RuleBasedStateMachine):
    cp_size, cp_rank, device_pages, host_pages = 1, 0, 20, 24

    @initialize(policy=st.sampled_from(["lru", "lfu", "fifo"]))
    def setup(self, policy):
        lay = KVLayout("tiny", 1, num_kv_heads=1, head_dim=2, page_size=PS,
                       cp_size=self.cp_size, cp_rank=self.cp_rank)
        self.c = PrefixCache(lay, PageAllocator(self.device_pages), PageAllocator(self.host_pages),
                             eviction=policy, host_eviction=policy)
        self.mem: dict[int, tuple[str, bytes]] = {}  # L1 id -> (namespace, prefix it ends at)
        self.hmem: dict[int, tuple[str, bytes]] = {}
        self.reqs: list = []
        self.committed: set[tuple[str, bytes]] = set()  # full-page prefixes ever shared
        self.host_locks: list = []
        self.n = 0

    # ------------------------------------------------------------ model helpers
    def owned(self, start: int, end: int) -> list[int]:
        own = self.c.ownership
        return [j for j in range(start, end) if own.owner(j) == self.cp_rank]

    def check_pages(self, req, ids: list[int], first: int, upto_tokens: int, mem) -> None:
        """``ids`` are the owned pages of logical pages from ``first``; check content."""
        for pid, j in zip(ids, self.owned(first, -(-upto_tokens // PS))):
            want = (req.namespace, req.key[:min(upto_tokens, (j + 1) * PS) * 4])
            got = mem.get(pid)
            if upto_tokens < (j + 1) * PS and got is not None and got[0] == want[0]:
                # The request's own partial page may hold rows past ``upto_tokens``: a
                # refresh counts at most all but the last token (it must recompute that
                # one for its logits), so a preempted tail can be ahead of the count.
                # Those rows must still be this request's tokens.
                assert len(want[1]) <= len(got[1]) <= min(len(req.key), (j + 1) * PB), (req, j, pid, got)
                assert req.key.startswith(got[1]), (req, j, pid, got)
                continue
            assert got == want, (req, j, pid, got, want)

    def pick(self, i: int, *states):
        live = [r for r in self.reqs if r.state in states]
        return live[i % len(live)] if live else None

    # -------------------------------------------------------------------- rules
    @rule(base=st.sampled_from(BASES), tail=st.lists(st.integers(0, 1), min_size=1, max_size=14),
          ns=st.sampled_from(["", "lora"]))
    def new(self, base, tail, ns):
        self.n += 1
        self.reqs.append(self.c.new_request(f"r{self.n}", base + tail, ns))

    @rule(i=st.integers(0, 99))
    def twin(self, i):
        """Same prompt as a live request: both may compute the same pages at once."""
        r = self.pick(i, RequestState.WAITING, RequestState.RUNNING, RequestState.PREEMPTED)
        if r is not None:
            self.n += 1
            self.reqs.append(self.c.new_request(f"r{self.n}", r.key, r.namespace))

    @rule(i=st.integers(0, 99))
    def schedule(self, i):
        r = self.pick(i, RequestState.WAITING, RequestState.PREEMPTED)
        if r is None:
            return
        m = r.match()
        hit_pages = m.tokens // PS
        self.check_pages(r, m.device_pages, 0, m.device_tokens, self.mem)
        self.check_pages(r, m.host_pages, m.device_tokens // PS, m.tokens, self.hmem)
        cap = r.num_tokens - 1
        if self.c.stats().device_evicted_pages == 0 and self.c.stats().host_evicted_pages == 0:
            best = max(k for k in range(cap // PS + 1) if k == 0 or (r.namespace, r.key[:k * PB])
                       in self.committed)
            assert m.tokens == best * PS, (m, best)
        tail = r._tail_tokens if r.state is RequestState.PREEMPTED else 0
        exact = m.tokens + min(tail, cap - m.tokens) if tail and hit_pages == r._tail_page else m.tokens
        assert m.exact_tokens == exact
        r.lock(m)
        assert r.computed_tokens == (exact if m.host_tokens == 0 else m.device_tokens)
        self.check_pages(r, r.pages, 0, r.computed_tokens, self.mem)

    @rule(i=st.integers(0, 99), n=st.integers(0, 9), k=st.integers(0, 9))
    def step(self, i, n, k):
        r = self.pick(i, RequestState.RUNNING)
        if r is None:
            return
        n = min(n, r.num_tokens - r.allocated_tokens)
        before = (list(r.pages), self.c.device_allocator.num_free)
        try:
            r.alloc(n)
        except OutOfPages:
            assert r.pages == before[0]  # nothing allocated on failure
            assert self.c.device_allocator.num_free >= before[1]  # (eviction may have freed pages)
        k = min(k, r.allocated_tokens - r.computed_tokens)
        a, b = r.computed_tokens, r.computed_tokens + k
        for pid, j in zip(r.pages[len(self.owned(0, a // PS)):], self.owned(a // PS, -(-b // PS))):
            self.mem[pid] = (r.namespace, r.key[:min(b, (j + 1) * PS) * 4])  # the "forward pass"
        assert r.commit(k) == b
        for j in range(1, b // PS + 1):
            self.committed.add((r.namespace, r.key[:j * PB]))
        self.check_pages(r, r.pages, 0, b, self.mem)

    @rule(i=st.integers(0, 99), tok=st.integers(0, 1))
    def extend(self, i, tok):
        r = self.pick(i, RequestState.WAITING, RequestState.RUNNING, RequestState.PREEMPTED)
        if r is not None:
            r.extend([tok])

    @rule(i=st.integers(0, 99), how=st.sampled_from(["finish", "abort", "preempt"]))
    def end(self, i, how):
        states = [RequestState.RUNNING] if how == "preempt" else \
            [RequestState.WAITING, RequestState.RUNNING, RequestState.PREEMPTED]
        r = self.pick(i, *states)
        if r is None:
            return
        shared = r.computed_tokens // PS if r.state is RequestState.RUNNING and how != "abort" else 0
        getattr(r, how)()
        for j in range(1, shared + 1):
            self.committed.add((r.namespace, r.key[:j * PB]))
        if how != "preempt":
            self.reqs.remove(r)

    @rule(n=st.integers(1, 8), policy=st.sampled_from([None, "lru", "lfu"]))
    def evict(self, n, policy):
        self.c.evict(n, policy)

    @rule(i=st.integers(0, 99))
    def backup(self, i):
        nodes = [n for n in self.c.tree.iter_nodes() if n.host_pages is None and n.parent.host_pages is not None]
        if not nodes:
            return
        n = nodes[i % len(nodes)]
        if not self.c.host_allocator.can_alloc(len(n.device_pages)):
            return
        ids = self.c.host_allocator.alloc(len(n.device_pages))
        for h, d in zip(ids, n.device_pages):
            self.hmem[h] = self.mem[d]
        self.c.tree.set_host(n, ids)

    @rule(n=st.integers(1, 8))
    def evict_host(self, n):
        self.c.evict_host(n)

    @rule(i=st.integers(0, 99))
    def load_back(self, i):
        nodes = [n for n in self.c.tree.iter_nodes() if n.device_pages is None and n.parent.device_pages is not None]
        if not nodes:
            return
        n = nodes[i % len(nodes)]
        if not self.c.device_allocator.can_alloc(len(n.host_pages)):
            return
        ids = self.c.device_allocator.alloc(len(n.host_pages))
        for d, h in zip(ids, n.host_pages):
            self.mem[d] = self.hmem[h]
        self.c.tree.set_device(n, ids)

    @rule(i=st.integers(0, 99))
    def host_lock(self, i):
        nodes = [n for n in self.c.tree.iter_nodes() if n.host_pages is not None]
        if nodes and len(self.host_locks) < 3:
            n = nodes[i % len(nodes)]
            self.c.inc_host_lock(n)
            self.host_locks.append(n)

    @precondition(lambda self: self.host_locks)
    @rule()
    def host_unlock(self):
        self.c.dec_host_lock(self.host_locks.pop(0))

    # --------------------------------------------------------------- invariants
    @invariant()
    def integrity(self):
        self.c.check_integrity()
        for r in self.reqs:
            if r.state is RequestState.RUNNING:
                self.check_pages(r, r.pages, 0, r.computed_tokens, self.mem)
                m = r.match()
                assert m.tokens >= min(r.shared_pages, (r.num_tokens - 1) // PS) * PS  # locked: still hit
                assert m.exact_tokens == max(m.tokens, min(r.computed_tokens, r.num_tokens - 1))


SETTINGS = settings(max_examples=100, stateful_step_count=40, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])


class CacheMachineCP2(CacheMachine):
    cp_size, cp_rank = 2, 1


class CacheMachineCP4(CacheMachine):
    cp_size, cp_rank = 4, 2


TestCache = CacheMachine.TestCase
TestCache.settings = SETTINGS
TestCacheCP2 = CacheMachineCP2.TestCase
TestCacheCP2.settings = settings(SETTINGS, max_examples=40)
TestCacheCP4 = CacheMachineCP4.TestCase
TestCacheCP4.settings = settings(SETTINGS, max_examples=40)
