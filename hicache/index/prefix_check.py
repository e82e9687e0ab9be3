"""``PrefixCache``'s integrity checks: pool accounting (invariant 4) and each
request's bookkeeping (its shared pages are the index's; invariant 5 for what
a draft request uses). Raise ``IntegrityError``."""
from __future__ import annotations

from hicache.memory.allocator import PageAllocator
from hicache.index.draft import check_request_pages
from hicache.core.errors import IntegrityError
from hicache.index.radix import RadixTree
from hicache.index.request import Request, RequestState


def check_pool(alloc: PageAllocator, tier: str, tree_ids: set[int], others: list[list[int]]) -> None:
    alloc.check_integrity()
    seen = set(tree_ids)
    for ids in others:
        for i in ids:
            if i in seen:
                raise IntegrityError(f"{tier} page {i} is held twice (index/requests/in flight)")
            seen.add(i)
    for i in seen:
        if not alloc.is_allocated(i):
            raise IntegrityError(f"{tier} page {i} is held but free in the allocator")
    if len(seen) != alloc.num_used:  # invariant 4: free + held == capacity
        raise IntegrityError(f"{tier}: {alloc.num_used} pages allocated but {len(seen)} held "
                             f"(index {len(tree_ids)}); {alloc.num_used - len(seen)} leaked")


def check_request(tree: RadixTree, r: Request) -> None:
    """``r``'s bookkeeping against the index it holds pages of."""
    ps = tree.page_size
    if r.state is RequestState.PREEMPTED:
        want = tree.owned(r._tail_page, 1) if r._tail_tokens else 0
        if len(r._tail) != want or not 0 <= r._tail_tokens < ps or r.pages:
            raise IntegrityError(f"{r!r}: preempted with tail {r._tail} of {r._tail_tokens} tokens")
        return
    if r.state is RequestState.WAITING:
        if r.pages or r._tail or r.node is not None:
            raise IntegrityError(f"{r!r}: waiting but holds pages or a lock")
        return
    if r.state is not RequestState.RUNNING:
        raise IntegrityError(f"{r!r}: a live request in state {r.state.value}")
    if not (r.computed_tokens <= r.allocated_tokens <= r.num_tokens
            and r.shared_pages == r.computed_tokens // ps and 0 <= r.draft_tokens <= r.computed_tokens):
        raise IntegrityError(f"{r!r}: token accounting broken")
    if len(r.pages) != tree.owned(0, -(-r.allocated_tokens // ps)):
        raise IntegrityError(f"{r!r}: {len(r.pages)} pages for {r.allocated_tokens} allocated tokens")
    h = tree.match(r.key[:r.shared_pages * 4 * ps], r.namespace)
    k = tree.owned(0, r.shared_pages)
    ids = tree.pages(h.device_node, h.device_num_pages)
    if h.device_num_pages != r.shared_pages or ids != r.pages[:k]:
        raise IntegrityError(f"{r!r}: shared pages {r.pages[:k]} are not the index's "
                             f"{ids} ({h.device_num_pages} pages)")
    if r.draft and tree.draft:  # invariant 5: a draft request holds no draft-incomplete page it vouched for
        path = tree.path(h.device_node) if h.device_node is not None else []
        check_request_pages(path, min(r.shared_pages, r.draft_tokens // ps), r)
