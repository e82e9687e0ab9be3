"""``hicache storage du|ls|clear|fsck``: the operator's view of L3 (see ``hicache.storage.admin``).

Imports neither torch nor the service stack (``hicache --help`` stays light).
"""
from __future__ import annotations

import argparse
import json
import re

from hicache.core.errors import ConfigError

DESCRIPTION = """\
Size, list and clear the L3 store (storage.url, or --url), per layout: each KV
layout writes under its own key prefix, hicache:<fingerprint[:8]>: (on file://
the directory hicache-<fingerprint[:8]>). Namespaces (LoRA adapters, cache
salts) are folded into the page hashes, so a store cannot be split by namespace.

  hicache storage du                       objects and bytes per prefix, and the cap
  hicache storage ls --fingerprint 1a2b3c4d --limit 20
  hicache storage clear --fingerprint 1a2b3c4d --yes
  hicache storage clear --yes              every hicache prefix
  hicache storage fsck [--repair]          verify every object; --repair deletes those
                                           that fail and resets a capped directory's ledger

redis:// is walked with SCAN (never KEYS) and cleared with UNLINK; a capped
file:// directory's size ledger is reset after a clear. memory:// lives inside
one process, so from here it is empty."""


def add_parser(sub: argparse._SubParsersAction, add_config_options) -> argparse.ArgumentParser:
    p = sub.add_parser("storage", help="size, list, clear and check L3 (du, ls, clear, fsck)",
                       description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    ops = p.add_subparsers(dest="storage_cmd", metavar="{du,ls,clear,fsck}", required=True)
    for name, help_ in (("du", "objects and bytes per layout prefix, the cap and Redis memory"),
                        ("ls", "list objects: prefix, page hash, bytes, age"),
                        ("clear", "delete objects (every hicache prefix, or one with --fingerprint/--prefix)"),
                        ("fsck", "verify every object (with storage.auth_key: its MAC); --repair fixes")):
        o = ops.add_parser(name, help=help_, description=help_)
        add_config_options(o, top=False)
        o.add_argument("--url", help="the L3 URL (default: storage.url of the configuration)")
        who = o.add_mutually_exclusive_group()
        who.add_argument("--fingerprint", metavar="HEX",
                         help="one layout: its fingerprint (or its first 8 hex digits, as du shows)")
        who.add_argument("--prefix", help="one key prefix exactly, e.g. hicache:1a2b3c4d: (or a custom one)")
        if name == "du":
            o.add_argument("--json", action="store_true", help="print JSON")
        if name == "ls":
            o.add_argument("--limit", type=int, default=50, help="print at most N objects (0: all; default 50)")
        if name == "clear":
            o.add_argument("--yes", action="store_true", help="really delete (without it: say what would go)")
        if name == "fsck":
            o.add_argument("--repair", action="store_true", help="delete failing objects and stale temp files, "
                           "set a capped file:// directory's size ledger to the bytes on disk")
    return p


def selected_prefix(args: argparse.Namespace) -> str | None:
    if args.fingerprint:
        fp = args.fingerprint.lower()
        if not re.fullmatch(r"[0-9a-f]{8,}", fp):
            raise ConfigError(f"--fingerprint {args.fingerprint!r}: give the layout fingerprint's hex digits "
                              "(at least 8, as `hicache storage du` or `hicache info` shows them)")
        return f"hicache:{fp[:8]}:"
    return args.prefix


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def run(args: argparse.Namespace, cfg) -> int:
    """One ``hicache storage`` command; a store's error mid-way becomes one redacted line."""
    from redis.exceptions import RedisClusterException, RedisError
    from hicache.core.errors import StorageError
    from hicache.core.redact import error_text, redact_url
    url = args.url if args.url is not None else cfg.storage.url
    args.redactor.add_url(url)  # --url is no part of cfg: its secrets too are hidden in every error
    try:
        if args.storage_cmd == "fsck":
            from hicache.storage.fsck import run as fsck
            return fsck(url, selected_prefix(args), cfg, args.repair)
        return _run(args, cfg, url)
    except (RedisError, RedisClusterException) as e:
        raise StorageError(f"L3 {redact_url(url)}: {args.storage_cmd} stopped ({error_text(e, url)}); check "
                           "that the server runs and try again") from None


def _run(args: argparse.Namespace, cfg, url: str) -> int:
    from hicache.core.redact import redact_url
    from hicache.storage.admin import RedisStore, open_store
    store = open_store(url, timeout_s=max(1.0, cfg.storage.timeout_ms / 1000), group=cfg.storage.file_group)
    prefix = selected_prefix(args)
    shown = redact_url(url)
    if args.storage_cmd == "du":
        rows = [(r, fp) for r, fp in store.du(prefix) if r.objects]  # a prefix emptied by clear holds nothing
        memory = store.memory() if isinstance(store, RedisStore) else None
        cap = _file_cap(url, cfg) if url.startswith("file:") else None
        if args.json:
            print(json.dumps({"url": shown, "prefixes": [{**r._asdict(), "fingerprint": fp} for r, fp in rows],
                              "objects": sum(r.objects for r, _ in rows), "bytes": sum(r.bytes for r, _ in rows),
                              "cap": cap, "redis": memory}, indent=2))
            return 0
        print(f"L3 {shown}" + (f"  (storage.max_bytes: {_size(cap)}, eviction {cfg.storage.eviction})"
                                if cap else "  (unbounded)" if url.startswith("file:") else ""))
        if memory is not None:
            mm = memory["maxmemory"]
            print(f"redis used_memory {_size(memory['used_memory'])}, maxmemory "
                  f"{_size(mm) if mm else 'unset (grows until the host runs out; set maxmemory)'}, "
                  f"policy {memory['maxmemory_policy']}, keys {memory['keys']}")
        print(f"{'prefix':<24} {'fingerprint':<32} {'objects':>9} {'bytes':>12}")
        for r, fp in rows:  # the full fingerprint, read from an object ('?' when none could be read)
            print(f"{r.prefix:<24} {fp or '?':<32} {r.objects:>9,} {r.bytes:>12,}")
        print(f"{'total':<24} {'':<32} {sum(r.objects for r, _ in rows):>9,} {sum(r.bytes for r, _ in rows):>12,}")
        return 0
    if args.storage_cmd == "ls":
        if args.limit < 0:
            raise ConfigError(f"--limit {args.limit}: must be >= 0 (0: all)")
        print(f"{'prefix':<24} {'page hash':<32} {'bytes':>10} {'age':>10}")
        n = 0
        for o in store.ls(prefix):
            if args.limit and n >= args.limit:
                print(f"... more (first {args.limit}; --limit 0 lists all)")
                break
            age = "" if o.age_s is None else f"{o.age_s:.0f}s"
            print(f"{o.prefix:<24} {o.page_hash:<32} {o.bytes:>10,} {age:>10}")
            n += 1
        return 0
    what = f"prefix {prefix!r}" if prefix else "every hicache prefix"
    if not args.yes:
        rows = store.du(prefix)
        objs, nbytes = sum(r.objects for r, _ in rows), sum(r.bytes for r, _ in rows)
        print(f"would delete {objs:,} objects ({_size(nbytes)}) under {what} of {shown}; add --yes to delete them")
        return 0  # a dry run that worked (2 is for errors)
    done = store.clear(prefix)
    print(f"deleted {done.objects:,} objects ({_size(done.bytes)}) under {what} of {shown}"
          + (f"; left {done.foreign:,} {'files' if url.startswith('file:') else 'keys'} that are no hicache "
             "object alone" if done.foreign else ""))
    return 0


def _file_cap(url: str, cfg) -> int | None:
    """The cap the configuration gives this file:// URL (what a cache opened on it would enforce)."""
    from hicache.storage.capacity import backend_options
    return backend_options(cfg.storage, url).get("max_bytes") or None
