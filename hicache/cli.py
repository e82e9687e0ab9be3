"""The hicache command line: info (the default), replay, serve.

Building the parser, --help, info and argument errors import neither torch
nor the service stack; each subcommand imports what it runs.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from importlib import metadata
from pathlib import Path

from hicache.core.config import DEFAULT_SOCKET_PATH, HiCacheConfig, host_memory, parse_set_flags
from hicache.core.errors import HiCacheError
from hicache.core.redact import Redactor, install_log_redaction


def process_age_s() -> float | None:
    """Seconds since this process started (the kernel's start time, so interpreter
    start-up and imports count), or None where ``/proc`` does not say (not Linux).
    Resolution: one clock tick (10 ms); never less than the true age."""
    try:
        with open("/proc/self/stat") as f:
            after_comm = f.read().rsplit(")", 1)[1].split()  # the command name may hold spaces
        start_s = int(after_comm[19]) / os.sysconf("SC_CLK_TCK")  # field 22, starttime since boot
        return time.clock_gettime(time.CLOCK_BOOTTIME) - start_s
    except (OSError, ValueError, IndexError, AttributeError):
        return None


DESCRIPTION = """\
hicache: a page-granular tiered KV cache (GPU L1 / host L2 / shared L3) for LLM engines.

  hicache info      print the resolved configuration and pool sizes (the default)
  hicache replay    replay a trace through the reference engine and compare caches
  hicache serve     run the node-local service (REST API + engine socket)
  hicache storage   size, list, clear and check L3 (du, ls, clear, fsck)

--config and --set may stand before or after the subcommand."""

SERVE_DESCRIPTION = f"""\
Run the node-local service until Ctrl-C or SIGTERM: it owns this node's L2 (a
shared-memory segment) and its L3 client, serves engines on a Unix socket and
serves REST (health, statistics, Prometheus metrics, lookup, events, flush;
Swagger UI at /docs). On start it prints one line with its addresses.

Where it listens and what it holds are configuration settings (--set KEY=VALUE,
HICACHE_<SECTION>__<KEY>, or the TOML file):
  service.host, service.port   REST address (default 127.0.0.1:8177; beyond
                               loopback needs service.admin_token[_file])
  service.socket_path          engine socket (default {DEFAULT_SOCKET_PATH})
  service.shm_name             name of the shared-memory L2 segment
  pool.host_pages              L2 capacity in pages
  storage.url                  L3 (redis://, file:///dir, memory://, '' for none)
  model.*                      the KV layout engines must share with the service
Example: hicache serve --set service.port=9000 --set storage.url=redis://127.0.0.1:6379/0"""


def _add_config_options(p: argparse.ArgumentParser, *, top: bool) -> None:
    # The top-level copies write to other names so that a subcommand's own
    # defaults never overwrite what was given before the subcommand.
    suffix = "_top" if top else ""
    p.add_argument("--config", dest="config" + suffix, metavar="FILE",
                   help="TOML configuration file (else $HICACHE_CONFIG)")
    p.add_argument("--set", dest="set" + suffix, action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override one configuration value, e.g. --set pool.device_pages=32; repeatable")


def _replay_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("trace", nargs="?", help="JSONL trace (default: the built-in mixed trace); "
                                            "format: docs/traces.md")
    p.add_argument("--json", metavar="PATH", help="write the full report as JSON")
    p.add_argument("--plot", metavar="PATH",
                   help="write a PNG of hit rate and tier occupancy per request admitted")
    p.add_argument("--no-baselines", action="store_true", help="skip the L1-only / infinite-cache replays")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--scale", default="small", choices=("tiny", "small", "medium"),
                   help="size of the built-in trace (ignored with TRACE)")
    p.add_argument("--service", metavar="SOCKET",
                   help="service mode: the node's running hicache service (its engine socket, an absolute "
                        "path) is L2 (its shared segment) and, behind it, L3: storage.url becomes "
                        "hicache+unix://SOCKET and the KV layout takes the configured model.model_id, "
                        "which the service must share")
    hy = p.add_argument_group("hybrid models (--hybrid; docs/hybrid.md)")
    hy.add_argument("--hybrid", metavar="SHAPE", choices=("gpt-oss-120b", "qwen3-next-80b-a3b"),
                    help="no model: replay the trace through a HybridCache at this published hybrid shape and "
                         "print the bytes held against every layer in full, and the hit rate with the floor")
    hy.add_argument("--snapshot-every", type=_at_least(1), default=8, metavar="K",
                    help="--hybrid: a recurrent-state snapshot every K pages (default 8)")
    hy.add_argument("--end-snapshots", action="store_true",
                    help="--hybrid: also snapshot each request's last full page")
    sim = p.add_argument_group("simulation (--simulate; docs/traces.md)")
    sim.add_argument("--simulate", action="store_true",
                     help="no model: the real index, tiers, policies and L3 backend with stand-in payloads, bytes "
                          "accounted at the real size of --shape; capacities are simulate.l1_bytes/l2_bytes/"
                          "l3_bytes (default: one H200, 1 TiB, 16 TiB); reads hash-block traces (hash_ids)")
    sim.add_argument("--shape", help="model shape whose page bytes are accounted (default simulate.shape, "
                                     "llama-3.1-8b)")
    sim.add_argument("--block-tokens", type=_at_least(1), default=None,
                     help="tokens per hash id of a hash-block trace (default simulate.block_tokens, 512)")
    sim.add_argument("--sweep", action="store_true",
                     help="hit rate against L1/L2/L3 capacity: a table and a PNG (--plot, default "
                          "hicache-sweep.png) with the working set marked")
    sim.add_argument("--policies", help="compare eviction policies (comma-separated, or 'all'; lru is always "
                                        "included): each at each --capacities, GPU-only and L1+L2, with its "
                                        "rank, Belady and the share of the LRU->Belady gap it closes")
    sim.add_argument("--capacities", metavar="LIST",
                     help="--policies / --utilisation: cache capacities in tokens (default 0.25M,0.5M,1M,2M,5M,"
                          "10M,20M / 0.5M,2M)")
    sim.add_argument("--utilisation", metavar="LIST",
                     help="serve the trace through a waiting queue at these prefill utilisations (e.g. "
                          "0.5,0.8,0.95): hit rate and TTFT of LRU, LRU with the waiting requests' pages "
                          "protected, and Belady, per --capacities")
    sim.add_argument("--limit", type=_at_least(1), help="only the first N requests of the trace")
    sim.add_argument("--wide", action="store_true", help="--simulate: every column (L2 read, L2 used, L3 "
                                                         "stored) and whole run names; the default fits 100 columns")


def _at_least(low: int):
    """An argparse type: an integer >= ``low``, else argparse's usage error naming the value."""
    def parse(text: str) -> int:
        try:
            n = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if n < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, got {n}")
        return n
    return parse


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hicache", description=DESCRIPTION,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_config_options(p, top=True)
    sub = p.add_subparsers(dest="cmd", metavar="{info,replay,serve,storage}")
    info = sub.add_parser("info", help="print the resolved configuration and pool sizes",
                          description="Print the resolved configuration, the KV layout and the pool sizes as JSON.")
    _add_config_options(info, top=False)
    info.set_defaults(fn=cmd_info)
    rp = sub.add_parser("replay", help="replay a trace through the reference engine and compare caches",
                        description="Replay a trace through the reference engine on the configured tiers, then "
                                    "the same token streams under an L1-only cache and an infinite cache; print "
                                    "per-tier hits, recomputed tokens and bytes moved.")
    _add_config_options(rp, top=False)
    _replay_arguments(rp)
    rp.set_defaults(fn=cmd_replay)
    srv = sub.add_parser("serve", help="run the node-local service: REST API + engine socket",
                         description=SERVE_DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_config_options(srv, top=False)
    srv.set_defaults(fn=cmd_serve)
    from hicache.storage import admin_cli
    admin_cli.add_parser(sub, _add_config_options).set_defaults(fn=cmd_storage)
    return p


def _load(args: argparse.Namespace) -> HiCacheConfig:
    config = getattr(args, "config", None) or args.config_top
    sets = [*args.set_top, *getattr(args, "set", [])]  # after the subcommand wins
    cfg = HiCacheConfig.load(config, parse_set_flags(sets))
    red: Redactor = args.redactor
    red.add_config_data(cfg.model_dump())
    logging.basicConfig(level=cfg.log_level, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    install_log_redaction(red)
    return cfg


def describe_device(setting: str) -> str:
    """``pool.device`` as it will resolve, without importing torch: ``auto``
    is cuda:0 when torch is a CUDA build and an NVIDIA device is present."""
    if setting != "auto":
        return setting
    if "torch" in sys.modules:
        return "cuda:0" if sys.modules["torch"].cuda.is_available() else "cpu"
    try:
        build = metadata.version("torch")
    except metadata.PackageNotFoundError:
        return "cpu (torch is not installed)"
    if "+cpu" in build or not Path("/dev/nvidiactl").exists():
        return "cpu"
    return "cuda:0"


def cmd_info(args: argparse.Namespace) -> int:
    from hicache.runtime_check import check_runtime
    from hicache.core.redact import redact_url  # torch-free
    from hicache.index.eviction import describe_policies
    cfg = _load(args)
    check_runtime(cfg)  # what replay and serve would refuse at start (auth_key, L3 URL)
    layout = cfg.layout()
    dev_bytes = layout.page_bytes * cfg.pool.device_pages
    host_bytes = layout.host_addressing(cfg.pool.host_pages)[2]
    info = {
        "config": cfg.model_dump(mode="json"),
        "layout": {"fingerprint": layout.fingerprint(), "planes": len(layout.planes),
                   "page_bytes": layout.page_bytes, "token_bytes": layout.token_bytes},
        "pools": {"device": describe_device(cfg.pool.device),
                  "L1": {"pages": cfg.pool.device_pages, "tokens": cfg.pool.device_pages * layout.page_size,
                         "bytes": dev_bytes},
                  "L2": {"pages": cfg.pool.host_pages, "tokens": cfg.pool.host_pages * layout.page_size,
                         "bytes": host_bytes},
                  "L3": redact_url(cfg.storage.url) or "(none)", **_l3_cap(cfg)},
        "eviction": describe_policies(cfg.policy.device_eviction, cfg.policy.host_eviction),
    }
    warnings = _ram_warnings(info["pools"])
    if warnings:
        info["warnings"] = warnings
    print(json.dumps(args.redactor.value(info), indent=2, default=str))
    for w in warnings:
        print(f"hicache: warning: {w}", file=sys.stderr)
    return 0


def _l3_cap(cfg: HiCacheConfig) -> dict[str, object]:
    """``storage.max_bytes`` as it resolves for ``storage.url`` (``auto`` included)."""
    from hicache.storage.capacity import backend_options  # torch-free
    if not cfg.storage.url:
        return {}
    cap = backend_options(cfg.storage).get("max_bytes")
    if cap is None:
        return {"L3_max_bytes": None, "L3_cap": "set by the store itself (Redis: maxmemory)"}
    how = "auto" if cfg.storage.max_bytes == "auto" else "storage.max_bytes"
    return {"L3_max_bytes": cap, "L3_cap": f"{cap / 2**30:.1f} GiB ({how})" if cap else f"unbounded ({how})"}


def physical_memory() -> int | None:
    """This machine's memory in bytes (None where the OS does not say; see ``host_memory``)."""
    have = host_memory()
    return None if have is None else have[0]


def _ram_warnings(pools: dict) -> list[str]:
    """A warning when the pools in host memory (L2, and L1 on the CPU) exceed the RAM."""
    ram = physical_memory()
    host = {"L2": pools["L2"]["bytes"]}
    if pools["device"].startswith("cpu"):
        host["L1 (on the CPU)"] = pools["L1"]["bytes"]
    need = sum(host.values())
    if ram is None or need <= ram:
        return []
    gib = 2**30
    parts = ", ".join(f"{k} {v / gib:,.1f} GiB" for k, v in host.items())
    return [f"the pools in host memory need {need / gib:,.1f} GiB ({parts}), more than this machine's "
            f"{ram / gib:,.1f} GiB of RAM; lower pool.host_pages (or pool.device_pages on the CPU)"]


def cmd_serve(args: argparse.Namespace) -> int:
    # Imported lazily: the core library must not need FastAPI/uvicorn.
    from hicache.api.serve import serve
    return serve(_load(args))


def cmd_storage(args: argparse.Namespace) -> int:
    from hicache.storage import admin_cli
    return admin_cli.run(args, _load(args))


def cmd_replay(args: argparse.Namespace) -> int:
    if args.hybrid:
        from hicache.reference import hybrid_replay
        return hybrid_replay.main(args, _load(args))
    if args.simulate or args.sweep:
        from hicache.reference import sim_report
        return sim_report.main(args, _load(args))
    if args.trace:
        from hicache.reference.hash_trace import detect_format
        if detect_format(args.trace) == "hash_blocks":
            raise HiCacheError(f"{args.trace} is a hash-block trace (hash_ids, no token ids): replay it with "
                               "--simulate")
    from hicache.reference import replay
    return replay.main(args, _load(args))


def main(argv: list[str] | None = None) -> int:
    # Wall times a subcommand prints start at the process's start when this is the
    # program (the `hicache` command), at this call when a caller passes argv.
    started = time.perf_counter() - ((process_age_s() or 0.0) if argv is None else 0.0)
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "fn", None):
        args = parser.parse_args([*argv, "info"])
    args.redactor = Redactor()
    args.started = started
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
