"""A minimal engine for the Compose end-to-end test, run inside the hicache image.

    python probe_engine.py SECONDS FIRST_TOKEN fixed|fresh

It opens the service through its socket as L3 (``hicache+unix://``, the
layout from the container's ``HICACHE_MODEL__*``) and every 0.25 s stores 8
pages with known bytes and reads them back (``prefix_hits`` first, which
makes the service load from its Redis what its L2 lacks). ``fixed``: the same
8 pages, stored in the first round only, so later hits come from the service
(its L2, or its Redis after a restart). ``fresh``: 8 new pages every round.
Prints one JSON line per round: ``t``, ``stored`` (pages stored this round),
``hits`` (pages read back with exactly the bytes stored), ``wrong`` (pages
read back with other bytes: must stay 0), ``down`` (the backend is in an outage).
"""
from __future__ import annotations

import json
import sys
import time

from hicache.core.config import HiCacheConfig
from hicache.core.hashing import page_hashes
from hicache.storage import open_storage

PAGES = 8
SOCKET = "/run/hicache/hicache.sock"


def main(argv: list[str]) -> int:
    seconds, first, mode = float(argv[0]), int(argv[1]), argv[2]
    if mode not in ("fixed", "fresh"):
        sys.exit(f"probe_engine: mode {mode!r}: expected fixed or fresh")
    layout = HiCacheConfig.load().layout()
    sizes = [p.page_bytes for p in layout.planes]
    l3 = open_storage(f"hicache+unix://{SOCKET}", fingerprint=layout.fingerprint(), layout=layout,
                      timeout_ms=200, probe_max_ms=500)
    t0 = time.monotonic()
    rnd = 0
    while time.monotonic() - t0 < seconds:
        if mode == "fresh" or rnd == 0:
            start = first + (rnd if mode == "fresh" else 0) * PAGES * layout.page_size
            hashes = page_hashes(list(range(start, start + PAGES * layout.page_size)), layout.page_size)
            payloads = [bytes([(start // layout.page_size + i) % 251 + 1]) * layout.page_bytes for i in range(PAGES)]
            stored = l3.put(list(zip(hashes, payloads, [sizes] * PAGES)))
        else:
            stored = 0
        l3.prefix_hits(hashes)
        got = l3.get(hashes, sizes)
        hits = sum(g is not None and bytes(g) == p for g, p in zip(got, payloads))
        wrong = sum(g is not None and bytes(g) != p for g, p in zip(got, payloads))
        print(json.dumps({"t": round(time.monotonic() - t0, 2), "stored": stored, "hits": hits,
                          "wrong": wrong, "down": l3.down}), flush=True)
        rnd += 1
        time.sleep(0.25)
    l3.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
