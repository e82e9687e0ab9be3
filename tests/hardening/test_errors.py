"""Bad inputs end in ``hicache: error: ...`` with a hint, never a traceback (issue 17, item 13).

Each case ran into a raw Python exception before the fix (``ValueError`` from
torch for ``tpu:0``, ``KeyError`` for an unknown eviction policy, a bare
``MemoryError``, ``FileNotFoundError`` without the path, ``UnicodeDecodeError``,
``IsADirectoryError``, ``RecursionError``, a 256 GB allocation for a large
vocab, ``UnicodeEncodeError`` for a lone surrogate); ``redis://.../abc``
silently used db 0 and ``device_pages = true`` became 1. ``main`` runs in
process, so an escaping exception fails the test.
"""
from __future__ import annotations

import json

import pytest

from hicache.cli import main
from hicache.core.config import HiCacheConfig
from hicache.core.errors import ConfigError
from hicache.storage import open_storage

HEADER = {"hicache_trace": 1, "name": "t", "vocab": 64}
REQ = {"rid": "a", "arrival": 0, "prompt": [1, 2, 3], "max_new_tokens": 1}


def err_of(capsys, argv: list[str]) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("hicache: error: ") and "Traceback" not in err, err
    return err


@pytest.mark.parametrize("setting,needle", [
    ("pool.device=tpu:0", "must be auto, cpu, cuda or cuda:N"),
    ("pool.device=cuda:3", "CUDA device(s)"),
    ("policy.device_eviction=random", "must be one of fifo, ghost_lru, lfu, lru"),
    ("pool.host_pages=1000000000000", "of host memory, more than this machine's"),
    ("service.socket_path=/nonexistent-dir-hc/e.sock", "'/nonexistent-dir-hc' does not exist"),
    ("model.dtype=int8", "model.dtype='int8': must be one of bfloat16, float16, float32, float8_e4m3fn, float8_e5m2"),
])
def test_bad_settings(capsys, setting, needle):
    argv = ["serve" if "socket_path" in setting else "replay", "--set", setting, "--set", "storage.url=",
            "--set", "pool.host_pages=4" if "host_pages" not in setting else "log_level=ERROR", "--quiet"]
    if argv[0] == "serve":
        argv = argv[:-1] + ["--set", "service.port=0"]
    err = err_of(capsys, argv)
    assert needle in err and "(set it in the config file" in err or "socket_path" in setting, err
    assert "KVLayout" not in err and "uint8" not in err


def test_config_file_not_utf8_or_a_directory(capsys, tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_bytes(b"[pool]\nhost_pages = 8 # \xff\xfe\n")
    assert "is not UTF-8" in err_of(capsys, ["info", "--config", str(bad)])
    assert "is a directory" in err_of(capsys, ["info", "--config", str(tmp_path)])


@pytest.mark.parametrize("content,needle", [
    (b'{"hicache_trace": 1, "name": "\xff", "vocab": 8}\n', "not UTF-8"),
    (json.dumps(HEADER).encode() + b"\n" + b"[" * 100000 + b"]" * 100000 + b"\n", "nested too deeply"),
    (json.dumps(HEADER | {"vocab": 10**9}).encode() + b"\n" + json.dumps(REQ).encode(), "vocab"),
    (json.dumps(HEADER | {"vocab": 10**18}).encode() + b"\n" + json.dumps(REQ).encode(), "vocab"),
    (json.dumps(HEADER).encode() + b"\n" + b'{"rid": "a", "arrival": 0, "prompt": [1], "max_new_tokens": 1, '
     b'"namespace": "\\ud800"}', "lone surrogate"),
])
def test_bad_traces(capsys, tmp_path, content, needle):
    p = tmp_path / "t.jsonl"
    p.write_bytes(content)
    assert needle in err_of(capsys, ["replay", str(p), "--quiet", "--set", "storage.url="])


def test_missing_trace_or_a_directory(capsys, tmp_path):
    assert "does not exist" in err_of(capsys, ["replay", str(tmp_path / "nope.jsonl"), "--quiet"])
    assert "is a directory" in err_of(capsys, ["replay", str(tmp_path), "--quiet"])


def test_redis_url_with_a_non_numeric_db_is_refused():
    with pytest.raises(ConfigError, match="database 'abc' is not a number"):
        open_storage("redis://127.0.0.1:6379/abc", fingerprint="f" * 32)


@pytest.mark.parametrize("value", [True, "true"])
def test_booleans_are_not_counts(value, tmp_path):
    f = tmp_path / "c.toml"
    f.write_text("[pool]\ndevice_pages = true\n")
    with pytest.raises(ConfigError, match="pool.device_pages"):
        HiCacheConfig.load(f, env={})
    with pytest.raises(ConfigError, match="pool.device_pages"):
        HiCacheConfig.load(overrides={"pool.device_pages": value}, env={})


def test_unknown_setting_names_its_actual_source(tmp_path):
    with pytest.raises(ConfigError, match=r"from --set pool.device_page=\.\.\."):
        HiCacheConfig.load(overrides={"pool.device_page": "3"}, env={})
    with pytest.raises(ConfigError, match="from HICACHE_POOL__DEVICE_PAGE in the environment"):
        HiCacheConfig.load(env={"HICACHE_POOL__DEVICE_PAGE": "3"})
    f = tmp_path / "c.toml"
    f.write_text("[pool]\ndevice_page = 3\n")
    with pytest.raises(ConfigError, match=f"from the config file '{f}'"):
        HiCacheConfig.load(f, env={})


def test_allowed_uids_from_the_environment():
    assert HiCacheConfig.load(env={"HICACHE_SERVICE__ALLOWED_UIDS": "1001, 1002"}).service.allowed_uids == [1001, 1002]
    with pytest.raises(ConfigError, match="service.allowed_uids='abc'"):
        HiCacheConfig.load(env={"HICACHE_SERVICE__ALLOWED_UIDS": "abc"})


def test_an_l3_directory_that_refuses_mkdir_fails_in_one_line(capsys):
    """/proc exists but refuses mkdir: one error line, no RecursionError (985 tracebacks before)."""
    with pytest.raises(ConfigError, match=r"cannot create directory '/proc/hicache-l3' \(No such file or directory\)"):
        open_storage("file:///proc/hicache-l3", fingerprint="0f1e2d3c4b5a69788796a5b4c3d2e1f0")
    err = err_of(capsys, ["replay", "--scale", "tiny", "--no-baselines", "--quiet",
                          "--set", "storage.url=file:///proc/hicache-l3"])
    assert err.count("\n") == 1 and "pick a writable directory" in err and "storage.file_group" in err, err


def test_replay_service_without_a_service_is_one_short_sentence(capsys, tmp_path):
    """It was 604 characters that said "start hicache serve first" twice."""
    err = err_of(capsys, ["replay", "--service", str(tmp_path / "none.sock"), "--quiet"])
    assert err == (f"hicache: error: --service {tmp_path / 'none.sock'}: no hicache service listens there (No such "
                   "file or directory); start `hicache serve` first\n")
