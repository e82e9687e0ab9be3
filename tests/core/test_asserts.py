"""Every ``assert`` left in hicache/, api/ and kernels/ states an internal invariant.

``python -O`` strips asserts, so a check on input (a caller's argument, bytes
from a socket, a backend's answer) must raise a typed error from
``hicache.core.errors`` instead. The asserts that remain are listed in ``ALLOWED``
with why each is internal; a new one fails ``test_every_assert_is_allowed``
until it is listed or turned into a typed error.

Run ``python tests/core/test_asserts.py`` to print them all.
"""
from __future__ import annotations

import ast
import pathlib
import subprocess
import sys
import textwrap

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGES = ("hicache", "api", "kernels")

# (file, asserted expression as ast.unparse writes it) -> why it is an internal invariant.
ALLOWED: dict[tuple[str, str], str] = {
    ("hicache/client/link.py", "self._sock is not None"): "type narrowing after the connect() that sets it",
    ("hicache/node/ops.py", "r.done is not None"): "type narrowing: set by the round that was just awaited",
    ("hicache/reference/model.py", "slots.host is not None"): "type narrowing: sdpa builds host slot ids",
    ("hicache/reference/model.py", "out is not None"): "start_pos < n is checked above (InvalidArgument)",
    ("hicache/reference/workloads.py", "isinstance(docs, DocumentQAWorkload)"): "type narrowing of the SCALES table",
    ("hicache/cache/handoff.py", "ticket.slot is not None"): "type narrowing of a ticket this module issued",
    ("hicache/integrations/sglang.py", "per * n_keys == len(ptrs)"): "pointer list built two lines above",
    ("hicache/integrations/sglang_pools.py", "per * n_keys == len(ptrs)"):
        "SGLang's get_page_buffer_meta returns the same pointers per key (host indices checked above)",
    ("hicache/reference/model_hybrid.py", "self._swa is not None"):
        "type narrowing: the split-pool path runs only when an SWA pool is attached",
    ("hicache/node/l2_segment.py", "shm.tensor is not None and shm.size >= geo.size"): "segment just created/mapped",
    ("hicache/node/l2_segment.py", "orphan.tensor is not None"): "type narrowing of a segment just mapped",
    ("hicache/node/l2_segment.py", "shm.tensor is not None"): "type narrowing of a segment just mapped",
    ("hicache/memory/pools.py", "off % esz == 0 and stride % esz == 0 and (self.buffer.numel() % esz == 0)"):
        "the pool laid out its own buffer; KVLayout validated the geometry (LayoutError)",
    ("hicache/client/protocol.py", "kind in ERROR_KINDS"): "kinds are literals in the server's own code",
    ("hicache/node/l2_index.py", "not self._owners and self.allocator.num_used == 0"):
        "restore() is called once, by NodeServer, on the index it just built",
    ("hicache/cache/slots.py", "s.owner is None and (not s.written)"): "free-list invariant (check_integrity covers it)",
    ("hicache/node/ops.py", "not isinstance(op, str) or op not in ASYNC_OPS"): "dispatch table routing in this module",
    ("hicache/node/server.py", "self.dispatcher is not None and self.index is not None"):
        "clients are served only after _open_state",
    ("hicache/node/server.py", "self.dispatcher is not None"): "connections are accepted only after _open_state",
    ("hicache/node/server.py", "d is not None"): "_open_state sets index and dispatcher together",
    ("hicache/node/server.py", "self._events is not None"): "_open_state builds the index and the event log together",
    ("hicache/node/server.py", "self._loop is not None and self._stop is not None"): "_main sets both before on_ready",
    ("api/stats.py", "state.storage is not None"): "type narrowing: the L3 stats were read from it above",
    ("kernels/plan.py", "anchor % ALIGN == 0"): "torch allocations are 256-byte aligned",
    ("kernels/plan.py", "self.max_chunk_bytes <= self.tile_bytes and self.num_warps >= 1"):
        "TileConfig values are tuned constants in kernels/, not user input",
    ("kernels/plan.py", "v >= ALIGN and v & v - 1 == 0"): "TileConfig values are tuned constants in kernels/",
}


def found_asserts() -> list[tuple[str, int, str]]:
    """(file, line, expression) of every assert statement under ``PACKAGES``."""
    out = []
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            for node in ast.walk(ast.parse(path.read_text(), rel)):
                if isinstance(node, ast.Assert):
                    out.append((rel, node.lineno, ast.unparse(node.test)))
    return sorted(out)


def test_every_assert_is_allowed():
    unlisted = [f"{f}:{line}: assert {e}" for f, line, e in found_asserts() if (f, e) not in ALLOWED]
    assert not unlisted, ("asserts vanish under python -O; raise a typed error from hicache.core.errors, or add "
                          "an internal invariant to ALLOWED with its reason:\n" + "\n".join(unlisted))


def test_every_allowed_assert_carries_context():
    # An internal invariant still says what broke: a message, or an expression that names the values.
    bare = []
    for pkg in ("hicache/client/protocol.py", "hicache/cache/slots.py", "hicache/storage", "hicache/reference", "hicache/node/server.py",
                "api/deps.py", "api/app.py", "api/events.py", "hicache/node/snapshot.py"):
        for path in sorted((ROOT / pkg).rglob("*.py")) if (ROOT / pkg).is_dir() else [ROOT / pkg]:
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Assert) and node.msg is None:
                    bare.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert bare == []


# Bad input on a boundary, run with asserts stripped: each still raises its typed error.
_UNDER_O = textwrap.dedent("""
    import sys
    assert False, "asserts are on: -O did not take effect"
    print("optimize", sys.flags.optimize)
    from hicache.core.errors import InvalidArgument, ServiceError
    from hicache.client.protocol import body_length
    from hicache.api.events import EventBus
    from hicache.node.server import NodeServer
    from hicache.core.config import HiCacheConfig
    from hicache.core.redact import LogLimiter

    def expect(kind, fn, *args, **kw):
        try:
            fn(*args, **kw)
        except kind as e:
            print(f"{type(e).__name__}: {e}")
        else:
            print(f"NO ERROR from {fn.__qualname__}")

    expect(ServiceError, body_length, b"\\x00\\x01", 1024)
    expect(InvalidArgument, EventBus().subscribe, 0)
    expect(InvalidArgument, LogLimiter, None, burst=0)
    cfg = HiCacheConfig.load(None, {"model.num_layers": "2", "model.num_kv_heads": "1", "model.head_dim": "4",
                                    "model.page_size": "4", "pool.host_pages": "4"}, env={})
    expect(ServiceError, NodeServer(cfg).stats)
""")


def test_boundary_checks_survive_python_O():
    r = subprocess.run([sys.executable, "-O", "-c", _UNDER_O], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == [
        "optimize 1",
        "ServiceError: [bad_frame] frame header must be 4 bytes, got 2",
        "InvalidArgument: subscription queue size must be >= 1, got maxsize=0",
        "InvalidArgument: LogLimiter needs burst >= 1, interval_s > 0, max_keys >= 1; got burst=0, "
        "interval_s=60.0, max_keys=1024",
        "ServiceError: [not_serving] engine server is not serving: start() it first (or it was stopped)",
    ], r.stdout + r.stderr


if __name__ == "__main__":
    for f, line, e in found_asserts():
        print(f"{f}:{line}: assert {e}    # {ALLOWED.get((f, e), 'NOT ALLOWED: make it a typed error')}")
