"""Why a page missed: one reason per missed page, the reasons summing to the misses.
"""
from __future__ import annotations

import dataclasses
from collections import OrderedDict
from typing import NamedTuple, Sequence


from hicache.core.errors import IntegrityError
from hicache.core.hashing import namespace_root, raw_page_hashes
from hicache.core.stats import REASONS, MissStats  # noqa: F401  (re-exported)

L1, L2, L3 = 1, 2, 3


class L3Outcome(NamedTuple):
    """What one admission learnt from L3, for the pages after its L1/L2 hit."""

    first_page: int  # logical page where the L3 lookup started (the L1/L2 hit's end)
    held: int  # leading pages from there that L3 said it holds (the probe)
    delivered: int  # of those, pages the prefetch brought into L2 in time
    expired: bool  # the prefetch was still running when the budget ran out
    read_errors: int  # L3 read errors and corrupt objects during this admission
    fingerprint_mismatches: int  # objects written by another layout, met during this admission
    no_room: bool = False  # L2 could not place every held page (no room, or its parent left L2)


def _reason(j: int, t: int | None, room_end: int, other_ns_pages: int, l3: L3Outcome | None) -> str:
    """The reason page ``j`` missed, given the furthest tier ``t`` its copy reached."""
    if j < room_end:
        return "no_l1_room"
    if t is None:
        if j < other_ns_pages:
            return "other_namespace"
        if l3 is not None and l3.fingerprint_mismatches and l3.delivered <= j - l3.first_page < l3.held:
            return "fingerprint_mismatch"
        return "first_use"
    if t == L1:
        return "l1_evicted"
    if t == L2:
        return "l2_evicted"
    if l3 is not None and l3.delivered <= j - l3.first_page < l3.held:
        if l3.expired:
            return "prefetch_expired"
        if l3.read_errors:
            return "l3_error"
        return "no_l2_room" if l3.no_room else "l3_evicted"  # l3_evicted: held at the probe, gone at the read
    if l3 is not None and l3.read_errors and j - l3.first_page >= l3.held:
        return "l3_error"
    return "l3_evicted"


class MissTracker:
    """Remembers the furthest tier of recently seen pages; classifies misses.

    A request of ``n`` tokens has ``ceil(n / page_size)`` pages; those past its
    admitted hit are its missed pages, and ``MissTracker.account`` gives each
    exactly one reason (``MissStats``):

    - ``partial_page``: the request's last page, which is always computed (it is
      partial, or it holds the last token, which must be computed to sample);
    - for the others, what the tracker remembers of the page (by page hash): the
      furthest tier its current copy reached, set when it is computed (L1), when
      its L2 backup completes (L2) and when L3 accepts it (L3):
      - never seen: ``other_namespace`` when another namespace's tree holds those
        tokens, ``fingerprint_mismatch`` when L3 has an object for it written by
        another layout, else ``first_use``;
      - L1: ``l1_evicted`` (evicted from L1 with no L2 copy);
      - on L2 but not loaded, because the admission found no L1 room for it
        (``no_l1_room``; write-back never blocks admission);
      - L2: ``l2_evicted`` (evicted from L2 with no L3 copy);
      - L3: ``prefetch_expired`` (L3 held it but the prefetch did not complete in
        the policy's budget), ``l3_error`` (the read failed: an error, a corrupt
        object), ``no_l2_room`` (L3 held it but L2 could not place it), else
        ``l3_evicted``.

    Memory is bounded: the tracker remembers the last ``window`` pages it saw
    (FIFO, ~120 bytes a page; the hash objects are shared with the index's nodes
    while they live). A page forgotten that way reads as ``first_use`` again;
    ``forgotten`` counts the pages dropped from the window, so a figure of 0 means
    every reason is exact. Not thread-safe (the scheduler thread).
    """

    def __init__(self, window: int):
        if window < 1:
            raise ValueError(f"miss tracker window={window}: must be >= 1 page")
        self.window = window
        self._tier: OrderedDict[bytes, int] = OrderedDict()  # page hash -> L1 | L2 | L3
        self.stats = MissStats()

    def account(self, hashes: Sequence[bytes], num_pages: int, hit_pages: int, cap_pages: int,
                l3: L3Outcome | None = None, other_ns_pages: int = 0, no_room_pages: int = 0,
                per_page: list[str] | None = None) -> MissStats:
        """Give each missed page of one admission its reason and count it. ``hashes``:
        the page hashes of the request's full pages (at least ``cap_pages`` of them);
        ``num_pages``: its pages, the partial one included; ``hit_pages``: its
        admitted hit; ``cap_pages``: pages it could hit at most (all but the last
        token); ``other_ns_pages``: leading pages another namespace's tree holds;
        ``no_room_pages``: pages after the hit that L2 held but L1 had no room for.
        ``per_page``: when given, the reason of every missed page is appended to it in
        page order (for checks). Afterwards the missed full pages count as computed
        (L1). Returns this admission's reasons (a new object)."""
        got = MissStats()
        if cap_pages > hit_pages:
            tier = self._tier
            for j in range(hit_pages, cap_pages):
                r = _reason(j, tier.get(hashes[j]), hit_pages + no_room_pages, other_ns_pages, l3)
                setattr(got, r, getattr(got, r) + 1)
                if per_page is not None:
                    per_page.append(r)
        got.partial_page = num_pages - max(hit_pages, cap_pages)
        if per_page is not None:
            per_page += ["partial_page"] * got.partial_page
        for j in range(hit_pages, min(len(hashes), num_pages)):
            self._set(hashes[j], L1, reset=True)
        for f in REASONS:
            setattr(self.stats, f, getattr(self.stats, f) + getattr(got, f))
        return got

    def reached(self, hashes: Sequence[bytes], tier: int) -> None:
        """Pages whose copy reached ``tier`` (L2: a backup completed; L3: a store)."""
        for h in hashes:
            self._set(h, tier, reset=False)

    def _set(self, h: bytes, tier: int, *, reset: bool) -> None:
        d = self._tier
        old = d.get(h)
        if old is None:
            d[h] = tier
            if len(d) > self.window:
                d.popitem(last=False)
                self.stats.forgotten += 1
        elif reset or tier > old:
            d[h] = tier
            d.move_to_end(h)

    def snapshot(self) -> MissStats:
        return dataclasses.replace(self.stats)

    def check_integrity(self) -> None:
        if len(self._tier) > self.window:
            raise IntegrityError(f"miss tracker holds {len(self._tier)} pages, over its window {self.window}")
        bad = [t for t in self._tier.values() if t not in (L1, L2, L3)]
        if bad:
            raise IntegrityError(f"miss tracker holds unknown tiers {sorted(set(bad))[:5]}")
        counts = [getattr(self.stats, f) for f in (*REASONS, "forgotten")]
        if min(counts) < 0:
            raise IntegrityError(f"miss tracker counters went negative: {self.stats}")


def admission_misses(tracker: MissTracker, cache, key: bytes, namespace: str, hit_tokens: int,
                     hit_node, l3: L3Outcome | None, no_room_pages: int = 0,
                     per_page: list[str] | None = None) -> MissStats:
    """Account one admission of ``key`` whose admitted hit is ``hit_tokens`` (whole
    pages) ending at ``hit_node`` (the locked match's last node; None for no hit) in
    ``cache`` (a ``PrefixCache``, read only). Hashes only the missed full pages,
    chained from the hit's last page (cached on its node, which may hold pages past
    the hit: the hit can end inside it); looks nothing up again
    (only other namespaces, when there are any, are matched)."""
    tree = cache.tree
    ps = tree.page_size
    n = len(key) // 4
    hit, cap, full = hit_tokens // ps, max(0, n - 1) // ps, n // ps
    if hit > cap:
        raise IntegrityError(f"admitted hit of {hit} pages exceeds the {cap} pages a request of {n} tokens may hit")
    hashes: list = [None] * hit
    if full > hit:
        prev = _hash_of_page(tree, hit_node, hit - 1) if hit else namespace_root(namespace)
        hashes += raw_page_hashes(key[4 * hit * ps:4 * full * ps], ps, prev)
    other = 0
    if cap > hit:
        for ns in tree.namespaces():
            if ns != namespace:
                o = tree.match(key, ns, max_pages=cap)
                other = max(other, o.device_num_pages + o.host_num_pages)
    return tracker.account(hashes, -(-n // ps), hit, cap, l3, other, no_room_pages, per_page)


def _hash_of_page(tree, node, page: int) -> bytes:
    """The chained hash of logical page ``page`` on ``node``'s path. The hit may end
    inside ``node`` (a partial edge match) or ``node`` may have been split since the
    match (the lock splits at the hit's end): walk up to the node that holds ``page``."""
    while node.start_page > page:
        node = node.parent
    if node.parent is None or page >= node.start_page + node.num_pages:
        raise IntegrityError(f"page {page} of the hit is not on the path of {node!r}")
    return tree.hashes(node)[page - node.start_page]
