"""Request handling of the local engine API: handshake and ops, no I/O.

``Dispatcher`` turns one decoded request into one reply map. Every refusal is
a reply with ``ok: False`` and an error kind (see ``hicache.client.protocol``);
``Reply.close`` tells the connection to hang up after sending it. State is
validated before it is mutated, so a refused request changes nothing.
Every op answers at once (``handle``) except ``fetch``, which may wait for
the service's L3 (``handle_async`` awaits it on the loop).
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple

from hicache.node.l2_segment import WriteMarks
from hicache.client.consensus import MAX_GROUP_CHARS, check_values
from hicache.node.l2_index import ClientKey, L2Index, Reclaimed
from hicache.node.l3_tier import L3Tier
from hicache.node.snapshot import MAX_REPORT_NAME, MAX_REPORT_VALUE, REPORT_FIELDS, EngineReport
from hicache.core.errors import (ContractMismatch, ForeignPage, IntegrityError, LayoutError, OutOfPages,
                            ServiceError)
from hicache.core.layout import KVLayout
from hicache.index.misses import MissStats
from hicache.client.protocol import PROTOCOL_VERSION, error_reply, plain
from hicache.core.redact import LogLimiter

log = logging.getLogger(__name__)


# Ops that may wait on the loop (for L3, for other ranks).
ASYNC_OPS = frozenset({"fetch", "agree"})
# Ops a consensus-only connection may use.
CONSENSUS_OPS = frozenset({"agree", "stats", "check", "bye"})


class Reply(NamedTuple):
    body: dict[str, Any]
    close: bool = False  # hang up after sending


class Dispatcher:
    """Serves every connection of one server; ``owner`` is the connection id.

    ``segment`` is the handshake's description of the shared L2 segment;
    ``snapshot`` returns the service statistics as a plain dict; ``l3`` (None
    without an L3) serves ``fetch`` misses from L3; ``marks`` (None: no
    check) refuses commits of reserved pages that were never written.
    """

    def __init__(self, layout: KVLayout, index: L2Index, segment: dict[str, Any],
                 snapshot: Callable[[], dict[str, Any]], l3: L3Tier | None = None,
                 marks: WriteMarks | None = None):
        self.layout = layout
        self.index = index
        self.l3 = l3
        self.marks = marks
        self._log = LogLimiter(log)
        self.segment = segment
        self.snapshot = snapshot
        self.errors: Counter[str] = Counter()
        self.rounds = AgreeRounds()
        self._consensus_only: set[int] = set()  # connections that handshook with role "consensus"
        self._ops: dict[str, Callable[[int, dict], dict[str, Any]]] = {
            "lookup": self._lookup, "reserve": self._reserve, "commit": self._commit,
            "cancel": self._cancel, "acquire": self._acquire, "release": self._release,
            "stats": lambda o, r: {"stats": self.snapshot()},
            "check": self._check, "report": self._report, "bye": lambda o, r: {},
        }
        self.reports: dict[int, EngineReport] = {}  # per connection: its last ``report``
        self.misses_total = MissStats()  # every report's misses since start; grows only

    def error(self, kind: str, message: str, close: bool = False, **extra: Any) -> Reply:
        self.errors[kind] += 1
        self._log.info(kind, "refused (%s): %s", kind, message[:500])
        return Reply(error_reply(kind, message, **extra), close)

    # ------------------------------------------------------------- handshake
    def hello(self, owner: int, req: dict[str, Any], peer: ClientKey | None = None) -> Reply:
        """First request of a connection. On success ``owner`` is registered, its pages
        counted against ``peer``'s share (``L2Index.add_owner``)."""
        if req.get("op") != "hello":
            return self.error("not_handshaken", f"first request must be op 'hello' with protocol "
                              f"{PROTOCOL_VERSION}, got op {req.get('op')!r}", close=True)
        theirs = req.get("protocol")
        if theirs != PROTOCOL_VERSION:
            return self.error("version", f"protocol version: ours={PROTOCOL_VERSION} theirs={theirs!r}; "
                              "upgrade the older side", close=True,
                              differences=[["protocol", PROTOCOL_VERSION, plain(theirs)]])
        if req.get("role") == "consensus":  # hit consensus only: no layout, no pages
            self.index.add_owner(owner, peer)
            self._consensus_only.add(owner)
            return Reply({"ok": True, "protocol": PROTOCOL_VERSION, "client_id": owner})
        try:
            client = KVLayout.from_dict(req.get("layout"))
        except (LayoutError, TypeError, ValueError, AttributeError) as e:
            return self.error("bad_layout", f"hello carries no valid KVLayout.to_dict(): {e}", close=True)
        diffs = [(f, plain(a), plain(b)) for f, a, b in self.layout.diff(client, fields="shared_l2")]
        fp = req.get("fingerprint")
        if fp != client.fingerprint() or self.layout.fingerprint() != client.fingerprint():
            diffs.append(("fingerprint", self.layout.fingerprint(), plain(fp)))
        if diffs:
            e = ContractMismatch(f"shared L2 of service layout {self.layout.model_id!r} vs client "
                                 f"{client.model_id!r}", diffs)
            return self.error("contract", str(e), close=True, differences=[list(d) for d in diffs])
        self.index.add_owner(owner, peer)
        return Reply({"ok": True, "protocol": PROTOCOL_VERSION, "client_id": owner,
                      "fingerprint": self.layout.fingerprint(), "has_l3": self.l3 is not None, **self.segment})

    # ------------------------------------------------------------------- ops
    def handle(self, owner: int, req: dict[str, Any]) -> Reply:
        """One request after the handshake that answers at once (not ``fetch``)."""
        op = req.get("op")
        if owner in self._consensus_only and not (isinstance(op, str) and op in CONSENSUS_OPS):
            return self.error("bad_request", f"op {op!r:.40} on a connection that handshook for consensus only; "
                              "page ops need a hello with the layout")
        fn = self._ops.get(op) if isinstance(op, str) else None
        if fn is None:
            if op == "hello":
                return self.error("bad_request", "hello was already done on this connection")
            assert not isinstance(op, str) or op not in ASYNC_OPS, f"{op} may wait: serve it with handle_async"
            return self.error("unknown_op", f"unknown op {op!r}; known: {sorted([*self._ops, *ASYNC_OPS])}")
        try:
            body = fn(owner, req)
        except Exception as e:
            return self._refusal(op, e)
        return Reply({"ok": True, **body}, close=(op == "bye"))

    async def handle_async(self, owner: int, req: dict[str, Any]) -> Reply:
        """``handle``, except that ``fetch`` may wait (on the loop) for L3 and
        ``agree`` for the other ranks of its group."""
        op = req.get("op")
        if not isinstance(op, str) or op not in ASYNC_OPS or (owner in self._consensus_only
                                                               and op not in CONSENSUS_OPS):
            return self.handle(owner, req)  # answers at once (or refuses)
        try:
            body = await (self._fetch(req) if op == "fetch" else self.rounds.agree(req))
        except Exception as e:
            return self._refusal(op, e)
        return Reply({"ok": True, **body})

    def drop(self, owner: int) -> Reclaimed:
        """Forget a closed connection; returns what the index reclaimed from it."""
        self._consensus_only.discard(owner)
        self.reports.pop(owner, None)
        return self.index.drop_owner(owner)

    def _report(self, owner: int, req: dict[str, Any]) -> dict[str, Any]:
        """Replace this connection's pushed figures (``EngineReport``); absent ones are 0."""
        figures, name = req.get("figures"), req.get("name", "")
        if not isinstance(figures, dict) or len(figures) > len(REPORT_FIELDS):
            raise ServiceError("bad_args", f"report: figures must be a map of at most {len(REPORT_FIELDS)} "
                               f"entries from {list(REPORT_FIELDS)}")
        if not isinstance(name, str) or len(name) > MAX_REPORT_NAME or not name.isprintable():
            raise ServiceError("bad_args", f"report: name must be printable text of at most {MAX_REPORT_NAME} chars")
        figures = dict(figures)
        for k, v in figures.items():
            if k not in REPORT_FIELDS:
                raise ServiceError("bad_args", f"report: unknown figure {str(k)[:40]!r}; known: {list(REPORT_FIELDS)}")
            if k == "misses":
                figures[k] = _miss_figures(v)
            elif type(v) is not int or not 0 <= v <= MAX_REPORT_VALUE:
                raise ServiceError("bad_args", f"report: {k} must be an int in [0, 2**63), got {plain(v)!r:.40}")
        new = EngineReport(name=name, **figures)
        _add_misses(self.misses_total, self.reports.get(owner), new)
        self.reports[owner] = new
        return {}

    def _refusal(self, op: str, e: Exception) -> Reply:
        if isinstance(e, ServiceError):
            return self.error(e.kind, f"{op}: {e.detail}")
        if isinstance(e, OutOfPages):
            return self.error("out_of_pages", f"{op}: {e}")
        if isinstance(e, ForeignPage):
            return self.error("foreign_page", f"{op}: {e}")
        if isinstance(e, IntegrityError):
            log.error("integrity check failed: %s", e)
            return self.error("integrity", str(e))
        # a bug: answer, log loudly, keep serving others
        log.error("op %r failed", op, exc_info=e)
        return self.error("internal", f"{op}: {type(e).__name__}: {e}")

    async def _fetch(self, req: dict) -> dict:
        hashes, wait_ms = _arg(req, "hashes"), _arg(req, "wait_ms")
        if not isinstance(wait_ms, (int, float)) or isinstance(wait_ms, bool) or not 0 <= wait_ms < 1e9:
            raise ServiceError("bad_args", f"fetch needs wait_ms >= 0 (milliseconds), got {wait_ms!r}")
        need_draft = _need_draft(req)
        pages = self.index.lookup(hashes, need_draft)
        fetched = 0
        if self.l3 is not None and len(pages) < len(hashes):
            # L3 holds complete pages only: what it loads also upgrades draft-incomplete L2 pages.
            fetched = await self.l3.fetch(hashes[len(pages):], wait_ms / 1000.0)
            if fetched:
                pages = self.index.peek_pages(hashes, need_draft)
        return {"pages": pages, "fetched": fetched}

    def _lookup(self, owner: int, req: dict) -> dict:
        return {"pages": self.index.lookup(_arg(req, "hashes"), _need_draft(req))}

    def _reserve(self, owner: int, req: dict) -> dict:
        pages = self.index.reserve(owner, _arg(req, "n"))
        if self.marks is not None:
            self.marks.stamp(pages)
        return {"pages": pages}

    def _commit(self, owner: int, req: dict) -> dict:
        hashes, pages = _arg(req, "hashes"), _arg(req, "pages")
        if self.marks is not None:
            self.index.check_reserved(owner, pages, "commit")  # ownership is the first refusal
            self.marks.check(pages)  # before the index mutates anything
        # Without draft planes every page is complete; with them, a commit that
        # does not say draft_pages commits draft-incomplete pages (the safe side).
        draft_pages = None if self.layout.draft_layers == 0 else req.get("draft_pages", 0)
        r = self.index.commit(owner, hashes, pages, draft_pages)
        if self.marks is not None:
            self.marks.clear(pages)
        return {"inserted": r.inserted, "duplicates": r.duplicates}

    def _cancel(self, owner: int, req: dict) -> dict:
        pages = _arg(req, "pages")
        self.index.cancel(owner, pages)
        if self.marks is not None:
            self.marks.clear(pages)
        return {}

    def _acquire(self, owner: int, req: dict) -> dict:
        return {"pages": self.index.acquire(owner, _arg(req, "hashes"), _need_draft(req))}

    def _release(self, owner: int, req: dict) -> dict:
        self.index.release(owner, _arg(req, "hashes"))
        return {}

    def _check(self, owner: int, req: dict) -> dict:
        self.index.check_integrity()
        self.rounds.check_integrity()
        return {}


def _need_draft(req: dict) -> bool:
    v = req.get("need_draft", False)
    if not isinstance(v, bool):
        raise ServiceError("bad_args", f"op {req.get('op')!r}: need_draft must be true or false, got {v!r:.40}")
    return v


def _arg(req: dict, name: str) -> Any:
    if name not in req:
        raise ServiceError("bad_args", f"op {req.get('op')!r} needs field {name!r}")
    return req[name]


def _add_misses(total: MissStats, old: EngineReport | None, new: EngineReport) -> None:
    """Add what ``new`` counts beyond the same connection's ``old`` report (a report
    that counts less, a reset engine, adds nothing: the total only grows)."""
    for f in dataclasses.fields(MissStats):
        was = getattr(old.misses, f.name) if old is not None else 0
        setattr(total, f.name, getattr(total, f.name) + max(0, getattr(new.misses, f.name) - was))


def _miss_figures(v: Any) -> MissStats:
    """A report's ``misses``: a map from ``MissStats`` fields to ints in [0, 2**63)."""
    known = [f.name for f in dataclasses.fields(MissStats)]
    if not isinstance(v, dict) or any(k not in known or type(x) is not int or not 0 <= x <= MAX_REPORT_VALUE
                                      for k, x in v.items()):
        raise ServiceError("bad_args", f"report: misses must map {known} to ints in [0, 2**63), got {plain(v)!r:.60}")
    return MissStats(**v)


# ---- The service's side of hit consensus (``hicache.client.consensus``): rounds of ``agree``.
# Rounds the server keeps open (waiting for ranks) over all groups, and
# failed rounds it remembers so that late ranks fail them too.
MAX_OPEN_ROUNDS = 4096
MAX_FAILED_ROUNDS = 4096


@dataclass(slots=True)
class _Round:
    world: int
    values: list[int]  # running element-wise minimum
    ranks: set[int] = field(default_factory=set)  # ranks that contributed
    done: asyncio.Future | None = None


class AgreeRounds:
    """The service's side of ``agree``: open rounds keyed by (group, round).

    Lives on the server's event loop (not thread-safe). A round completes when
    its ``world`` ranks have contributed; a waiter that times out fails the
    round for every rank of it, including those that arrive later.
    """

    def __init__(self, max_wait_s: float = 300.0):
        self.max_wait_s = max_wait_s
        self._open: dict[tuple[str, int], _Round] = {}
        self._failed: OrderedDict[tuple[str, int], str] = OrderedDict()
        self.completed = 0  # rounds that completed
        self.failed = 0  # rounds that timed out

    async def agree(self, req: dict[str, Any]) -> dict[str, Any]:
        """One rank's contribution (an ``agree`` request); waits for the others.

        Raises ``ServiceError`` (``bad_args`` for a malformed or inconsistent
        contribution, ``timeout`` for a round that did not complete).
        """
        key, rank, world, vals, wait_s = self._parse(req)
        if key in self._failed:
            raise ServiceError("timeout", self._failed[key])
        r = self._open.get(key)
        if r is None:
            if len(self._open) >= MAX_OPEN_ROUNDS:
                raise ServiceError("bad_args", f"agree: {len(self._open)} rounds are open, the limit; "
                                   "some ranks of a group are not calling agree")
            r = self._open[key] = _Round(world, vals, done=asyncio.get_running_loop().create_future())
        else:
            if world != r.world or len(vals) != len(r.values):
                raise ServiceError("bad_args", f"agree {key}: rank {rank} sends world={world} and "
                                   f"{len(vals)} values, the round has world={r.world} and {len(r.values)}")
            if rank in r.ranks:
                raise ServiceError("bad_args", f"agree {key}: rank {rank} contributed twice")
            r.values = list(map(min, r.values, vals))
        r.ranks.add(rank)
        assert r.done is not None
        if len(r.ranks) == r.world:
            del self._open[key]
            self.completed += 1
            r.done.set_result(r.values)
            return {"values": r.values}
        try:
            got = await asyncio.wait_for(asyncio.shield(r.done), min(wait_s, self.max_wait_s))
        except asyncio.TimeoutError:
            self._fail(key, r)
            raise ServiceError("timeout", self._failed[key]) from None
        return {"values": got}

    def _fail(self, key: tuple[str, int], r: _Round) -> None:
        if self._open.get(key) is not r:
            return  # completed or failed meanwhile
        del self._open[key]
        missing = sorted(set(range(r.world)) - r.ranks)
        msg = (f"agree {key}: ranks {missing} of {r.world} did not contribute in time (have {sorted(r.ranks)}); "
               "every rank must call agree in the same order")
        self._failed[key] = msg
        while len(self._failed) > MAX_FAILED_ROUNDS:
            self._failed.popitem(last=False)
        self.failed += 1
        assert r.done is not None
        r.done.set_exception(ServiceError("timeout", msg))
        r.done.exception()  # retrieved: waiters raise their own copy

    def _parse(self, req: dict[str, Any]) -> tuple[tuple[str, int], int, int, list[int], float]:
        g, rnd, rank, world = req.get("group"), req.get("round"), req.get("rank"), req.get("world")
        vals, wait_ms = req.get("values"), req.get("wait_ms")
        if not isinstance(g, str) or not 0 < len(g) <= MAX_GROUP_CHARS:
            raise ServiceError("bad_args", f"agree needs group: 1-{MAX_GROUP_CHARS} characters, got {g!r:.80}")
        for name, v in (("round", rnd), ("world", world), ("rank", rank)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ServiceError("bad_args", f"agree needs {name}: an integer >= 0, got {v!r:.80}")
        if not 0 <= rank < world:
            raise ServiceError("bad_args", f"agree: rank {rank} is not in [0, world={world})")
        if not isinstance(wait_ms, (int, float)) or isinstance(wait_ms, bool) or not 0 <= wait_ms < 1e9:
            raise ServiceError("bad_args", f"agree needs wait_ms >= 0 (milliseconds), got {wait_ms!r:.80}")
        if not isinstance(vals, list) or not vals:
            raise ServiceError("bad_args", f"agree needs values: a non-empty list, got {type(vals).__name__}")
        try:
            vals = check_values(vals)
        except ValueError as e:
            raise ServiceError("bad_args", str(e)) from None
        return (g, rnd), rank, world, vals, wait_ms / 1000.0

    @property
    def num_open(self) -> int:
        return len(self._open)

    def check_integrity(self) -> None:
        """Every open round waits, and has some but not all of its ranks."""
        for key, r in self._open.items():
            if r.done is None or r.done.done() or not 0 < len(r.ranks) < r.world or max(r.ranks) >= r.world:
                raise IntegrityError(f"open agree round {key}: ranks {sorted(r.ranks)} of world {r.world}, "
                                     f"done={r.done is not None and r.done.done()}")
