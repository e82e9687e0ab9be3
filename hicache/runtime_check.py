"""Settings that only fail when used, checked without using them (``hicache info``).

``HiCacheConfig.load`` validates each value's type and range; some settings
are only refused when a command acts on them: an ``auth_key`` shorter than
``MIN_AUTH_KEY_BYTES``, an ``auth_key_file`` that cannot be read, an L3 URL
that no backend accepts, an admin token too short (or missing) for a
``service.host`` beyond loopback or an ``admin_token_file`` that cannot be
read. ``hicache replay`` and ``hicache serve`` meet those
as they start; ``check_runtime`` lets ``hicache info`` report the same
errors without connecting anywhere, creating a directory or importing torch.
"""
from __future__ import annotations

from hicache.core.config import HiCacheConfig
from hicache.core.errors import ConfigError

LOOPBACK = ("127.0.0.1", "localhost", "::1")


def check_runtime(cfg: HiCacheConfig) -> None:
    """Raise the ``ConfigError`` that replay or serve would raise at start for ``cfg``'s
    L3 and admin settings. Pure: no connection, no file written (secret files are read)."""
    svc = cfg.service
    if svc.host not in LOOPBACK or svc.admin_token_file:
        # What `hicache serve` checks before binding (imported only then: FastAPI is not light).
        from hicache.api.deps import check_bind
        from hicache.api.serve import resolve_admin_token
        check_bind(svc.host, resolve_admin_token(cfg))
    from hicache.storage.capacity import StorageOptions
    from hicache.storage.registry import default_registry
    st, layout = cfg.storage, cfg.layout()
    # The MAC key, the timeouts and the retry count, as every backend checks them.
    StorageOptions(fingerprint=layout.fingerprint(), timeout_ms=st.timeout_ms, max_retries=st.max_retries,
                   layout=layout, auth_key=st.resolved_auth_key())
    if not st.url:
        return
    scheme, sep, _ = st.url.partition("://")
    scheme = scheme.lower()
    if not sep or scheme.startswith("hicache+") or scheme == "memory":
        if not sep:  # the registry's own message
            default_registry().open(st.url, fingerprint=layout.fingerprint())
        return
    if scheme == "file":  # opening would create the directory: parse only
        from hicache.storage.file import parse_file_url
        parse_file_url(st.url)
        return
    if scheme not in default_registry().schemes():
        raise ConfigError(f"storage url scheme {scheme!r} is not registered; known: "
                          f"{', '.join(default_registry().schemes())}")
    if scheme.startswith("redis"):  # redis-py parses the URL here; it connects on first use only
        from hicache.storage import open_storage
        open_storage(st.url, fingerprint=layout.fingerprint(), layout=layout, timeout_ms=st.timeout_ms,
                     max_retries=st.max_retries, auth_key=st.resolved_auth_key()).close()
