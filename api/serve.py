"""``hicache serve``: the engine socket (``NodeServer``) and the REST API in one process.

The engine server runs its asyncio loop in a thread; uvicorn runs the REST
app in the main thread and handles SIGINT/SIGTERM, after which the engine
server is stopped (socket and shared segment removed) and L3 is closed.
The engine server writes committed pages behind to L3 and serves ``fetch``
from it; ``/v1/events`` carries ``stored`` events for both tiers.
"""
from __future__ import annotations

import logging
import os
import signal
from typing import Any

import uvicorn

from hicache.api.app import create_app
from hicache.api.deps import ADMIN_TOKEN_HELP, RestState, check_bind
from hicache.node.server import NodeServer, open_l3
from hicache.api.events import MAX_SUBSCRIBERS, EventBus
from hicache.api.http_protocol import MAX_HEAD_BYTES, head_guarded
from hicache.node.socket_guard import preflight
from hicache.node.socket_guard import resolve_group
from hicache.core.config import HiCacheConfig, read_secret_file
from hicache.core.errors import ConfigError
from hicache.core.redact import Redactor, install_log_redaction, redact_url


GRACEFUL_SHUTDOWN_S = 3


def resolve_admin_token(cfg: HiCacheConfig) -> str:
    """``service.admin_token``, else the stripped contents of ``service.admin_token_file``, else ""."""
    svc = cfg.service
    if svc.admin_token:
        return svc.admin_token
    if not svc.admin_token_file:
        return ""
    try:
        token = read_secret_file(svc.admin_token_file, "service.admin_token_file").decode().strip()
    except UnicodeDecodeError:
        raise ConfigError(f"service.admin_token_file={svc.admin_token_file!r} is not UTF-8 text; "
                          f"{ADMIN_TOKEN_HELP}") from None
    if not token:
        raise ConfigError(f"service.admin_token_file={svc.admin_token_file!r} is empty; {ADMIN_TOKEN_HELP}")
    return token


class _Stopped(BaseException):
    """Raised by our signal handler once uvicorn has shut down and re-raises the signal."""


def _raise_stopped(signum: int, frame) -> None:
    raise _Stopped(signum)


def start_line(cfg: HiCacheConfig) -> str:
    """The one line ``hicache serve`` prints once it listens (secrets redacted)."""
    svc = cfg.service
    host = f"[{svc.host}]" if ":" in svc.host else svc.host
    return (f"hicache serve: REST http://{host}:{svc.port} (docs /docs), engine socket {svc.socket_path}, "
            f"L2 {cfg.pool.host_pages:,} pages in shared memory '{svc.shm_name}', "
            f"L3 {redact_url(cfg.storage.url) or '(none)'}; pid {os.getpid()}, stop with Ctrl-C or SIGTERM")


KEEP_ALIVE_S = 5  # an idle REST connection is closed after this


def max_waiting(rest_max_connections: int) -> int:
    """Connections that may wait for a request head at once: half of what the event
    streams leave of ``rest_max_connections``, so waiting ones never fill it."""
    return max(4, (rest_max_connections - MAX_SUBSCRIBERS) // 2)


def uvicorn_config(app: Any, cfg: HiCacheConfig) -> uvicorn.Config:
    """The REST server's settings: at most ``service.rest_max_connections`` connections and
    requests at once (503 past it); a request head within ``service.rest_header_timeout_s``
    and ``MAX_HEAD_BYTES``, at most ``max_waiting`` connections waiting for one (the
    oldest is closed past it: ``HeadGuardedH11``); idle keep-alive connections closed
    after ``KEEP_ALIVE_S``."""
    svc = cfg.service
    http = head_guarded(svc.rest_header_timeout_s, max_waiting(svc.rest_max_connections))
    return uvicorn.Config(app, host=svc.host, port=svc.port, log_level=cfg.log_level.lower(), access_log=False,
                          timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S, lifespan="on", http=http,
                          h11_max_incomplete_event_size=MAX_HEAD_BYTES,
                          limit_concurrency=svc.rest_max_connections, timeout_keep_alive=KEEP_ALIVE_S)


class _Server(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, bus: EventBus, ready_line: str):
        super().__init__(config)
        self._bus = bus
        self._ready_line = ready_line

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        if self.started:  # printed only once the REST port is bound (stdout, whatever the log level)
            print(self._ready_line, flush=True)

    def handle_exit(self, sig: int, frame) -> None:
        self._bus.close()  # end event streams now, so shutdown does not wait for their clients
        super().handle_exit(sig, frame)


def _redact_logs(cfg: HiCacheConfig, token: str) -> None:
    """Every handler (ours and uvicorn's) redacts the configured secrets and the resolved token."""
    red = Redactor.from_config(cfg)
    red.add(token)
    install_log_redaction(red)
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        for h in logging.getLogger(name).handlers:
            h.addFilter(red.log_filter())


def serve(cfg: HiCacheConfig) -> int:
    """Run until SIGINT/SIGTERM. Returns the exit status; raises ``ConfigError`` before serving."""
    token = resolve_admin_token(cfg)
    svc = cfg.service
    check_bind(svc.host, token)
    layout = cfg.layout()
    # Socket, segment and port conflicts, all reported at once, before anything starts.
    rest_sock = preflight(svc.host, svc.port, svc.socket_path, svc.shm_name, resolve_group(svc.socket_group))
    try:
        storage = open_l3(cfg, layout)
    except BaseException:
        rest_sock.close()
        raise
    bus = EventBus()
    engine = NodeServer(cfg, layout, storage=storage)  # the app pulls its KV events into bus
    try:
        engine.start()
    except BaseException:
        rest_sock.close()
        if storage is not None:
            storage.close()
        raise
    try:
        state = RestState(config=cfg, layout=layout, engine=engine, storage=storage, admin_token=token, bus=bus)
        app = create_app(state)
        server = _Server(uvicorn_config(app, cfg), bus, start_line(cfg))
        _redact_logs(cfg, token)  # after uvicorn.Config: it installs its own log handlers
        # uvicorn re-raises the signal that stopped it after restoring the handlers
        # it found; ours turn that into _Stopped so the cleanup below runs.
        previous = {sig: signal.signal(sig, _raise_stopped) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            server.run(sockets=[rest_sock])
        except _Stopped:
            pass
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        return 0 if server.started else 1
    finally:
        rest_sock.close()
        bus.close()
        engine.stop()
        if storage is not None:
            storage.close()
