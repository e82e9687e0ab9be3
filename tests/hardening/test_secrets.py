"""No output path prints a secret (issue 17, item 12).

Before the fix: ``hicache info`` printed the Redis password and the admin
token in clear, replay's report header printed the URL, redis-py's URL error
quoted the password (``... as 'Pa55'``), and a URL without ``://`` was echoed
raw with its ``?password=``. ``test_every_output_of_a_run_is_free_of_secrets``
runs every command with secrets configured and greps all that it printed.
"""
from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid

import httpx
import pytest

from hicache.core.errors import ConfigError
from hicache.core.redact import Redactor, redact_url
from hicache.storage import open_storage

PW, PW2, TOKEN = "Pa55wordQx7", "Qpass9Zr", "AdminTokenZz0123456789"
SECRETS = (PW, PW2, TOKEN)


@pytest.mark.parametrize("url,shown", [
    (f"redis://user:{PW}@h:1/0", "redis://user:***@h:1/0"),
    (f"redis://:{PW}@h", "redis://:***@h"),
    (f"redis://user:{PW}", "redis://user:***"),  # @host forgotten: the "port" is the password
    (f"redis://h:1/0?password={PW}&db=2", "redis://h:1/0?password=***&db=2"),
    (f"redis:/user:{PW}@h?password={PW2}", "redis:/user:***@h?password=***"),  # no ://
    ("redis://h:6379/0", "redis://h:6379/0"),
    # issue 27 item 4: an unencoded '/' (or '?', '#') in the password; was "redis://:***/Pa55wordQx7@h:1/0"
    (f"redis://:ab/{PW}@h:1/0", "redis://:***@h:1/0"),
    (f"redis://u:x/y?{PW}#z@h:1/0?db=1", "redis://u:***@h:1/0?db=1"),
    (f"rediss://u:{PW}/@h", "rediss://u:***@h"),
    ("redis://u@h/0", "redis://u@h/0"),
    ("redis+cluster://a:1,b:2", "redis+cluster://a:1,b:2"),
])
def test_redact_url(url, shown):
    assert redact_url(url) == shown


def test_url_errors_do_not_quote_the_password():
    for url in (f"redis://h:1/0?ssl_password={PW}", f"redis://user:{PW}", f"redis:user:{PW}@h?password={PW2}", f"redis://u:{PW}@h/abc",
                f"redis://:ab/{PW}@h:1/0", f"redis://:{PW}/x@h:bad/0"):
        with pytest.raises(ConfigError) as e:
            open_storage(url, fingerprint="f" * 32)
        assert not any(s in str(e.value) for s in SECRETS), str(e.value)


def test_log_filter_redacts_known_secrets(caplog):
    red = Redactor([TOKEN])
    red.add_url(f"redis://u:{PW}@h:1/0")
    log = logging.getLogger("hicache.test.secrets")
    f = red.log_filter()
    log.addFilter(f)
    try:
        with caplog.at_level(logging.INFO, logger="hicache.test.secrets"):
            log.info("token %s and url %s and bare %s", TOKEN, f"redis://u:{PW}@h:1/0", PW)
    finally:
        log.removeFilter(f)
    assert not any(s in caplog.text for s in SECRETS) and caplog.text.count("***") == 3


def _run(args: list[str], env: dict[str, str], timeout: float = 300) -> str:
    p = subprocess.run([sys.executable, "-m", "hicache.cli", *args], capture_output=True, text=True,
                       env=env, timeout=timeout)
    return f"$ hicache {args[0]} -> {p.returncode}\n{p.stdout}{p.stderr}"  # args hold secrets: not echoed


def test_every_output_of_a_run_is_free_of_secrets(tmp_path):
    d = tempfile.mkdtemp(prefix="hcsec")
    with socket_free_port() as port:
        pass
    env = {**os.environ, "HICACHE_STORAGE__URL": f"redis://user:{PW}@127.0.0.1:1/0?password={PW2}",
           "HICACHE_SERVICE__ADMIN_TOKEN": TOKEN, "HICACHE_LOG_LEVEL": "DEBUG",
           "HICACHE_SERVICE__SOCKET_PATH": f"{d}/e.sock", "HICACHE_SERVICE__PORT": str(port),
           "HICACHE_SERVICE__SHM_NAME": f"hicache-sec-{uuid.uuid4().hex[:8]}",
           "HICACHE_MODEL__NUM_LAYERS": "2", "HICACHE_POOL__HOST_PAGES": "64"}
    out = [_run(["info"], env)]
    out.append(_run(["replay", "--quiet", "--scale", "tiny", "--no-baselines", "--json", str(tmp_path / "r.json")],
                    env))
    out.append((tmp_path / "r.json").read_text())
    for bad in (f"redis://h:1/0?ssl_password={PW}", f"redis://user:{PW}", f"redis:user:{PW}@h?password={PW2}", f"redis://u:{PW}@h/abc",
                f"redis://:ab/{PW}@h:1/0", f"redis://:{PW}/x@h:bad/0"):
        out.append(_run(["replay", "--quiet", "--scale", "tiny", "--set", f"storage.url={bad}"], env))
    out.append(_run(["info", "--set", "pool.host_pages=zero"], env))
    # serve: its log at DEBUG, and every REST route with and without the token
    proc = subprocess.Popen([sys.executable, "-m", "hicache.cli", "serve"], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        for _ in range(300):
            try:
                if httpx.get(url + "/healthz", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.1)
        auth = {"Authorization": f"Bearer {TOKEN}"}
        for path in ("/healthz", "/readyz", "/v1/stats", "/metrics", "/v1/config", "/openapi.json"):
            out.append(httpx.get(url + path, timeout=10).text)
            out.append(httpx.get(url + path, headers=auth, timeout=10).text)
        out.append(httpx.post(url + "/v1/lookup", json={"tokens": list(range(64)), "include_l3": True},
                              timeout=10).text)
        out.append(httpx.post(url + "/v1/flush", json={"tier": "all"}, headers=auth, timeout=10).text)
    finally:
        proc.send_signal(signal.SIGTERM)
        out.append(proc.communicate(timeout=30)[0])
    text = "\n".join(out)
    assert "hicache: error:" in text and '"admin_token": "***"' in text  # the runs did print things
    for s in SECRETS:
        assert s not in text, f"secret {s!r} printed:\n" + "\n".join(
            line for line in text.splitlines() if s in line)


class socket_free_port:
    def __enter__(self) -> int:
        import socket
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]

    def __exit__(self, *exc) -> None:
        pass


@pytest.mark.parametrize("url", [
    "hicache+unix://user:S3cretPw@/run/hicache.sock",
    "hicache+unix://user:S3cretPw@run/hicache.sock",
    "memory://user:S3cretPw@host",
])
def test_no_library_error_holds_the_password(url):
    """What vLLM and SGLang print of a ``ConfigError`` from ``open_storage`` (the library,
    not the CLI, which has its own redactor) never holds the URL's password."""
    from hicache.core.errors import ConfigError
    from hicache.storage import open_storage
    with pytest.raises(ConfigError) as e:
        open_storage(url, fingerprint="0f1e2d3c4b5a69788796a5b4c3d2e1f0")
    assert "S3cretPw" not in str(e.value) and "S3cretPw" not in repr(e.value), e.value
