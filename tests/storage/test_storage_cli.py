"""``hicache storage du|ls|clear`` on file://, redis:// and memory:// (issue 25, item 6)."""
from __future__ import annotations

import json

import pytest
import redis

from hicache.cli import main
from hicache.core.hashing import page_hashes
from hicache.storage import open_storage
from hicache.storage.file_cap import LEDGER, scan

FP_A, FP_B = "0f1e2d3c4b5a6978", "aaaabbbbccccdddd"


def fill(url: str, **opts):
    a = open_storage(url, fingerprint=FP_A, **opts)
    b = open_storage(url, fingerprint=FP_B, **opts)
    assert a.put([(k, bytes(1000), [1000]) for k in page_hashes(list(range(40)), 4)]) == 10
    assert b.put([(k, bytes(500), [500]) for k in page_hashes(list(range(8)), 4)]) == 2
    return a, b


def cli(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(["storage", *argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


def du_json(capsys, url: str) -> dict:
    rc, out, _ = cli(capsys, "du", "--url", url, "--json")
    assert rc == 0
    return json.loads(out)


def test_file_du_ls_clear(tmp_path, capsys):
    url = f"file://{tmp_path}"
    a, b = fill(url, max_bytes=10**6)
    obj_a = a.path_of(page_hashes(list(range(4)), 4)[0]).stat().st_size
    d = du_json(capsys, url)
    sizes = {p["prefix"]: (p["objects"], p["bytes"], p["fingerprint"]) for p in d["prefixes"]}
    obj_b = sizes["hicache-aaaabbbb"][1] // 2
    assert sizes == {"hicache-0f1e2d3c": (10, 10 * obj_a, FP_A), "hicache-aaaabbbb": (2, 2 * obj_b, FP_B)}
    assert (d["objects"], d["bytes"]) == (12, sum(f.size for f in scan(tmp_path)[0]))
    rc, out, _ = cli(capsys, "ls", "--url", url, "--fingerprint", FP_B)
    lines = out.splitlines()
    assert rc == 0 and len(lines) == 3 and all(ln.startswith("hicache-aaaabbbb") for ln in lines[1:])
    rc, out, _ = cli(capsys, "ls", "--url", url, "--limit", "4")
    assert len(out.splitlines()) == 1 + 4 + 1 and "--limit 0 lists all" in out
    # clear without --yes: says what would go, deletes nothing, exits 0 (a dry run is no error)
    rc, out, _ = cli(capsys, "clear", "--url", url, "--fingerprint", FP_A[:8])
    assert rc == 0 and "would delete 10 objects" in out and "--yes" in out
    assert du_json(capsys, url)["objects"] == 12
    rc, out, _ = cli(capsys, "clear", "--url", url, "--fingerprint", FP_A, "--yes")
    assert rc == 0 and "deleted 10 objects" in out
    assert b.exists(page_hashes(list(range(8)), 4)) == [True, True]  # the other layout stays
    assert a.usage().used_bytes == 2 * obj_b  # the ledger was reset to what is left
    fp_c = "0123456789abcdef" * 2  # a real fingerprint's 32 hex digits
    c = open_storage(url, fingerprint=fp_c, max_bytes=10**6)
    assert c.put([(page_hashes(list(range(4)), 4)[0], bytes(100), [100])]) == 1
    rc, out, _ = cli(capsys, "du", "--url", url)  # the table shows each layout's whole fingerprint
    assert [ln.split()[:2] for ln in out.splitlines()[2:-1]] == [["hicache-01234567", fp_c],
                                                                 ["hicache-aaaabbbb", FP_B]], out
    c.close()
    rc, out, _ = cli(capsys, "clear", "--url", url, "--yes")
    assert rc == 0 and "deleted 3 objects" in out and scan(tmp_path)[0] == []
    assert (tmp_path / LEDGER).exists() and a.usage().used_bytes == 0
    # no row lingers for the emptied prefixes (no "?  0  0"), in the table and in --json
    rc, out, _ = cli(capsys, "du", "--url", url)
    assert out.splitlines()[1].startswith("prefix") and out.splitlines()[2].split() == ["total", "0", "0"], out
    assert du_json(capsys, url)["prefixes"] == []
    a.check_integrity()
    a.close()
    b.close()


def test_redis_du_ls_clear_by_scan_never_keys(private_redis, capsys):
    url = private_redis.url
    raw = redis.Redis.from_url(url)
    raw.set(b"other:app:key", b"x" * 100)  # not ours: never counted or deleted
    a, b = fill(url, timeout_ms=2000)
    raw.config_resetstat()
    d = du_json(capsys, url)
    sizes = {p["prefix"]: (p["objects"], p["fingerprint"]) for p in d["prefixes"]}
    assert sizes == {"hicache:0f1e2d3c:": (10, FP_A), "hicache:aaaabbbb:": (2, FP_B)}
    assert d["bytes"] == sum(raw.strlen(k) for k in raw.scan_iter(match=b"hicache:*"))
    assert d["redis"]["keys"] == 13 and d["redis"]["maxmemory"] == 0
    rc, out, _ = cli(capsys, "du", "--url", url)
    assert "maxmemory unset" in out
    rc, out, _ = cli(capsys, "clear", "--url", url, "--prefix", "hicache:aaaabbbb:", "--yes")
    assert rc == 0 and "deleted 2 objects" in out
    assert raw.dbsize() == 11 and raw.exists(b"other:app:key")
    rc, out, _ = cli(capsys, "clear", "--url", url, "--yes")
    assert "deleted 10 objects" in out and raw.dbsize() == 1
    stats = raw.info("commandstats")
    assert "cmdstat_scan" in stats and "cmdstat_keys" not in stats
    a.close()
    b.close()
    raw.close()


def test_memory_is_trivially_empty_and_errors_name_the_fix(capsys, tmp_path):
    assert du_json(capsys, "memory://")["objects"] == 0
    rc, out, _ = cli(capsys, "clear", "--url", "memory://", "--yes")
    assert rc == 0 and "deleted 0 objects" in out
    rc, _, err = cli(capsys, "du", "--url", f"file://{tmp_path}/nope")
    assert rc == 2 and "does not exist; check --url / storage.url" in err
    rc, _, err = cli(capsys, "du", "--url", "hicache+unix:///run/h.sock")
    assert rc == 2 and "POST /v1/flush" in err
    rc, _, err = cli(capsys, "ls", "--url", "memory://", "--fingerprint", "xyz")
    assert rc == 2 and "--fingerprint 'xyz'" in err
    rc, _, err = cli(capsys, "du", "--url", "redis://127.0.0.1:1/0")
    assert rc == 2 and "cannot reach it" in err
    with pytest.raises(SystemExit):
        main(["storage", "clear", "--fingerprint", "aa", "--prefix", "b"])  # one or the other
