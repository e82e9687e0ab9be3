"""Prefill -> decode handoff through L2 (a shared HostPool, a shared-memory segment) and
L3 (Redis): fingerprint bootstrap that fails fast naming fields; decoding after a
handoff equals decoding without one (tokens, logits bit for bit, accept lengths)."""
from __future__ import annotations

import os
import uuid

import pytest
import torch

from hicache.reference.model import ReferenceModel, verify_greedy
from hicache.reference.model_spec import ModelSpec
from hicache.core.errors import ContractMismatch
from hicache.cache.handoff import Exporter, Importer, L2Channel, L3Channel, check_peer, hello
from hicache.memory.pools import HostPool
from hicache.memory.shm import SharedSegment
from hicache.cache.slots import MetaSlotPool
from hicache.storage import open_storage

from .helpers import make_hc

SPEC = ModelSpec(vocab=97, hidden=32, num_layers=2, num_q_heads=4, mlp=48, kind="mha",
                 num_kv_heads=2, head_dim=8, seed=3)
LAYOUT = SPEC.kv_layout(4, "page_first", draft_layers=1)
TOPK, SPEC_K, STEPS = 3, 3, 14


@pytest.fixture(scope="module")
def model():
    return ReferenceModel(SPEC)


def prompt(seed=5, n=23):
    return torch.randint(1, 97, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def prefill(model, hc, rid, toks, slots):
    """Prefill ``toks`` on ``hc`` (reusing its hit) and fill the request's metadata slot."""
    req = hc.new_request(rid, toks)
    hc.admit(req).wait()
    h = req.computed_tokens
    req.alloc(len(toks) - h)
    out = model.forward_chunk(hc.device_pool, toks[h:], h, hc.device_pool.slot_ids(req.pages))
    req.commit(draft_tokens=len(toks) - 1)
    probs, ids = torch.softmax(out.logits_last, -1).topk(TOPK)
    view = slots.acquire(rid)
    slots.write(view, int(out.logits_last.argmax()), ids, probs, out.hidden_last)
    return req, view


def spec_decode(model, hc, req, meta):
    """Speculative greedy decoding from a slot's metadata (first token, hidden row)."""
    pool, tok, hidden = hc.device_pool, meta.first_token, meta.hidden
    toks, logits, accepts = [tok], [], []
    while len(toks) < STEPS:
        pos = req.num_tokens
        req.extend([tok] + [0] * SPEC_K)
        req.alloc(SPEC_K + 1)
        slots = pool.slot_ids(req.pages)
        d = model.speculate(pool, hidden, tok, pos - 1, slots, SPEC_K)
        v = model.forward_chunk(pool, [tok, *d.tokens], pos, slots, all_logits=True)
        verdict = verify_greedy(v.logits, d.tokens)
        a = verdict.accept_length
        accepts.append(a)
        req.replace_uncommitted([tok, *d.tokens[:a]])
        req.commit(a + 1)
        toks += verdict.tokens
        logits.append(v.logits[:a + 1])
        hidden, tok = v.hidden[a], verdict.bonus_token
    hc.check_integrity()
    return toks, torch.cat(logits), accepts


def reference(model, toks):
    hc = make_hc(LAYOUT)
    slots = MetaSlotPool(2, TOPK, SPEC.hidden)
    req, view = prefill(model, hc, "ref", toks, slots)
    out = spec_decode(model, hc, req, slots.consume(view))
    hc.close()
    return out


class Pair:
    """A prefill and a decode instance joined by one channel kind."""

    def __init__(self, kind, tmp_path, redis_url, decode_layout=LAYOUT):
        self.p, self.d = make_hc(LAYOUT), make_hc(decode_layout)
        self.slots_p = MetaSlotPool(2, TOPK, SPEC.hidden)
        self.slots_d = self.slots_p
        self.segs = []
        if kind == "l2":
            self.tx = self.rx = L2Channel(HostPool(LAYOUT, 16), self.slots_p)
        elif kind == "l2-shm":
            name = f"hicache-test-{os.getpid()}-{uuid.uuid4().hex[:8]}"
            size = HostPool.nbytes_for(LAYOUT, 16)
            a = SharedSegment.create(name, size)
            b = SharedSegment.attach(name, size)
            self.segs = [b, a]
            self.tx = L2Channel(HostPool(LAYOUT, 16, buffer=a.tensor), self.slots_p)
            self.rx = L2Channel(HostPool(decode_layout, 16, buffer=b.tensor), self.slots_p)
        else:
            self.slots_d = MetaSlotPool(2, TOPK, SPEC.hidden)
            fp = LAYOUT.fingerprint()
            self.st = [open_storage(redis_url, fingerprint=fp, timeout_ms=2000),
                       open_storage(redis_url, fingerprint=decode_layout.fingerprint(), timeout_ms=2000)]
            self.tx = L3Channel(self.st[0], self.p.host_pool, self.slots_p)
            self.rx = L3Channel(self.st[1], self.d.host_pool, self.slots_d)

    def close(self):
        for hc in (self.p, self.d):
            hc.close()
        for s in getattr(self, "st", []):
            s.close()
        for s in self.segs:
            s.close()


@pytest.mark.parametrize("kind", ["l2", "l2-shm", "l3"])
@pytest.mark.parametrize("decode_has_prefix", [False, True])
def test_decode_after_handoff_equals_decode_without(model, kind, decode_has_prefix, tmp_path, redis_url):
    toks = prompt()
    ref = reference(model, toks)
    pair = Pair(kind, tmp_path, redis_url)
    if decode_has_prefix:  # the decode side already caches the first two pages
        r, v = prefill(model, pair.d, "prefix", toks[:9], pair.slots_d)
        r.finish()
        pair.slots_d.release(v)
    tx = Exporter(pair.p, pair.tx, hello(pair.d.layout))
    rx = Importer(pair.d, pair.rx, hello(pair.p.layout))
    req, view = prefill(model, pair.p, "r1", toks, pair.slots_p)
    ticket = tx.export(req, view)
    req.finish()
    pair.p.check_integrity()
    if kind != "l3":  # the prompt's rows travel, nothing past them
        last = pair.tx.pool.page_view(ticket.pages[-1])
        assert all(int(t[len(toks) % 4:].abs().sum()) == 0 for t in last.values())
    imp = rx.import_(ticket)
    (pair.tx if kind != "l3" else pair.rx).done(ticket)
    assert imp.hit_tokens == (8 if decode_has_prefix else 0)
    assert imp.request.computed_tokens == len(toks)
    slots = pair.rx.slots
    assert slots.owners() == {imp.slot.index: "r1"}  # owned by the request until read
    meta = slots.consume(imp.slot)
    got = spec_decode(model, pair.d, imp.request, meta)
    assert got[0] == ref[0] and torch.equal(got[1], ref[1]) and got[2] == ref[2]
    assert max(got[2]) > 0  # the draft planes travelled: speculation accepts tokens
    if kind == "l3":
        assert pair.st[1].get(list(ticket.keys), [s.page_bytes for s in LAYOUT.planes]) == [None] * 6
    else:
        assert pair.tx.pool.allocator.num_free == 16
    for s in {id(pair.slots_p): pair.slots_p, id(pair.slots_d): pair.slots_d}.values():
        s.check_integrity()
        assert s.num_free == 2
    imp.request.finish()
    pair.d.check_integrity()
    pair.close()


@pytest.mark.parametrize("change,field", [
    (dict(page_size=8), "page_size"), (dict(dtype="bfloat16"), "dtype"),
    (dict(draft_layers=0), "draft_layers"), (dict(model_id="other"), "model_id")])
@pytest.mark.parametrize("kind", ["l2", "l3"])
def test_bootstrap_fails_fast_naming_the_fields(change, field, kind, tmp_path, redis_url):
    pair = Pair(kind, tmp_path, redis_url)
    other = LAYOUT.replace(**change)
    before = pair.slots_p.num_free
    with pytest.raises(ContractMismatch, match=f"{field}: ours=.* theirs=") as e:
        Exporter(pair.p, pair.tx, hello(other))
    assert [d[0] for d in e.value.differences] == [field]
    with pytest.raises(ContractMismatch, match=field):
        Importer(pair.d, pair.rx, hello(other))
    assert pair.slots_p.num_free == before and pair.p.host_pool.allocator.num_free == 96
    pair.close()


def test_bootstrap_cp_and_host_layout(tmp_path, redis_url):
    hc = make_hc(LAYOUT)
    chan2 = L2Channel(HostPool(LAYOUT, 4), MetaSlotPool(1, TOPK, SPEC.hidden))
    Importer(hc, chan2, hello(LAYOUT.replace(cp_rank=1, cp_size=2)))  # CP never changes page bytes
    with pytest.raises(ContractMismatch, match="host_layout: ours='page_first' theirs='layer_first'"):
        Importer(hc, chan2, hello(LAYOUT.replace(host_layout="layer_first")))  # one L2 segment, two readings
    check_peer(LAYOUT, hello(LAYOUT.replace(host_layout="layer_first")))  # fine through L3
    with pytest.raises(ContractMismatch, match="protocol: ours=1 theirs=0"):
        check_peer(LAYOUT, {**hello(LAYOUT), "protocol": 0})
    with pytest.raises(ContractMismatch, match="fingerprint"):
        check_peer(LAYOUT, {**hello(LAYOUT), "fingerprint": "0" * 32})
    hc.close()


def test_abort_releases_pages_slot_and_keys(model, tmp_path, redis_url):
    toks = prompt()
    for kind in ("l2", "l3"):
        pair = Pair(kind, tmp_path, redis_url)
        tx = Exporter(pair.p, pair.tx, hello(pair.d.layout))
        req, view = prefill(model, pair.p, f"a-{kind}", toks, pair.slots_p)
        ticket = tx.export(req, view)
        req.abort()
        pair.tx.abort(ticket)
        assert pair.slots_p.num_free == 2
        if kind == "l2":
            assert pair.tx.pool.allocator.num_free == 16
        else:
            assert pair.st[0].exists(list(ticket.keys)) == [False] * 6
        bad = ticket._replace(fingerprint="f" * 32)
        with pytest.raises(ContractMismatch, match="handoff ticket"):
            Importer(pair.d, pair.rx, hello(pair.p.layout)).import_(bad)
        pair.p.check_integrity()
        pair.d.check_integrity()
        pair.close()
