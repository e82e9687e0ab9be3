"""Secrets out of what the REST API shows: URL passwords and the admin token."""
from __future__ import annotations

from typing import Any

from hicache.config import HiCacheConfig

REDACTED = "***"


def redact_url(url: str) -> str:
    """``scheme://user:***@host...`` for a URL carrying a password; other URLs unchanged."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return url
    userinfo, at, hosts = rest.rpartition("@")
    if not at or ":" not in userinfo:
        return url
    return f"{scheme}{sep}{userinfo.split(':', 1)[0]}:{REDACTED}@{hosts}"


def redacted_config(cfg: HiCacheConfig, token_set: bool) -> dict[str, Any]:
    """The configuration as JSON-ready data, secrets replaced by ``***``.

    ``token_set``: an admin token is in force (possibly read from
    ``admin_token_file``); shown as ``***`` so operators can see that it is.
    """
    d = cfg.model_dump(mode="json")
    d["storage"]["url"] = redact_url(d["storage"]["url"])
    if token_set or d["service"]["admin_token"]:
        d["service"]["admin_token"] = REDACTED
    return d
