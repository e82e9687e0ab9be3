"""``hicache`` command line: ``info`` (default), ``replay``, ``serve``."""
from __future__ import annotations

import argparse
import json
import logging
import sys

from hicache.config import HiCacheConfig, parse_set_flags
from hicache.errors import HiCacheError
from hicache.redact import Redactor, install_log_redaction


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="TOML configuration file (else $HICACHE_CONFIG)")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override one configuration value; repeatable")


def _load(args: argparse.Namespace) -> HiCacheConfig:
    cfg = HiCacheConfig.load(args.config, parse_set_flags(args.set))
    red: Redactor = args.redactor
    red.add_config_data(cfg.model_dump())
    logging.basicConfig(level=cfg.log_level, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    install_log_redaction(red)
    return cfg


def cmd_info(args: argparse.Namespace) -> int:
    from hicache.pools import HostPool
    cfg = _load(args)
    layout = cfg.layout()
    dev_bytes = layout.page_bytes * cfg.pool.device_pages
    host_bytes = HostPool.nbytes_for(layout, cfg.pool.host_pages)
    info = {
        "config": cfg.model_dump(mode="json"),
        "layout": {"fingerprint": layout.fingerprint(), "planes": len(layout.planes),
                   "page_bytes": layout.page_bytes, "token_bytes": layout.token_bytes},
        "pools": {"device": cfg.resolved_device(),
                  "L1": {"pages": cfg.pool.device_pages, "tokens": cfg.pool.device_pages * layout.page_size,
                         "bytes": dev_bytes},
                  "L2": {"pages": cfg.pool.host_pages, "tokens": cfg.pool.host_pages * layout.page_size,
                         "bytes": host_bytes},
                  "L3": cfg.storage.url or "(none)"},
    }
    print(json.dumps(args.redactor.value(info), indent=2, default=str))
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    # Imported lazily: the core library must not need FastAPI/uvicorn.
    from hicache.api.serve import serve
    return serve(_load(args))


def cmd_replay(args: argparse.Namespace) -> int:
    from hicache.engine import replay
    return replay.main(args, _load(args))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hicache", description=__doc__)
    sub = p.add_subparsers(dest="cmd")
    info = sub.add_parser("info", help="print the resolved configuration and pool sizes")
    _common(info)
    info.set_defaults(fn=cmd_info)
    rp = sub.add_parser("replay", help="replay a trace through the reference engine and compare caches")
    _common(rp)
    from hicache.engine.replay import add_arguments
    add_arguments(rp)
    rp.set_defaults(fn=cmd_replay)
    srv = sub.add_parser("serve", help="run the node-local service: REST statistics API + local engine API")
    _common(srv)
    srv.set_defaults(fn=cmd_serve)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "fn", None):
        args = parser.parse_args(["info", *(argv or [])]) if argv is not None else parser.parse_args(["info"])
    args.redactor = Redactor()
    try:
        return args.fn(args)
    except HiCacheError as e:
        return _fail(args.redactor, str(e))
    except MemoryError:
        return _fail(args.redactor, "out of memory while allocating the cache pools; lower "
                     "pool.host_pages / pool.device_pages (see `hicache info` for their sizes)")
    except OSError as e:
        where = f" {e.filename!r}" if e.filename else ""
        return _fail(args.redactor, f"{e.strerror or e}{where}; check the path and its permissions")


def _fail(redactor: Redactor, message: str) -> int:
    print(f"hicache: error: {redactor.text(message)}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
