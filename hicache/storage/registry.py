"""Backends registered by URL scheme, and ``open_storage``.

A registry is an ordinary object: ``default_registry()`` builds a fresh one
with the built-in schemes plus any installed plugin (entry point group
``hicache.storage``, each entry a factory with the ``BackendFactory``
signature). Add a backend with ``registry.register("s3", factory)`` and pass
``registry=`` to ``open_storage``; nothing is kept in module state.
"""
from __future__ import annotations
import importlib
import logging
from importlib.metadata import entry_points
from typing import Any, Callable
from hicache.core.errors import ConfigError
from hicache.core.layout import KVLayout
from hicache.core.redact import error_text, redact_url
from hicache.storage.base import StorageBackend
from hicache.storage.capacity import StorageOptions
from hicache.storage.file import FileBackend
from hicache.storage.memory import MemoryBackend


log = logging.getLogger(__name__)

# factory(url, options, **backend_opts) -> StorageBackend; raises ConfigError on a bad URL/option.
BackendFactory = Callable[..., StorageBackend]

ENTRY_POINT_GROUP = "hicache.storage"


class StorageRegistry:
    """Maps URL schemes (``redis``, ``file``, ...) to backend factories."""

    def __init__(self) -> None:
        self._factories: dict[str, BackendFactory] = {}

    def register(self, scheme: str, factory: BackendFactory, *, replace: bool = False) -> None:
        """Make ``scheme://...`` URLs open with ``factory``. Mutates this registry."""
        scheme = scheme.lower()
        if not scheme or "://" in scheme:
            raise ConfigError(f"storage scheme {scheme!r}: give the bare scheme, e.g. 'memory'")
        if scheme in self._factories and not replace:
            raise ConfigError(f"storage scheme {scheme!r} is already registered; pass replace=True")
        self._factories[scheme] = factory

    def schemes(self) -> list[str]:
        return sorted(self._factories)

    def open(self, url: str, *, fingerprint: str, timeout_ms: int = 50, max_retries: int = 2,
             key_prefix: str | bytes = b"", probe_max_ms: int = 1000, layout: KVLayout | None = None,
             auth_key: str | bytes = b"", **opts: Any) -> StorageBackend:
        """See ``open_storage``."""
        scheme, sep, _ = url.partition("://")
        if not sep:
            raise ConfigError(f"storage url {redact_url(url)!r}: expected scheme://..., one of "
                              f"{', '.join(s + '://' for s in self.schemes())}")
        factory = self._factories.get(scheme.lower())
        if factory is None:
            raise ConfigError(f"storage url scheme {scheme!r} is not registered; known: "
                              f"{', '.join(self.schemes())}")
        options = StorageOptions(fingerprint=fingerprint, timeout_ms=timeout_ms, max_retries=max_retries,
                                 key_prefix=key_prefix, probe_max_ms=probe_max_ms, layout=layout,
                                 auth_key=auth_key)
        try:
            return factory(url, options, **opts)
        except TypeError as e:
            if "unexpected keyword argument" not in str(e):
                raise
            raise ConfigError(f"storage url {scheme}://...: bad option(s) {sorted(opts)}: {e}") from None
        except ConfigError as e:  # whatever a backend (a plugin too) quoted of the URL, minus its secrets
            shown = error_text(e, url).removeprefix(f"{type(e).__name__}: ")
            if shown == str(e):
                raise
            raise type(e)(shown) from None


def _lazy_factory(target: str, needs: str = "") -> BackendFactory:
    """The factory of the backend class ``"module:Class"``, imported when a URL of its
    scheme is opened (as an entry point is): the core library and the memory/file
    backends work where redis-py is not installed, and the registry never imports
    the service client that ``hicache+unix://`` is built on (no import ring through
    ``hicache.storage``). ``needs``: what to install when the import fails."""
    module, _, cls_name = target.partition(":")

    def factory(url: str, options: StorageOptions, **opts: Any) -> StorageBackend:
        try:
            mod = importlib.import_module(module)
        except ImportError as e:
            if not needs:
                raise
            raise ConfigError(f"storage url {url.split('://')[0]}://... needs {needs} ({e})") from None
        return getattr(mod, cls_name).from_url(url, options, **opts)
    return factory


_REDIS_PY = "redis-py: pip install 'redis[hiredis]>=5.0'"


def default_registry() -> StorageRegistry:
    """A new registry with memory, file, redis, rediss, redis+cluster, rediss+cluster,
    hicache+unix (the node-local service) and plugins."""
    reg = StorageRegistry()
    reg.register("memory", MemoryBackend.from_url)
    reg.register("file", FileBackend.from_url)
    for s in ("redis", "rediss"):
        reg.register(s, _lazy_factory("hicache.storage.redis_backend:RedisBackend", _REDIS_PY))
        reg.register(s + "+cluster", _lazy_factory("hicache.storage.redis_backend:RedisClusterBackend", _REDIS_PY))
    reg.register("hicache+unix", _lazy_factory("hicache.storage.service:ServiceBackend"))
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        reg.register(ep.name, ep.load(), replace=True)
        log.info("L3 backend plugin %r from %s", ep.name, ep.value)
    return reg


def open_storage(url: str, *, fingerprint: str, timeout_ms: int = 50, max_retries: int = 2,
                 registry: StorageRegistry | None = None, **opts: Any) -> StorageBackend:
    """Open the L3 backend named by ``url`` for one layout.

    ``fingerprint`` is ``KVLayout.fingerprint()``; it is written into every
    object and checked on every read. Common options: ``key_prefix``
    (default ``"hicache:" + fingerprint[:8] + ":"``), ``probe_max_ms``
    (longest wait between probes while L3 is down), ``layout`` (the whole
    ``KVLayout``; needed by ``hicache+unix://``). Backend options:
    ``memory://`` ``max_bytes``; ``file://`` ``fsync``; ``redis://``
    redis-py ConnectionPool keywords (e.g. ``max_connections``);
    ``redis+cluster://`` RedisCluster keywords. Does not connect (except
    ``hicache+unix://``, which handshakes so that a layout the service
    refuses raises ``ContractMismatch`` here): an unreachable server makes
    the first calls miss, never this one raise.
    Raises ``ConfigError`` for a bad URL or option.
    """
    reg = registry if registry is not None else default_registry()
    return reg.open(url, fingerprint=fingerprint, timeout_ms=timeout_ms, max_retries=max_retries, **opts)
