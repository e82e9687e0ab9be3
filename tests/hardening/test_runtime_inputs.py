"""Inputs that hung or passed silently (issue 27, item 6).

Before the fix: a FIFO given as the trace hung ``hicache replay`` in
``open()`` (a device such as /dev/null was read as an empty trace);
``storage.max_retries=10**9`` and ``service.allowed_uids=[-1]`` loaded
without a word; ``hicache info`` printed a configuration that replay and
serve then refused (a short ``auth_key``, an L3 URL no backend accepts).
"""
from __future__ import annotations

import os
import threading

import pytest

from hicache.cli import main
from hicache.core.config import MAX_RETRIES, HiCacheConfig
from hicache.core.errors import ConfigError, TraceError
from hicache.reference.workloads import read_trace


@pytest.fixture
def fifo(tmp_path):
    """A FIFO path. Only a reader that blocks in open() (the bug) ever meets the
    safety writer, which gives it an EOF so the test fails on its message
    instead of hanging the suite."""
    path = tmp_path / "trace.jsonl"
    os.mkfifo(path)
    done = threading.Event()

    def unblock() -> None:
        if not done.wait(30):
            os.close(os.open(path, os.O_WRONLY))
    t = threading.Thread(target=unblock, daemon=True)
    t.start()
    yield path
    done.set()
    t.join()


def test_fifo_trace_is_refused_before_it_is_opened(fifo):
    with pytest.raises(TraceError, match="is not a regular file") as e:
        read_trace(fifo)
    assert str(fifo) in str(e.value)


def test_device_trace_is_refused():
    with pytest.raises(TraceError, match=r"'/dev/null' is not a regular file"):
        read_trace("/dev/null")


def test_replay_reports_a_fifo_trace(fifo, capsys):
    assert main(["replay", str(fifo), "--set", "storage.url=memory://"]) == 2
    assert "is not a regular file" in capsys.readouterr().err


@pytest.mark.parametrize("key,value,why", [
    ("storage.max_retries", 10**9, f"less than or equal to {MAX_RETRIES}"),
    ("storage.max_retries", -1, "greater than or equal to 0"),
    ("service.allowed_uids", "[-1]", "greater than or equal to 0"),
    ("service.allowed_uids", "1001,4294967295", "less than or equal to 4294967294"),
])
def test_out_of_range_settings_are_refused(key, value, why):
    with pytest.raises(ConfigError, match=why) as e:
        HiCacheConfig.load(overrides={key: value}, env={})
    assert key in str(e.value)


def test_in_range_settings_still_load():
    cfg = HiCacheConfig.load(overrides={"storage.max_retries": MAX_RETRIES,
                                        "service.allowed_uids": "0,1001,4294967294"}, env={})
    assert (cfg.storage.max_retries, cfg.service.allowed_uids) == (MAX_RETRIES, [0, 1001, 4294967294])


@pytest.mark.parametrize("setting,error", [
    ("storage.auth_key=too-short", "auth_key: must be at least 16 bytes"),
    ("storage.url=bogus://x", "scheme 'bogus' is not registered"),
    ("storage.url=redis://h:notaport/0", "Port could not be cast"),
    ("storage.url=file://", "needs a directory"),
    ("storage.auth_key_file=/nonexistent/key", "cannot be read"),
    ("service.admin_token_file=/nonexistent/token", "cannot be read"),
])
def test_info_refuses_what_replay_and_serve_refuse(setting, error, capsys):
    assert main(["info", "--set", setting]) == 2
    err = capsys.readouterr().err
    assert error in err, err


@pytest.mark.parametrize("token,error", [("", "admin routes need a token"), ("short-token", "at least 16")])
def test_info_refuses_a_bind_beyond_loopback_that_serve_refuses(token, error, capsys):
    assert main(["info", "--set", "service.host=0.0.0.0", "--set", f"service.admin_token={token}"]) == 2
    err = capsys.readouterr().err
    assert error in err and (not token or token not in err), err
    assert main(["info", "--set", "service.host=0.0.0.0", "--set", "service.admin_token=" + "t" * 16]) == 0


def test_info_checks_without_side_effects(tmp_path, capsys):
    d = tmp_path / "l3"
    assert main(["info", "--set", f"storage.url=file://{d}", "--set", "storage.auth_key=" + "k" * 16]) == 0
    assert '"L3": "file://' in capsys.readouterr().out and not d.exists()  # parsed, not created
