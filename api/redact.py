"""Secrets out of what the REST API shows: URL passwords and the admin token."""
from __future__ import annotations

import re
from typing import Any

from hicache.config import HiCacheConfig

REDACTED = "***"


# Query options that carry secrets: redis-py takes ``?password=`` (and
# ``ssl_password=``) from the query string as readily as from the userinfo.
_SECRET_QUERY = re.compile(r"([?&][^=&#]*(?:pass|secret|token)[^=&#]*=)[^&#]*", re.IGNORECASE)


def redact_url(url: str) -> str:
    """``scheme://user:***@host...?password=***`` for a URL carrying a password
    (userinfo or query option); other URLs unchanged."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return url
    rest = _SECRET_QUERY.sub(rf"\1{REDACTED}", rest)
    userinfo, at, hosts = rest.rpartition("@")
    if not at or ":" not in userinfo:
        return f"{scheme}{sep}{rest}"
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
