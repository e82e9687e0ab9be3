"""The service's L3: committed L2 pages are written behind to the backend, and
pages missing from L2 are read through from it (the ``fetch`` op).

Every L3 call runs on one of two worker threads, so the event loop never
waits for L3: the *writer* (a bounded queue of pages to store) and the
*reader* (one fetch at a time; at most ``MAX_FETCH_JOBS`` queued). The loop
only enqueues, reserves and commits.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import queue
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple, Sequence

from hicache.core.errors import ConfigError, IntegrityError, OutOfPages
from hicache.memory.pools import HostPool
from hicache.core.stats import L3TierStats
from hicache.node.snapshot import EventKind, EventLog, KVEvent, Taken
from hicache.node.l2_index import L2Index
from hicache.storage import StorageBackend
from hicache.core.types import PageHash

log = logging.getLogger(__name__)

L3_OWNER = -1  # the L2Index owner that holds pages being loaded from L3
MAX_FETCH_PAGES = 512  # pages one fetch loads at most (an 8K-token prompt at page 16)
MAX_FETCH_JOBS = 8  # fetches queued or running; more are answered from L2 only
# Pages per backend call: up to 64, and no more than ~8 MiB of copies held at once.
MAX_BATCH_PAGES = 64
MAX_BATCH_BYTES = 8 << 20
STOP_TIMEOUT_S = 30.0

class _Pending(NamedTuple):
    page_hash: PageHash
    parent: PageHash | None
    page: int
    generation: int


class L3Tier:
    """Write-behind and read-through between the service's L2 and its L3 backend.

    Built and used on the server's event loop (``queue_writes``, ``fetch``);
    ``stats`` and ``check_integrity`` may be called from any thread. ``aclose``
    stops both workers; it must finish before the segment is unmapped.
    ``take_events`` (any thread) returns the pages stored in L3 since the last call.

    Writes. ``queue_writes`` (called on the loop by the server with the STORED
    events it took from the L2 index) queues ``(hash, parent, page, generation)``.
    The writer copies each page out of the shared segment *without* locking it,
    then re-reads the page's generation (``L2Index.generation``, bumped whenever a
    committed page leaves L2): unchanged means the page was not recycled during
    the copy, so the bytes are the ones committed under the hash (a seqlock:
    committed pages are never written in place). A changed generation drops the
    page (``stale``); a full queue drops it (``dropped``). Pages that came from
    L3 (committed by ``L3_OWNER``) are not written back. Pages the writer stored
    are recorded as L3 STORED events, which the server pulls with
    ``take_events()`` (for the REST event stream); nothing is called back.

    Reads. ``fetch(hashes, wait_s)`` asks L3 how many leading ``hashes`` it
    holds, reserves that many L2 pages under ``L3_OWNER``, copies the payloads
    in, commits the leading ones that arrived and cancels the rest. The caller
    waits at most ``wait_s``; a load still running then completes later (its
    pages stay reserved until it does), so the next lookup finds them.
    """

    def __init__(self, storage: StorageBackend, index: L2Index, pool: HostPool, *, max_wait_s: float,
                 queue_pages: int):
        if queue_pages < 1:
            raise ConfigError(f"L3 writer: queue_pages={queue_pages}; it must be >= 1")
        self.storage = storage
        self.index = index
        self.pool = pool
        self.max_wait_s = max_wait_s
        self._sizes = [p.page_bytes for p in pool.layout.planes]
        self._batch = max(1, min(MAX_BATCH_PAGES, MAX_BATCH_BYTES // pool.layout.page_bytes))
        self._lock = threading.Lock()  # guards _stats and makes "put in queue + count" one step
        self._stats = L3TierStats()
        self._writes: queue.Queue[_Pending | None] = queue.Queue(queue_pages)
        self._events = EventLog(queue_pages)  # pages stored in L3, until the owner takes them
        self._jobs: set[asyncio.Task] = set()
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="hicache-l3-read")
        self._writer = threading.Thread(target=self._write_loop, name="hicache-l3-write", daemon=True)
        index.add_owner(L3_OWNER)
        self._writer.start()

    def _count(self, **deltas: int) -> None:
        with self._lock:
            for k, v in deltas.items():
                setattr(self._stats, k, getattr(self._stats, k) + v)

    # ------------------------------------------------------------ write-behind
    def queue_writes(self, events: Sequence[KVEvent]) -> None:
        """Queue the pages of L2 STORED ``events`` (as ``L2Index.take_events`` returns
        them) for L3; on the loop, never blocks. Pages a fetch brought from L3, and
        other events, are skipped."""
        for e in events:
            if e.kind is not EventKind.STORED or e.tier != "L2" or e.owner == L3_OWNER:
                continue
            h, parent = e.page_hash, e.parent
            if not self.index.draft_complete(h):
                self._count(skipped_draft=1)
                continue
            page = self.index.page_of(h)
            if page is None:
                raise IntegrityError(f"L3 writer: page {h.hex()} was announced as stored but the L2 index lacks it")
            item = _Pending(h, parent, page, self.index.generation(page))
            with self._lock:
                try:
                    self._writes.put_nowait(item)
                    self._stats.queued += 1
                except queue.Full:
                    self._stats.dropped += 1

    def _write_loop(self) -> None:
        while True:
            item = self._writes.get()
            if item is None:
                return
            batch = [item]
            while len(batch) < self._batch:
                try:
                    nxt = self._writes.get_nowait()
                except queue.Empty:
                    break
                if nxt is None:
                    self._write(batch)
                    return
                batch.append(nxt)
            self._write(batch)

    def _write(self, batch: list[_Pending]) -> None:
        try:
            copies = [(p, self.pool.read_page(p.page)) for p in batch]
        except Exception:  # a bug, not an outage: count the batch, keep the writer alive
            log.exception("L3 write-back: reading %d L2 pages failed", len(batch))
            self._count(failed=len(batch))
            return
        fresh = [(p, data) for p, data in copies if self.index.generation(p.page) == p.generation]
        stale = len(batch) - len(fresh)
        try:
            stored = self.storage.put([(p.page_hash, data, self._sizes) for p, data in fresh]) if fresh else 0
        except Exception:  # a bug below the backend's own failure handling: keep the writer alive
            log.exception("L3 put of %d pages failed", len(fresh))
            stored = 0
        # put() stores a subset without saying which on a per-page failure;
        # events are only recorded when the whole batch landed, and before the
        # count, so whoever sees ``written`` can take the events.
        if stored and stored == len(fresh):
            self._events.record(EventKind.STORED, "L3", [(p.page_hash, p.parent) for p, _ in fresh])
        self._count(written=stored, stale=stale, failed=len(fresh) - stored)

    def take_events(self) -> Taken:
        """L3 STORED events since the previous call (oldest first) and how many the
        bounded log dropped meanwhile; clears them. Any thread."""
        return self._events.take()

    # ------------------------------------------------------------ read-through
    async def fetch(self, hashes: Sequence[PageHash], wait_s: float) -> int:
        """Load the leading ``hashes`` L3 holds into L2; returns how many landed
        within ``wait_s`` (capped at ``max_wait_s``). ``hashes`` must all be
        missing from L2 (the caller looked them up first)."""
        if not hashes:
            return 0
        if len(self._jobs) >= MAX_FETCH_JOBS:
            self._count(fetch_busy=1)
            return 0
        self._count(fetches=1)
        job = asyncio.get_running_loop().create_task(self._load(list(hashes[:MAX_FETCH_PAGES])))
        self._jobs.add(job)
        job.add_done_callback(self._job_done)
        done, _ = await asyncio.wait({job}, timeout=min(wait_s, self.max_wait_s))
        if not done:
            self._count(fetch_timeouts=1)
            return 0
        return job.result()

    def _job_done(self, job: asyncio.Task) -> None:
        self._jobs.discard(job)
        if not job.cancelled() and job.exception() is not None:
            log.error("L3 fetch failed", exc_info=job.exception())

    async def _load(self, hashes: list[PageHash]) -> int:
        loop = asyncio.get_running_loop()
        n = await loop.run_in_executor(self._reader, self.storage.prefix_hits, hashes)
        want = min(n, self.index.allocator.num_free + self.index.num_evictable)
        if want < n:
            self._count(fetch_no_room=n - want)
        if want == 0:
            return 0
        try:
            pages = self.index.reserve(L3_OWNER, want)
        except OutOfPages:  # the room went between the check and here: cannot happen on one loop
            raise AssertionError(f"reserve({want}) failed after the room check") from None
        try:
            got = await loop.run_in_executor(self._reader, self._read_into, hashes[:want], pages)
        except asyncio.CancelledError:
            raise  # shutting down: the reader may still be copying, so the pages stay reserved
        except BaseException:
            self._land([], [], pages)  # the copy ended (raised): nothing writes the pages now
            raise
        self._land(hashes[:got], pages[:got], pages[got:])
        return got

    def _read_into(self, hashes: list[PageHash], pages: list[int]) -> int:
        """On the reader thread: the leading verified payloads, read straight into the
        reserved ``pages`` (``get_into_settled``); returns how many landed. A page past them
        may hold garbage: the caller cancels it (no read lands there after this returns)."""
        n = 0
        while n < len(hashes):
            dests = [self.pool.page_buffers(p) for p in pages[n:n + self._batch]]
            for ok in self.storage.get_into_settled(hashes[n:n + self._batch], self._sizes, dests):
                if not ok:  # nothing reads into the pages past it any more
                    return n
                n += 1
        return n

    def _land(self, hashes: list[PageHash], pages: list[int], unused: list[int]) -> None:
        if unused:
            self.index.cancel(L3_OWNER, unused)
        if not hashes:
            return
        self.index.commit(L3_OWNER, hashes, pages)  # its STORED events name L3_OWNER: not written back
        self._count(fetched=len(hashes))

    # -------------------------------------------------------------- lifecycle
    async def aclose(self) -> None:
        """Stop taking work, cancel waiting fetches, let running L3 calls finish
        (bounded by the backend timeouts), stop both threads. Idempotent."""
        for job in list(self._jobs):
            job.cancel()
        if self._jobs:
            await asyncio.wait(self._jobs, timeout=STOP_TIMEOUT_S)
        await asyncio.to_thread(self._stop_threads)

    def _stop_threads(self) -> None:
        self._reader.shutdown(wait=True, cancel_futures=True)
        if self._writer.is_alive():
            self._writes.put(None)  # after everything queued: queued pages are still written
            self._writer.join(STOP_TIMEOUT_S)
            if self._writer.is_alive():
                log.warning("L3 writer did not stop within %.0fs", STOP_TIMEOUT_S)

    def stats(self) -> L3TierStats:
        with self._lock:
            out = dataclasses.replace(self._stats)
        out.queue_pages = self._writes.qsize()
        return out

    def check_integrity(self) -> None:
        """Counters balance: every queued page is written, stale, failed or still queued."""
        with self._lock:  # queued and the queue's size move together under it
            s = dataclasses.replace(self._stats)
            q = self._writes.qsize()
        bad = [f.name for f in dataclasses.fields(s) if getattr(s, f.name) < 0]
        if bad:
            raise IntegrityError(f"negative L3 tier counters {bad}: {s}")
        done = s.written + s.stale + s.failed
        # The writer may hold a batch it took off the queue and has not counted yet.
        if not done <= s.queued or s.queued - done < q:
            raise IntegrityError(f"L3 writer: queued={s.queued}, written+stale+failed={done}, "
                                 f"still queued={q}: pages were lost or counted twice")
        self._events.check_integrity()
        self.storage.check_integrity()
