"""Key and token files are regular files of bounded size (issue 36, row 8).

Before the fix ``storage.auth_key_file`` and ``service.admin_token_file`` were
read with no check: a FIFO hung ``hicache info`` forever and ``/dev/zero`` read
until memory ran out. Both now go through ``read_secret_file``: a regular
file of at most ``MAX_SECRET_BYTES``, checked before a byte is read. The CLI
cases run in a child with a memory limit and a timeout, so the old behaviour
fails the test instead of the machine.
"""
from __future__ import annotations

import os
import resource
import subprocess
import sys

import pytest

from hicache.api.serve import resolve_admin_token
from hicache.core import config
from hicache.core.config import HiCacheConfig
from hicache.core.errors import ConfigError

KEYS = ["storage.auth_key_file", "service.admin_token_file"]


def _limit() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))


def _info(setting: str, path: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HICACHE_")}
    return subprocess.run([sys.executable, "-m", "hicache.cli", "info", "--set", f"{setting}={path}",
                           "--set", "storage.url=memory://"], capture_output=True, text=True, timeout=60,
                          preexec_fn=_limit, env=env)


@pytest.fixture
def planted(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    big = tmp_path / "big"
    with open(big, "wb") as f:
        f.truncate(1 << 30)  # sparse: 1 GiB that reads as zeros
    (tmp_path / "dir").mkdir()
    return {"fifo": (str(fifo), "is not a regular file (prw"), "dev_zero": ("/dev/zero", "is not a regular file (crw"),
            "big": (str(big), "holds 1,073,741,824 bytes, more than a secret file may (65,536)"),
            "dir": (str(tmp_path / "dir"), "is not a regular file (drw")}


@pytest.mark.parametrize("setting", KEYS)
def test_info_refuses_a_fifo_as_a_secret_file(setting, planted):
    """The reproducer, end to end: ``mkfifo f; hicache info --set storage.auth_key_file=f``."""
    path, why = planted["fifo"]
    r = _info(setting, path)
    assert r.returncode == 2, (r.returncode, r.stderr[-500:])
    assert f"{setting}={path!r} {why}" in r.stderr and "Traceback" not in r.stderr, r.stderr[-500:]


@pytest.mark.parametrize("setting", KEYS)
@pytest.mark.parametrize("kind", ["fifo", "dev_zero", "big", "dir"])
def test_secret_files_are_checked_before_a_byte_is_read(setting, kind, planted):
    path, why = planted[kind]
    read = config.read_secret_file  # (the old tree has none: it fails here, not by reading /dev/zero)
    with pytest.raises(ConfigError) as e:
        read(path, setting)
    assert f"{setting}={path!r} {why}" in str(e.value)
    cfg = HiCacheConfig.load(overrides={"storage.url": "memory://", setting: path}, env={})
    with pytest.raises(ConfigError, match="is not a regular file|more than a secret file may"):
        cfg.storage.resolved_auth_key() if setting.startswith("storage") else resolve_admin_token(cfg)


def test_a_secret_file_within_the_limits_is_read(tmp_path):
    (tmp_path / "k").write_bytes(b"  s3cret-key-0123456789abcdef\n")
    (tmp_path / "t").write_text("token-0123456789abcdef\n")
    cfg = HiCacheConfig.load(overrides={"storage.url": "memory://", "storage.auth_key_file": str(tmp_path / "k"),
                                        "service.admin_token_file": str(tmp_path / "t")}, env={})
    assert cfg.storage.resolved_auth_key() == b"s3cret-key-0123456789abcdef"
    assert resolve_admin_token(cfg) == "token-0123456789abcdef"
