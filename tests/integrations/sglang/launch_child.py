"""A process of its own for test_launch.py, as SGLang's scheduler is: SGLang's
logging set up from the README's launch line, the backend built from it, a
few operations (hits, a miss, a corrupt and a foreign object, then writes to
a dead L3). Prints the backend's AdapterStats as JSON on its last line.

    python launch_child.py REDIS_URL   (PROMETHEUS_MULTIPROC_DIR set by the caller)
"""
from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).parent))
assert os.environ.get("PROMETHEUS_MULTIPROC_DIR"), "set PROMETHEUS_MULTIPROC_DIR (SGLang's launcher sets it)"

import redis  # noqa: E402
from launch import build, readme_argv, server_args  # noqa: E402
from sglang.srt.managers.cache_controller import PrefetchOperation  # noqa: E402
from sglang.srt.mem_cache.utils import get_storage_hash_str  # noqa: E402
from sglang.srt.utils.common import configure_logger  # noqa: E402

from hicache.integrations.sglang_keys import page_key  # noqa: E402
from hicache.storage import open_storage  # noqa: E402


def main(url: str) -> None:
    args = server_args(readme_argv() + ["--log-level", "info"])
    configure_logger(args, prefix=" TP0")  # what SGLang's scheduler process does first
    c = build(args, url)
    b, host, page = c.storage_backend, c.mem_pool_host, c.page_size
    keys = get_storage_hash_str(list(range(6 * page)), None, page_size=page)
    src, dst = host.alloc(6 * page), host.alloc(6 * page)
    assert c._page_set_zero_copy(keys, src)
    assert b.batch_exists(keys) == 6
    op = PrefetchOperation("r", [])
    assert c._page_get_zero_copy(op, keys[:4], dst[:4 * page]) == 4
    r = redis.Redis.from_url(url)
    full = b.store.key_prefix + page_key(keys[4])
    obj = r.get(full)
    r.setrange(full, len(obj) - 1, bytes([obj[-1] ^ 0xFF]))  # corrupt
    other = open_storage(url, fingerprint=b.layout.replace(num_layers=1).fingerprint(),
                         key_prefix=b.store.key_prefix)  # another layout's object under our key
    assert other.put([(page_key(keys[5]), bytes(other_bytes(b)), other_sizes(b))]) == 1
    other.close()
    assert c._page_get_zero_copy(op, keys[4:5], dst[:page]) == 0
    assert c._page_get_zero_copy(op, keys[5:6], dst[:page]) == 0
    b.store.clear()
    b.store.close()
    b.store = _dead_store(b)
    for i in range(40):  # a dead L3: 40 dropped writes, 5 warning lines
        assert b.batch_set_v1(get_storage_hash_str([10_000 + i] * page, None, page_size=page), src[:page]) == [False]
    print(json.dumps(dataclasses.asdict(b.adapter_stats()) | {"model": args.model_path}))


def other_sizes(b) -> list[int]:
    return [p.page_bytes for p in b.layout.replace(num_layers=1).planes]


def other_bytes(b) -> bytes:
    return bytes(sum(other_sizes(b)))


def _dead_store(b):
    """The backend's store, reopened against a port where nothing listens, counters kept."""
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dead = open_storage(f"redis://127.0.0.1:{port}/0", fingerprint=b.layout.fingerprint(), timeout_ms=20,
                        max_retries=0)
    dead._stats = b.store.stats()  # one store's history, as after an outage
    dead._op_errors = b.store.errors_by_op()
    return dead


if __name__ == "__main__":
    main(sys.argv[1])
