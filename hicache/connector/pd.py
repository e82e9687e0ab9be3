"""Prefill/decode disaggregation through the connector: vLLM's ``kv_transfer_params``
carried by its P/D proxy, over handoff objects in L3 (no engine imports).

A producer (``kv_role=kv_producer``) publishes a finished prefill of a request whose
params say ``do_remote_decode``: every page of its computed prompt (target and draft
planes; the partial last page with its padding zeroed) is copied to L2 staging and
stored to L3 under request-scoped keys (``handoff_keys``), then a ``Record`` marks the
handoff complete. The request's metadata slot (``hicache.cache.slots``; the first
token) stays owned until the consumer deletes the record, an abort releases it, or
``ttl_s`` passes. A consumer (``kv_consumer``) loads exactly those pages for a request
whose params say ``do_remote_prefill``, then deletes the handoff. A missing, partial or
unverifiable handoff fails every block it claimed (vLLM's ``kv_load_failure_policy``
decides), is logged with its reason, and is never tried twice. Both sides register a ``handoff.hello`` under
``pd.group`` and refuse to start beside a peer of another layout.
"""
from __future__ import annotations

import dataclasses
import hashlib
import logging
import math
import time
import uuid
from typing import Any, Callable, Mapping, NamedTuple, Sequence

import msgpack
import torch

from hicache.connector.plan import JobKind, JobReport, LoadSpec, SaveSpec, StepPlan
from hicache.cache.handoff import check_peer, hello
from hicache.cache.slots import MetaSlotPool, SlotView
from hicache.core.errors import ConfigError, ContractMismatch, IntegrityError
from hicache.core.hashing import HASH_BYTES
from hicache.core.layout import KVLayout

log = logging.getLogger(__name__)

ROLES = ("kv_producer", "kv_consumer")
RECORD_BYTES = 512  # one handoff record object (msgpack, zero padded)
HELLO_BYTES = 8192  # one registered hello (msgpack of handoff.hello, zero padded)
HELLO_FINGERPRINT = "hicache-pd-hello-v1"  # hellos of every layout share one namespace
# vLLM's params that a producer hands back (NixlConnector's names) plus hicache's own.
PARAM_KEYS = ("do_remote_prefill", "do_remote_decode", "remote_engine_id", "remote_request_id",
              "remote_block_ids", "remote_host", "remote_port", "tp_size", "remote_num_tokens",
              "hicache_handoff", "hicache_fingerprint")


@dataclasses.dataclass(frozen=True)
class PDSettings:
    """``kv_connector_extra_config.pd`` (``from_extra`` names a bad key and the fix)."""

    group: str = "default"  # producers and consumers that hand off to each other
    slots: int = 256  # metadata slots: handoffs owned at once (admission waits beyond)
    ttl_s: float = 480.0  # producer: a handoff no consumer took is deleted after this
    wait_s: float = 30.0  # consumer: how long a request waits for its handoff to be complete
    poll_s: float = 0.5  # producer: how often it checks which handoffs consumers released

    @classmethod
    def from_extra(cls, d: Mapping[str, Any]) -> "PDSettings":
        known = {f.name: f.type for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - set(known))
        if unknown:
            raise ConfigError(f"hicache connector: pd keys {unknown} are unknown; known: {sorted(known)}")
        out = cls(**d)
        if not isinstance(out.group, str) or not out.group:
            raise ConfigError(f"hicache connector: pd.group={out.group!r}; must be a non-empty string")
        if not isinstance(out.slots, int) or out.slots < 1:
            raise ConfigError(f"hicache connector: pd.slots={out.slots!r}; must be an integer >= 1")
        for k in ("ttl_s", "wait_s", "poll_s"):
            v = getattr(out, k)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or v < 0:
                raise ConfigError(f"hicache connector: pd.{k}={v!r}; must be a number of seconds >= 0")
        return out


def _digest(*parts: object) -> bytes:
    return hashlib.blake2b("/".join(map(str, parts)).encode(), digest_size=HASH_BYTES).digest()


def prompt_digest(key: bytes, namespace: str = "") -> str:
    """A prompt's identity: its index key (uint32 ids, content-keyed pages: what the
    connector keys pages by) and its namespace (LoRA, cache salt)."""
    return hashlib.blake2b(namespace.encode() + b"\0" + bytes(key), digest_size=16).hexdigest()


def handoff_keys(handoff: str, digest: str, num_pages: int) -> tuple[bytes, ...]:
    """Request-scoped L3 keys of a handoff's pages: never a chained page hash, and a
    consumer whose prompt differs (another ``digest``) finds none of them."""
    return tuple(_digest("hicache-handoff", handoff, digest, j) for j in range(num_pages))


def record_key(handoff: str) -> bytes:
    return _digest("hicache-handoff-record", handoff)


class Record(NamedTuple):
    """What the producer writes once every rank stored every page of a handoff."""

    handoff: str
    rid: str  # the producer's request id
    num_tokens: int  # prompt tokens whose KV travels (the partial last page included)
    digest: str  # prompt_digest of those tokens
    fingerprint: str
    first_token: int  # what the producer sampled (its metadata slot)

    def pack(self) -> bytes:
        blob = msgpack.packb(list(self))
        if len(blob) > RECORD_BYTES:
            raise ContractMismatch(f"handoff record of {len(blob)} bytes, over {RECORD_BYTES}: the request id or "
                                   "the namespace is too long for a P/D handoff")
        return blob + bytes(RECORD_BYTES - len(blob))

    @classmethod
    def unpack(cls, raw: bytes | memoryview) -> "Record | None":
        """The record in an object's payload, or None when it is not one."""
        u = msgpack.Unpacker(raw=False)
        u.feed(bytes(raw))
        try:
            fields = next(u)
            rec = cls(*fields)
        except (StopIteration, TypeError, ValueError, msgpack.UnpackException):
            return None
        ok = (isinstance(rec.handoff, str) and isinstance(rec.rid, str) and isinstance(rec.num_tokens, int)
              and isinstance(rec.digest, str) and isinstance(rec.fingerprint, str)
              and isinstance(rec.first_token, int))
        return rec if ok else None


@dataclasses.dataclass(slots=True)
class PDCounters:
    """Handoff counters since start (``ConnectorStats.handoffs``: ``core.stats.HANDOFF_EVENTS``)."""

    slot_waits: int = 0  # lookups that waited for a free metadata slot
    published: int = 0  # producer: handoffs complete in L3 (record written)
    published_pages: int = 0
    released: int = 0  # producer: published handoffs a consumer took (deleted the record)
    expired: int = 0  # producer: published handoffs nobody took within pd.ttl_s (deleted here)
    publish_failed: int = 0  # producer: a copy or an L3 store failed (deleted; the consumer's load fails)
    publish_dropped: int = 0  # producer: no L2 staging room; answered do_remote_prefill=False
    producer_aborted: int = 0  # producer: do_remote_decode requests that ended without a finished prefill
    loaded: int = 0  # consumer: handoffs loaded in full
    loaded_pages: int = 0
    load_failed: int = 0  # consumer: missing, partial or unverifiable; every claimed block failed
    consumer_aborted: int = 0  # consumer: requests that ended before their handoff was loaded


@dataclasses.dataclass(slots=True)
class _Out:
    """Producer: one handoff from publish to release."""

    rid: str
    slot: SlotView
    record: Record
    keys: tuple[bytes, ...]
    job: int
    staging: list[int]
    stores: list[JobReport] = dataclasses.field(default_factory=list)  # STORE reports, one per rank
    since: float = 0.0  # when the record was written


@dataclasses.dataclass(slots=True)
class _In:
    """Consumer: one request's handoff from its first lookup to its load's end."""

    rid: str
    handoff: str
    num_tokens: int  # tokens the handoff claims (the producer computed)
    fingerprint: object
    first_seen: float
    verdict: str = ""  # "" not yet complete in L3; OK; else why it cannot be loaded
    record: Record | None = None
    slot: SlotView | None = None
    local: int = 0  # vLLM's own hit when it asked
    job: int = 0
    blocks: tuple[int, ...] = ()
    staging: list[int] = dataclasses.field(default_factory=list)
    reports: list[JobReport] = dataclasses.field(default_factory=list)
    aborted: bool = False


OK = "ok"
LOADED, FAILED, ABORTED = "loaded", "load_failed", "consumer_aborted"  # how a consumer's handoff ends


class Handoffs:
    """One engine's P/D side over a ``ConnectorScheduler`` (see the module docstring).

    Called from the engine scheduler's thread only. ``stores``: the L3 backend of each
    TP rank's layout (rank 0's holds the records); ``hellos``: the layout-free
    namespace both sides register in. Raises ``ContractMismatch`` at construction
    when the other role registered another layout under ``settings.group``.
    """

    def __init__(self, role: str, layout: KVLayout, core, stores: Sequence, hellos, settings: PDSettings, *,
                 engine_id: str, clock: Callable[[], float] = time.monotonic):
        if role not in ROLES:
            raise ConfigError(f"hicache connector: P/D role {role!r}; use one of {', '.join(ROLES)}")
        self.role, self.layout, self.core, self.stores, self.hellos = role, layout, core, list(stores), hellos
        self.settings, self.engine_id, self.clock = settings, engine_id, clock
        self.ranks = len(self.stores)
        self.slots = MetaSlotPool(settings.slots, top_k=1, hidden_size=1)
        self.c = PDCounters()
        self._admitted: dict[str, SlotView] = {}  # producer: prefills running, by request id
        self._out: dict[int, _Out] = {}  # producer: publishes in flight, by job
        self._published: dict[str, _Out] = {}  # producer: complete handoffs, by handoff id
        self._in: dict[str, _In] = {}  # consumer: by request id
        self._in_jobs: dict[int, str] = {}  # consumer: loads in flight -> request id
        self._loads: list[LoadSpec] = []
        self._saves: list[SaveSpec] = []
        self._last_poll = -math.inf
        self._register()

    @property
    def producer(self) -> bool:
        return self.role == "kv_producer"

    # ------------------------------------------------------------- the pair
    def _hello_key(self, role: str) -> bytes:
        return _digest("hicache-pd-hello", self.settings.group, role)

    def _register(self) -> None:
        """Check the other role's registered hello (if any), then register ours."""
        peer_role = ROLES[self.producer]
        [raw] = self.hellos.get([self._hello_key(peer_role)], [HELLO_BYTES])
        if raw is not None:
            peer = _unpad(raw)
            try:
                check_peer(self.layout, peer)
            except ContractMismatch as e:
                raise ContractMismatch(
                    f"P/D group {self.settings.group!r}: the {peer_role} registered there (engine "
                    f"{peer.get('engine_id')!r}) has another KV layout; start both sides with the same model "
                    "and KV settings (a peer that is gone without stopping cleanly: use another pd.group)",
                    e.differences) from None
        ours = {**hello(self.layout), "role": self.role, "engine_id": self.engine_id}
        self.hellos.put([(self._hello_key(self.role), _pad(ours, HELLO_BYTES), [HELLO_BYTES])])

    def close(self) -> None:
        """Withdraw this side's hello and close the stores (owned slots die with the process)."""
        try:
            self.hellos.delete([self._hello_key(self.role)])
        except RuntimeError as e:  # vLLM's exit-time shutdown runs after Python stopped the stores' I/O threads
            log.warning("hicache connector: the %s could not withdraw its registration from P/D group %r (%s); "
                        "a peer of another KV layout is refused there until one of this layout stops cleanly: "
                        "shut vLLM down before the process exits, or use another pd.group", self.role,
                        self.settings.group, e)
        for s in [*self.stores, self.hellos]:
            s.close()

    # ------------------------------------------------------------- producer
    def admit(self, rid: str) -> bool:
        """Producer, before a ``do_remote_decode`` request is scheduled: own a slot for it.
        False: every slot is owned (vLLM asks again next step)."""
        if rid in self._admitted:
            return True
        view = self.slots.try_acquire(rid)
        if view is None:
            self.c.slot_waits += 1
            return False
        self._admitted[rid] = view
        return True

    def publish(self, rid: str, key: bytes, namespace: str, computed: int, completed: bool, first_token: int,
                block_ids: Sequence[int]) -> tuple[bool, dict | None]:
        """Producer, when ``rid`` ended holding ``block_ids``: queue the publish of its
        ``computed`` prompt tokens (``key``: the prompt's index key, 4 bytes a token).
        Returns vLLM's ``(delay_free, kv_transfer_params)``."""
        view = self._admitted.pop(rid, None)
        n = min(computed, len(key) // 4)
        if not completed or n == 0:  # aborted, or stopped before its prefill finished
            if view is not None:
                self.slots.release(view)
            self.c.producer_aborted += 1
            return False, None
        pages = math.ceil(n / self.layout.page_size)
        view = view or self.slots.try_acquire(rid)
        staging = self._reserve(pages) if view is not None else None
        if staging is None:  # the decode side computes the prompt itself
            if view is not None:
                self.slots.release(view)
            self.c.publish_dropped += 1
            return False, self._params(None, n)
        self.slots.write(view, first_token, torch.tensor([first_token]), torch.tensor([1.0]), torch.zeros(1))
        handoff = uuid.uuid4().hex
        digest = prompt_digest(key[:4 * n], namespace)
        rec = Record(handoff, rid[:200], n, digest, self.layout.fingerprint(), int(first_token))
        keys = handoff_keys(handoff, digest, pages)
        job = self.core.new_job()
        self._saves.append(SaveSpec(job, rid, tuple(int(b) for b in block_ids[:pages]), tuple(staging), keys,
                                    rows=n % self.layout.page_size))
        self._out[job] = _Out(rid, view, rec, keys, job, staging)
        return True, self._params(handoff, n)

    def _params(self, handoff: str | None, n: int) -> dict:
        """What vLLM returns to the proxy, which sends it on to the decode instance."""
        return dict(do_remote_prefill=handoff is not None, do_remote_decode=False, remote_engine_id=self.engine_id,
                    remote_request_id=None, remote_block_ids=None, remote_host=None, remote_port=None,
                    tp_size=self.layout.tp_size, remote_num_tokens=n, hicache_handoff=handoff,
                    hicache_fingerprint=self.layout.fingerprint())

    def _stored(self, out: _Out, r: JobReport) -> None:
        out.stores.append(r)
        if len(out.stores) < self.ranks:
            return
        del self._out[out.job]
        self._free(out.staging)
        out.staging = []
        ok = all(x.ok for x in out.stores) and min(x.pages for x in out.stores) == len(out.keys)
        if ok:
            ok = self.stores[0].put([(record_key(out.record.handoff), out.record.pack(), [RECORD_BYTES])]) == 1
        if not ok:
            self._delete(out.record.handoff, out.keys)
            self.slots.release(out.slot)
            self.c.publish_failed += 1
            return
        out.since = self.clock()
        self._published[out.record.handoff] = out
        self.c.published += 1
        self.c.published_pages += len(out.keys)

    def _poll(self) -> None:
        """Release the slots of handoffs whose record a consumer deleted; expire old ones."""
        now = self.clock()
        if not self._published or now - self._last_poll < self.settings.poll_s or self.stores[0].down:
            return
        self._last_poll = now
        outs = list(self._published.values())
        present = self.stores[0].exists([record_key(o.record.handoff) for o in outs])
        for o, there in zip(outs, present):
            if there and now - o.since < self.settings.ttl_s:
                continue
            del self._published[o.record.handoff]
            self._delete(o.record.handoff, o.keys)  # a consumer that could not read the record left its pages
            if there:
                self.slots.release(o.slot)
                self.c.expired += 1
            else:
                self.slots.consume(o.slot)
                self.c.released += 1

    # ------------------------------------------------------------- consumer
    def lookup(self, rid: str, params: dict, key: bytes, namespace: str, local: int) -> tuple[int | None, bool]:
        """Consumer, for a ``do_remote_prefill`` request: the tokens its handoff holds
        beyond vLLM's own ``local`` hit, loaded asynchronously; ``(None, False)`` while
        the handoff is not complete in L3 (up to ``pd.wait_s``) or no slot is free."""
        rc = self._in.get(rid)
        if rc is None:
            rc = self._in[rid] = self._receive(rid, params, len(key) // 4)
        if not rc.verdict:
            rc.verdict = self._check(rc, prompt_digest(key[:4 * rc.num_tokens], namespace))
            if not rc.verdict:
                if self.clock() - rc.first_seen < self.settings.wait_s:
                    return None, False
                rc.verdict = (f"handoff {rc.handoff} was not complete in L3 within pd.wait_s="
                              f"{self.settings.wait_s}s")
        if rc.slot is None:
            rc.slot = self.slots.try_acquire(rid)
            if rc.slot is None:
                self.c.slot_waits += 1
                return None, False
            if rc.record is not None:
                f = rc.record.first_token
                self.slots.write(rc.slot, f, torch.tensor([f]), torch.tensor([1.0]), torch.zeros(1))
        rc.local = local
        n = rc.num_tokens - local
        if n <= 0:  # vLLM's own cache holds it all: the handoff is not needed
            params["do_remote_prefill"] = False
            self._close(rc, LOADED if rc.verdict == OK else FAILED, rc.verdict)
            return 0, False
        return n, True

    def _receive(self, rid: str, params: Mapping, num_prompt: int) -> _In:
        handoff, n = params.get("hicache_handoff"), params.get("remote_num_tokens")
        rc = _In(rid, handoff if isinstance(handoff, str) else "", num_prompt, params.get("hicache_fingerprint"),
                 self.clock())
        if not rc.handoff or not isinstance(n, int) or isinstance(n, bool) or not 0 < n <= num_prompt:
            rc.verdict = (f"kv_transfer_params of {rid!r} name no hicache handoff of at most its {num_prompt} "
                          f"prompt tokens (hicache_handoff={handoff!r}, remote_num_tokens={n!r}): the prefill "
                          "instance must run HiCacheConnector as kv_producer")
        else:
            rc.num_tokens = n
        return rc

    def _check(self, rc: _In, digest: str) -> str:
        """OK, "" (not complete yet) or why the handoff cannot be loaded (``digest``: of
        the request's first ``rc.num_tokens`` tokens). Reads its record."""
        fp = self.layout.fingerprint()
        if rc.fingerprint != fp:
            return f"handoff {rc.handoff} has fingerprint {rc.fingerprint!r}, this instance {fp!r}"
        key = record_key(rc.handoff)
        [there] = self.stores[0].exists([key])
        if not there:
            return ""
        [raw] = self.stores[0].get([key], [RECORD_BYTES])
        rec = Record.unpack(raw) if raw is not None else None
        if rec is None:
            return f"handoff {rc.handoff}: its record failed verification (corrupt or another layout's)"
        want = (rc.handoff, rc.num_tokens, digest, fp)
        if (rec.handoff, rec.num_tokens, rec.digest, rec.fingerprint) != want:
            return (f"handoff {rc.handoff}: its record holds {rec.num_tokens} tokens of digest {rec.digest}, "
                    f"the request {want[1]} of digest {want[2]} (another prompt)")
        rc.record = rec
        return OK

    def allocated(self, rid: str, params: dict, block_ids: Sequence[int], num_external: int) -> bool:
        """Consumer: vLLM gave ``rid`` its blocks for ``num_external`` tokens of the
        handoff: queue the load (every block failed when the handoff cannot be loaded).
        The params stop claiming a remote prefill: a failed load is recomputed, never
        tried again. False: ``rid`` has no handoff here."""
        rc = self._in.get(rid)
        if rc is None or rc.job:
            return rc is not None
        params["do_remote_prefill"] = False
        if not num_external:  # vLLM chose not to load it (its worker reports nothing for no job)
            self._close(rc, FAILED, rc.verdict if rc.verdict != OK else "vLLM asked to load none of its tokens")
            return True
        ps = self.layout.page_size
        first, end = rc.local // ps, math.ceil((rc.local + num_external) / ps)
        rc.blocks = tuple(int(b) for b in block_ids[first:end])
        rc.job = self.core.new_job()
        self._in_jobs[rc.job] = rid
        staging = self._reserve(len(rc.blocks)) if rc.verdict == OK and rc.blocks else None
        if staging is None and rc.verdict == OK and rc.blocks:
            rc.verdict = f"no L2 room to stage its {len(rc.blocks)} pages (host_bytes)"
        if staging is None:
            self._loads.append(LoadSpec(rc.job, rid, rc.blocks, ()))  # every block reported failed
        else:
            rc.staging = staging
            keys = handoff_keys(rc.handoff, rc.record.digest, end)[first:]
            self._loads.append(LoadSpec(rc.job, rid, rc.blocks, (), tuple(staging), keys))
        return True

    def _loaded(self, rc: _In, r: JobReport) -> None:
        rc.reports.append(r)
        if len(rc.reports) < self.ranks:
            return
        del self._in_jobs[rc.job]
        self._free(rc.staging)
        rc.staging = []
        landed = min(x.pages for x in rc.reports) if all(x.ok for x in rc.reports) else 0
        self.core._c["loaded"] += landed  # the connector's page counters count handoffs' pages too
        self.core._c["load_errors"] += len(rc.blocks) - landed
        why = (rc.verdict if rc.verdict != OK else f"{len(rc.blocks) - landed} of its {len(rc.blocks)} pages not "
               "loaded (one missing or failing verification in L3, and every later one)" if landed < len(rc.blocks)
               else "")
        self._close(rc, FAILED if why else ABORTED if rc.aborted else LOADED, why)

    def ended(self, rid: str) -> bool:
        """Consumer: ``rid`` finished or was aborted. True while its load is in flight
        (vLLM keeps the blocks until the worker reports it); the handoff is released
        when it completes, or here."""
        rc = self._in.get(rid)
        if rc is None:
            return False
        rc.aborted = True
        if rc.job:
            return True
        self._close(rc, ABORTED)
        return False

    def _close(self, rc: _In, outcome: str, why: str = "") -> None:
        """Delete the handoff (the producer sees its record gone), end the slot (consumed
        only when the request decodes from the handoff) and count ``outcome`` (``why``: a
        failure's reason, logged)."""
        del self._in[rc.rid]
        if rc.handoff:
            self._delete(rc.handoff, handoff_keys(rc.handoff, rc.record.digest, math.ceil(
                rc.num_tokens / self.layout.page_size)) if rc.record is not None else ())
        if rc.slot is not None:
            self.slots.consume(rc.slot) if outcome == LOADED else self.slots.release(rc.slot)
        if outcome == LOADED:
            self.c.loaded += 1
            self.c.loaded_pages += len(rc.blocks)
        elif outcome == ABORTED:
            self.c.consumer_aborted += 1
        else:
            self.c.load_failed += 1
            log.warning("hicache connector: P/D handoff %s of request %r not loaded: %s; vLLM recomputes the request "
                        "or fails it, as kv_load_failure_policy says", rc.handoff or "(none)", rc.rid, why)

    # ------------------------------------------------------------- both
    def take_plan(self, plan: StepPlan) -> StepPlan:
        """``plan`` with this side's queued loads and saves; polls releases first."""
        if self.producer:
            self._poll()
        out = StepPlan(plan.loads + tuple(self._loads), plan.saves + tuple(self._saves))
        self._loads, self._saves = [], []
        return out

    def completed(self, reports: Sequence[JobReport]) -> list[JobReport]:
        """Take the reports of this side's jobs; return the others (the core's)."""
        rest = []
        for r in reports:
            if r.job in self._out:
                if r.kind is JobKind.STORE:  # a failed copy reports a failed STORE too
                    self._stored(self._out[r.job], r)
            elif r.job in self._in_jobs:
                self._loaded(self._in[self._in_jobs[r.job]], r)
            else:
                rest.append(r)
        return rest

    @property
    def publishing(self) -> bool:
        """Producer: publishes queued or in flight (the engine must keep stepping for them)."""
        return bool(self._saves or self._out)

    def _reserve(self, n: int) -> list[int] | None:
        core = self.core
        core._evict(n)
        ids = core.tiers.alloc_host(n)
        if ids is not None:
            core.staged.update(ids)
        return ids

    def _free(self, ids: list[int]) -> None:
        if ids:
            self.core.staged.difference_update(ids)
            self.core.tiers.free_host(ids)  # as alloc_host gave them (the page-state table stays in step)

    def _delete(self, handoff: str, keys: Sequence[bytes]) -> None:
        """Every rank's page objects, then the record (rank 0's)."""
        for s in self.stores:
            if keys:
                s.delete(list(keys))
        self.stores[0].delete([record_key(handoff)])

    def stats(self) -> dict[str, int]:
        """The counters by event (``ConnectorStats.handoffs``)."""
        return {k: getattr(self.c, k) for k in PDCounters.__slots__}

    def check_integrity(self) -> None:
        """Every owned slot belongs to a tracked handoff, and the staging pages add up."""
        self.slots.check_integrity()
        if self.producer:
            want = [*self._admitted, *(o.rid for o in self._out.values()), *(o.rid for o in self._published.values())]
        else:
            want = [rc.rid for rc in self._in.values() if rc.slot is not None]
        have = sorted(self.slots.owners().values())
        if have != sorted(want):
            raise IntegrityError(f"P/D {self.role}: slots owned by {have}, handoffs tracked for {sorted(want)}")
        staged = [p for o in self._out.values() for p in o.staging] + [p for rc in self._in.values()
                                                                        for p in rc.staging]
        if sorted(staged) != sorted(self.core.staged):
            raise IntegrityError(f"P/D {self.role}: staging pages {sorted(staged)} but the connector's L2 holds "
                                 f"{sorted(self.core.staged)} for handoffs")


def _pad(obj: Mapping, size: int) -> bytes:
    blob = msgpack.packb(dict(obj))
    if len(blob) > size:
        raise ConfigError(f"P/D hello of {len(blob)} bytes is over {size}: the KV layout description is too long")
    return blob + bytes(size - len(blob))


def _unpad(raw) -> dict:
    u = msgpack.Unpacker(raw=False)
    u.feed(bytes(raw))
    return dict(next(u))


def open_handoffs(role: str, layout: KVLayout, core, settings, ranks: int, engine_id: str) -> Handoffs:
    """The P/D side of a connector built from ``settings`` (``ConnectorSettings``): one L3
    store per TP rank's layout and the hello namespace, at ``storage.url``."""
    from hicache.connector.scheduler import ConnectorScheduler
    from hicache.storage import open_storage
    from hicache.storage.capacity import backend_options

    pd = PDSettings.from_extra(settings.pd)
    s = settings.config.storage
    if settings.shared or not s.url or not isinstance(core, ConnectorScheduler):
        raise ConfigError(f"hicache connector: kv_role={role} hands prefills off through L3; set storage.url to "
                          f"a store both instances open (redis://host:port, or file:///dir on one host), "
                          f"not {s.url!r}")
    stores = [settings.open_l3(layout.replace(tp_rank=r)) for r in range(ranks)]
    hellos = open_storage(s.url, fingerprint=HELLO_FINGERPRINT, key_prefix=b"hicache-pd:", timeout_ms=s.timeout_ms,
                          max_retries=s.max_retries, auth_key=s.resolved_auth_key(), **backend_options(s))
    return Handoffs(role, layout, core, stores, hellos, pd, engine_id=engine_id)
