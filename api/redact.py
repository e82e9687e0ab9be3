"""Secrets out of what the REST API shows: URL passwords, the admin token and
the L3 auth key. The redactor itself is ``hicache.core.redact`` (shared by every
output path); this module shapes the configuration for ``/v1/config``."""
from __future__ import annotations

from typing import Any

from hicache.core.config import HiCacheConfig
from hicache.core.redact import REDACTED, Redactor, redact_url

__all__ = ["REDACTED", "redact_url", "redacted_config"]


def redacted_config(cfg: HiCacheConfig, token_set: bool) -> dict[str, Any]:
    """The configuration as JSON-ready data, secrets replaced by ``***``.

    ``token_set``: an admin token is in force (possibly read from
    ``admin_token_file``); shown as ``***`` so operators can see that it is.
    """
    d = Redactor.from_config(cfg).value(cfg.model_dump(mode="json"))
    d["storage"]["url"] = redact_url(d["storage"]["url"])
    if token_set or d["service"]["admin_token"]:
        d["service"]["admin_token"] = REDACTED
    for key in ("auth_key",):
        if d["storage"].get(key):
            d["storage"][key] = REDACTED
    return d
