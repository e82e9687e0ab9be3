"""An engine process for the service tests: ``python engine_worker.py MODE JSON``.

Modes (JSON carries ``socket``, ``layout`` and the mode's fields):

* ``write``: reserve pages for ``tokens``' page hashes, fill them with
  ``payload(seed, i)``, commit (with ``draft_pages`` when given); prints
  ``{"pages", "inserted", "duplicates"}``.
* ``read``: look up ``tokens``, acquire, read, release; prints ``{"num_pages",
  "pages", "data"}`` (hex of each page).
* ``hold``: commit ``tokens``, reserve ``reserve`` more pages, acquire the
  committed ones, print ``{"held": ...}`` and sleep until killed.
"""
from __future__ import annotations

import hashlib
import json
import sys
import time

from hicache.client.link import ServiceClient
from hicache.core.hashing import page_hashes
from hicache.core.layout import KVLayout


def payload(seed: int, i: int, nbytes: int) -> bytes:
    """Deterministic page bytes, different for every (seed, page index)."""
    block = hashlib.blake2b(f"{seed}/{i}".encode(), digest_size=64).digest()
    return (block * (nbytes // 64 + 1))[:nbytes]


def main(mode: str, args: dict) -> dict:
    layout = KVLayout.from_dict(args["layout"])
    hashes = page_hashes(args["tokens"], layout.page_size)
    with ServiceClient(args["socket"], layout) as c:
        if mode == "write":
            pages = c.reserve(len(hashes))
            for i, p in enumerate(pages):
                c.pool.write_page(p, payload(args["seed"], i, layout.page_bytes))
            r = c.commit(hashes, pages, draft_pages=args.get("draft_pages"))
            return {"pages": pages, "inserted": r.inserted, "duplicates": r.duplicates}
        if mode == "read":
            n = c.lookup(hashes, need_draft=args.get("need_draft", False)).num_pages
            pages = c.acquire(hashes[:n])
            data = [c.pool.read_page(p).hex() for p in pages]
            c.release(hashes[:len(pages)])
            return {"num_pages": n, "pages": pages, "data": data}
        assert mode == "hold", mode
        pages = c.reserve(len(hashes))
        for i, p in enumerate(pages):
            c.pool.write_page(p, payload(0, i, layout.page_bytes))
        c.commit(hashes, pages)
        reserved = c.reserve(args["reserve"])
        acquired = c.acquire(hashes)
        print(json.dumps({"held": {"reserved": reserved, "acquired": acquired}}), flush=True)
        time.sleep(600)
        return {}


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], json.loads(sys.argv[2]))), flush=True)
