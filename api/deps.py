"""What the REST app is built from (``RestState``) and its FastAPI dependencies.

``create_app(state)`` stores the state on ``app.state.rest``; routes reach it
through ``StateDep`` and never through module globals. Admin routes depend on
``AdminDep``: a Bearer token equal to ``service.admin_token`` is required
whenever one is configured, and ``check_bind`` refuses to serve beyond
loopback without one.
"""
from __future__ import annotations

import hmac
import ipaddress
from typing import Annotated

from fastapi import Depends, HTTPException, Request, status
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from hicache.api.state import RestState
from hicache.core.errors import ConfigError

ADMIN_TOKEN_HELP = ("set service.admin_token (HICACHE_SERVICE__ADMIN_TOKEN, or a file named by "
                    "HICACHE_SERVICE__ADMIN_TOKEN_FILE)")


def is_loopback(host: str) -> bool:
    """True for localhost and loopback addresses; any other name or address is not."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


# A token guessable by brute force protects nothing once the port is reachable.
MIN_ADMIN_TOKEN_CHARS = 16


def check_bind(host: str, admin_token: str) -> None:
    """Raise ``ConfigError`` when ``host`` is beyond loopback without an admin token of at
    least ``MIN_ADMIN_TOKEN_CHARS`` non-blank characters. Never names the token."""
    if is_loopback(host):
        return
    if not admin_token:
        raise ConfigError(f"service.host={host!r} listens beyond loopback, so admin routes need a token: "
                          f"{ADMIN_TOKEN_HELP}, or bind service.host=127.0.0.1")
    n = sum(not c.isspace() for c in admin_token)
    if n < MIN_ADMIN_TOKEN_CHARS:
        raise ConfigError(f"service.host={host!r} listens beyond loopback and the admin token has only {n} "
                          f"non-blank characters; use at least {MIN_ADMIN_TOKEN_CHARS} (e.g. from "
                          "`python -c 'import secrets; print(secrets.token_urlsafe(24))'`)")


def get_state(request: Request) -> RestState:
    state: RestState = request.app.state.rest  # set by create_app
    return state


StateDep = Annotated[RestState, Depends(get_state)]

_bearer = HTTPBearer(auto_error=False, description="service.admin_token; required for admin routes "
                     "whenever a token is configured (always when listening beyond loopback)")


def require_admin(state: StateDep,
                  creds: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]) -> None:
    token = state.admin_token
    if not token:
        # check_bind refuses this beyond loopback when the app is built; refuse
        # here too, so an app built some other way fails closed.
        host = state.config.service.host
        if not is_loopback(host):
            raise HTTPException(status.HTTP_401_UNAUTHORIZED,
                                detail=f"admin route: service.host={host!r} is beyond loopback and no "
                                       f"service.admin_token is configured; {ADMIN_TOKEN_HELP}",
                                headers={"WWW-Authenticate": "Bearer"})
        return
    given = creds.credentials if creds is not None else ""
    if not hmac.compare_digest(given.encode(), token.encode()):
        raise HTTPException(status.HTTP_401_UNAUTHORIZED,
                            detail="admin route: send 'Authorization: Bearer <service.admin_token>'",
                            headers={"WWW-Authenticate": "Bearer"})


AdminDep = Depends(require_admin)
