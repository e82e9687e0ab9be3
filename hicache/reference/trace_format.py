"""The JSONL trace format of hicache workloads, its validation, and prompt resolution.

Trace format (``hicache_trace`` version 1), UTF-8 JSON Lines:

* line 1, the header: ``{"hicache_trace": 1, "name": "mixed-small", "vocab": 512}``;
  every token id in the file is in ``[0, vocab)``;
* then one request per line, in non-decreasing ``arrival`` order::

    {"rid": "sys-0007", "arrival": 1.25, "prompt": [5, 17, ...], "max_new_tokens": 8}
    {"rid": "chat-002-t1", "arrival": 3.5, "parent": "chat-002-t0", "append": [9, 4, ...],
     "max_new_tokens": 16, "conversation": "chat-002", "namespace": ""}

  ``rid`` (unique string), ``arrival`` (seconds from the start, >= 0) and
  ``max_new_tokens`` (>= 1) are required; ``namespace`` (default ``""``) and
  ``conversation`` (default none) are optional. A request has *either* a
  ``prompt`` (its full prompt) *or* a ``parent`` and ``append``: a follow-up
  turn whose prompt is the parent's *full sequence* (the parent's resolved
  prompt followed by the tokens the model generated for it, which exist only
  at replay time) followed by ``append``. The parent must appear on an earlier
  line; a follow-up is started no earlier than its arrival and never before
  its parent finished. ``PromptResolver`` performs this resolution during a
  replay. Unknown fields are errors (they are usually typos).

The generators live in ``hicache.reference.workloads``, which re-exports this API.
"""
from __future__ import annotations

import errno
import json
import math
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Iterable, Iterator, NamedTuple, Sequence

from hicache.core.errors import IntegrityError, TraceError

TRACE_VERSION = 1
# The reference model allocates a vocab x hidden embedding: bound it far above
# any real tokenizer (the largest have ~256K entries).
MAX_VOCAB = 1 << 20
# One line is read whole before it is parsed: 16 MiB holds ~2M token or hash ids.
MAX_LINE_BYTES = 1 << 24
_FIELDS = {"rid", "arrival", "max_new_tokens", "prompt", "parent", "append", "namespace", "conversation"}


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request of a trace. Exactly one of ``prompt`` / (``parent``, ``append``) is used."""

    rid: str
    arrival: float  # seconds from the start of the trace
    max_new_tokens: int
    prompt: tuple[int, ...] = ()  # full prompt of a root request
    parent: str | None = None  # follow-up: rid whose full sequence precedes ``append``
    append: tuple[int, ...] = ()  # follow-up: new user tokens after the parent's sequence
    namespace: str = ""  # LoRA adapter / cache salt; namespaces never share pages
    conversation: str | None = None

    @property
    def is_followup(self) -> bool:
        return self.parent is not None

    def to_json(self) -> dict:
        d: dict = {"rid": self.rid, "arrival": self.arrival}
        if self.parent is None:
            d["prompt"] = list(self.prompt)
        else:
            d["parent"], d["append"] = self.parent, list(self.append)
        d["max_new_tokens"] = self.max_new_tokens
        if self.namespace:
            d["namespace"] = self.namespace
        if self.conversation is not None:
            d["conversation"] = self.conversation
        return d


class Trace(NamedTuple):
    name: str
    vocab: int
    requests: list[TraceRequest]


# --------------------------------------------------------------------- parsing
def _field_error(where: str, field: str, why: str, value: object) -> TraceError:
    shown = repr(value)
    return TraceError(f"{where}, field {field!r}: {why}, got {shown[:80] + '...' if len(shown) > 80 else shown}")


def _tokens(obj: dict, field: str, vocab: int, where: str) -> tuple[int, ...]:
    v = obj[field]
    if not isinstance(v, list) or not v:
        raise _field_error(where, field, "expected a non-empty list of token ids", v)
    for t in v:
        if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab:
            raise _field_error(where, field, f"token ids must be integers in [0, vocab={vocab})", t)
    return tuple(v)


def request_from_json(obj: object, vocab: int, where: str = "request") -> TraceRequest:
    """Validate one decoded request object; raises ``TraceError`` naming ``where`` and the field."""
    if not isinstance(obj, dict):
        raise TraceError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    unknown = sorted(set(obj) - _FIELDS)
    if unknown:
        raise TraceError(f"{where}: unknown field(s) {unknown}; known: {sorted(_FIELDS)}")
    for f in ("rid", "arrival", "max_new_tokens"):
        if f not in obj:
            raise TraceError(f"{where}: missing required field {f!r}")
    rid, arrival, mnt = obj["rid"], obj["arrival"], obj["max_new_tokens"]
    if not isinstance(rid, str) or not rid:
        raise _field_error(where, "rid", "expected a non-empty string", rid)
    if not isinstance(arrival, (int, float)) or isinstance(arrival, bool) or not math.isfinite(arrival) \
            or arrival < 0:
        raise _field_error(where, "arrival", "expected a finite number of seconds >= 0", arrival)
    if not isinstance(mnt, int) or isinstance(mnt, bool) or mnt < 1:
        raise _field_error(where, "max_new_tokens", "expected an integer >= 1", mnt)
    ns, conv = obj.get("namespace", ""), obj.get("conversation")
    if not isinstance(ns, str):
        raise _field_error(where, "namespace", "expected a string", ns)
    if conv is not None and not isinstance(conv, str):
        raise _field_error(where, "conversation", "expected a string or null", conv)
    for f, v in (("rid", rid), ("namespace", ns), ("conversation", conv), ("parent", obj.get("parent"))):
        if isinstance(v, str) and not _is_unicode(v):
            raise _field_error(where, f, "expected valid Unicode text (it holds a lone surrogate escape)",
                               v.encode("utf-8", "backslashreplace").decode())
    has_prompt, has_parent = "prompt" in obj, "parent" in obj or "append" in obj
    if has_prompt == has_parent:
        raise TraceError(f"{where}: give either 'prompt' or both 'parent' and 'append' (got "
                         f"{sorted(set(obj) & {'prompt', 'parent', 'append'})})")
    if has_prompt:
        return TraceRequest(rid, float(arrival), mnt, prompt=_tokens(obj, "prompt", vocab, where),
                            namespace=ns, conversation=conv)
    for f in ("parent", "append"):
        if f not in obj:
            raise TraceError(f"{where}: a follow-up needs both 'parent' and 'append'; missing {f!r}")
    if not isinstance(obj["parent"], str) or not obj["parent"]:
        raise _field_error(where, "parent", "expected the rid of an earlier request", obj["parent"])
    return TraceRequest(rid, float(arrival), mnt, parent=obj["parent"], append=_tokens(obj, "append", vocab, where),
                        namespace=ns, conversation=conv)


def check_requests(requests: Sequence[TraceRequest], vocab: int, where: str = "trace") -> None:
    """Cross-request rules: unique rids, parents earlier (same namespace), arrivals sorted."""
    seen: dict[str, TraceRequest] = {}
    last = 0.0
    for i, r in enumerate(requests):
        at = f"{where} request {i} (rid {r.rid!r})"
        if r.rid in seen:
            raise TraceError(f"{at}: duplicate rid")
        if r.arrival < last:
            raise TraceError(f"{at}: arrival {r.arrival} is before the previous request's {last}; "
                             "sort requests by arrival")
        if r.parent is not None:
            p = seen.get(r.parent)
            if p is None:
                raise TraceError(f"{at}: parent {r.parent!r} does not appear earlier in the trace")
            if p.namespace != r.namespace:
                raise TraceError(f"{at}: namespace {r.namespace!r} differs from parent's {p.namespace!r}")
        for t in r.prompt + r.append:
            if not 0 <= t < vocab:
                raise TraceError(f"{at}: token id {t} outside [0, vocab={vocab})")
        seen[r.rid], last = r, r.arrival


def write_trace(path: str | Path, requests: Sequence[TraceRequest], *, name: str, vocab: int) -> None:
    """Validate and write a trace (header line + one request per line). Overwrites ``path``."""
    check_requests(requests, vocab, where=f"write_trace({str(path)!r})")
    header = {"hicache_trace": TRACE_VERSION, "name": name, "vocab": vocab}
    with open(path, "w", encoding="utf-8") as f:
        f.write(json.dumps(header) + "\n")
        for r in requests:
            f.write(json.dumps(r.to_json(), separators=(",", ":")) + "\n")


def _is_unicode(s: str) -> bool:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def open_regular(path: str | Path) -> BinaryIO:
    """``path`` opened for reading when it is a regular file; ``TraceError`` otherwise.

    Opened without blocking and checked before any read: a FIFO (or a device
    such as /dev/zero) would otherwise hang the replay or never end.
    """
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            raise IsADirectoryError(errno.EISDIR, "is a directory", str(path))
        if not stat.S_ISREG(st.st_mode):
            raise TraceError(f"trace {str(path)!r} is not a regular file ({stat.filemode(st.st_mode)}: a FIFO, "
                             "socket or device); write the trace to a file and give its path")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def bounded_lines(f: BinaryIO, path: str | Path) -> Iterator[tuple[int, bytes]]:
    """Numbered raw lines of ``f``; ``TraceError`` for a line over ``MAX_LINE_BYTES``,
    raised before more than that is read (a one-line 12 GB file is refused, not loaded)."""
    no = 0
    while raw := f.readline(MAX_LINE_BYTES + 1):
        no += 1
        if len(raw) > MAX_LINE_BYTES:
            raise TraceError(f"{path}:{no}: the line is longer than {MAX_LINE_BYTES:,} bytes, the limit of one "
                             "trace line (trace_format.MAX_LINE_BYTES); split the request or check the file")
        yield no, raw


MAX_INT_DIGITS = 24  # a token id, a count or an arrival in ms needs far fewer; Python refuses past 4,300


def _int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        raise TraceError(f"a number of {len(text.lstrip('-')):,} digits ({text[:12]}...) is no token id, count or "
                         f"time; a trace's integers have at most {MAX_INT_DIGITS} digits")
    return int(text)


def _no_constant(name: str) -> None:
    raise TraceError(f"{name} is not a number a trace may hold (JSON has no {name}); give a finite number")


def loads(raw: bytes | str, where: str) -> object:
    """One JSON value of a trace line; ``TraceError`` naming ``where`` for invalid JSON,
    ``NaN``/``Infinity`` and nesting too deep for the parser."""
    try:
        return json.loads(raw, parse_constant=_no_constant, parse_int=_int)
    except json.JSONDecodeError as e:
        raise TraceError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
    except UnicodeDecodeError as e:
        raise TraceError(f"{where}: not UTF-8 (byte {e.start} of the line); a trace is UTF-8 JSON Lines") from None
    except RecursionError:
        raise TraceError(f"{where}: JSON nested too deeply; a trace line is one flat object") from None
    except TraceError as e:
        raise TraceError(f"{where}: {e}") from None


def _lines(path: str | Path) -> Iterable[tuple[int, str]]:
    """Numbered lines of a UTF-8 file; ``TraceError`` for a missing, unreadable or non-UTF-8 file."""
    try:
        with open_regular(path) as f:
            for no, raw in bounded_lines(f, path):
                try:
                    yield no, raw.decode("utf-8")
                except UnicodeDecodeError as e:
                    raise TraceError(f"{path}:{no}: not UTF-8 (byte {e.start} of the line); a trace is "
                                     "UTF-8 JSON Lines") from None
    except FileNotFoundError:
        raise TraceError(f"trace {str(path)!r} does not exist; give the path of a JSONL trace, or no "
                         "path for the built-in one") from None
    except IsADirectoryError:
        raise TraceError(f"trace {str(path)!r} is a directory; give the path of a JSONL trace file") from None
    except OSError as e:
        raise TraceError(f"trace {str(path)!r} cannot be read ({e.strerror})") from None


def read_trace(path: str | Path) -> Trace:
    """Parse and validate a trace file; ``TraceError`` names the line number and field."""
    requests: list[TraceRequest] = []
    header = None
    for no, line in _lines(path):
        where = f"{path}:{no}"
        if not line.strip():
            continue
        obj = loads(line, where)
        if header is None:
            header = _header(obj, where)
            continue
        requests.append(request_from_json(obj, header.vocab, where))
    if header is None:
        raise TraceError(f"{path}: empty file; a trace starts with a header line "
                         f'{{"hicache_trace": {TRACE_VERSION}, "name": ..., "vocab": ...}}')
    check_requests(requests, header.vocab, where=str(path))
    return header._replace(requests=requests)


def _header(obj: object, where: str) -> Trace:
    if not isinstance(obj, dict) or "hicache_trace" not in obj:
        raise TraceError(f"{where}: the first line must be the header "
                         f'{{"hicache_trace": {TRACE_VERSION}, "name": ..., "vocab": ...}}')
    if obj["hicache_trace"] != TRACE_VERSION:
        raise _field_error(where, "hicache_trace", f"this reader understands version {TRACE_VERSION}",
                           obj["hicache_trace"])
    unknown = sorted(set(obj) - {"hicache_trace", "name", "vocab"})
    if unknown:
        raise TraceError(f"{where}: unknown header field(s) {unknown}")
    name, vocab = obj.get("name", ""), obj.get("vocab")
    if not isinstance(name, str) or not _is_unicode(name):
        raise _field_error(where, "name", "expected a string of valid Unicode", name)
    if not isinstance(vocab, int) or isinstance(vocab, bool) or not 1 <= vocab <= MAX_VOCAB:
        raise _field_error(where, "vocab", f"expected an integer in [1, {MAX_VOCAB}] (the model's "
                           "vocabulary size)", vocab)
    return Trace(name, vocab, [])


# ------------------------------------------------------------------ resolution
class PromptResolver:
    """Turns follow-up requests into full prompts during a replay.

    ``prompt(req)`` returns the request's full prompt; ``finish(req, generated)``
    records its full sequence for its follow-ups. A sequence is dropped once
    its last follow-up (counted from ``requests``) has been resolved, so memory
    stays proportional to the conversations in flight. Mutates only itself.
    """

    def __init__(self, requests: Iterable[TraceRequest]):
        self._children: dict[str, int] = {}
        for r in requests:
            if r.parent is not None:
                self._children[r.parent] = self._children.get(r.parent, 0) + 1
        self._seq: dict[str, list[int]] = {}

    def ready(self, req: TraceRequest) -> bool:
        """Whether ``prompt(req)`` can be resolved now (root, or parent finished)."""
        return req.parent is None or req.parent in self._seq

    def prompt(self, req: TraceRequest) -> list[int]:
        """The full prompt; a fresh list. Raises ``TraceError`` if the parent has not finished."""
        if req.parent is None:
            return list(req.prompt)
        if req.parent not in self._seq:
            raise TraceError(f"request {req.rid!r}: parent {req.parent!r} has not finished (or was "
                             "already consumed by all its follow-ups); start follow-ups after their parent")
        out = self._seq[req.parent] + list(req.append)
        left = self._children[req.parent] - 1
        if left:
            self._children[req.parent] = left
        else:
            del self._children[req.parent], self._seq[req.parent]
        return out

    def finish(self, req: TraceRequest, prompt: Sequence[int], generated: Sequence[int]) -> None:
        """Record ``prompt + generated`` as ``req``'s full sequence if a follow-up needs it."""
        if self._children.get(req.rid):
            self._seq[req.rid] = list(prompt) + list(generated)

    def check_integrity(self) -> None:
        stray = set(self._seq) - set(self._children)
        if stray:
            raise IntegrityError(f"sequences kept with no follow-up left: {sorted(stray)}")
        if any(n <= 0 for n in self._children.values()):
            raise IntegrityError(f"follow-up counts must be positive: {self._children}")
