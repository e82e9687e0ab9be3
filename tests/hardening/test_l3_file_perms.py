"""file:// objects are this user's unless a group is configured (issue 36, rows 14 and 15).

Before the fix objects were 0644 in 0755 directories (any local user read
other tenants' KV), and ``exists()`` said True for a directory, FIFO or
symlink planted at an object's path (the get then missed). Now objects are
0600 in 0700 directories, or 0640 in setgid 2770 directories of
``storage.file_group``; ``exists()`` counts regular files only.
"""
from __future__ import annotations

import os
import shutil
import stat
import tempfile
from pathlib import Path

import pytest

from hicache.core.config import HiCacheConfig
from hicache.core.errors import ConfigError
from hicache.core.hashing import page_hashes
from hicache.storage import open_storage
from hicache.storage.capacity import backend_options
from hicache.storage.file_cap import LEDGER

FP = "0f1e2d3c4b5a6978"
NOBODY = 65534


def _modes(root: Path) -> dict[str, tuple[int, int]]:
    """(mode, gid) by kind: the prefix dir, the fan-out dirs, the objects."""
    out: dict[str, set] = {"prefix": set(), "fanout": set(), "object": set()}
    for dirpath, dirs, files in os.walk(root):
        depth = len(Path(dirpath).relative_to(root).parts)
        st = os.lstat(dirpath)
        if depth in (1, 2):
            out["prefix" if depth == 1 else "fanout"].add((stat.S_IMODE(st.st_mode), st.st_gid))
        if depth == 2:
            for f in files:
                fst = os.lstat(os.path.join(dirpath, f))
                out["object"].add((stat.S_IMODE(fst.st_mode), fst.st_gid))
    return {k: v.pop() if len(v) == 1 else v for k, v in out.items()}


def _fill(url: str, **opts):
    b = open_storage(url, fingerprint=FP, **opts)
    keys = page_hashes(list(range(64)), 4)
    assert b.put([(k, bytes(100), [100]) for k in keys]) == len(keys)
    return b, keys


def test_objects_are_0600_in_0700_directories_by_default(tmp_path):
    root = tmp_path / "l3"
    b, _ = _fill(f"file://{root}")
    gid = os.getegid()
    assert stat.S_IMODE(os.lstat(root).st_mode) == 0o700
    assert _modes(root) == {"prefix": (0o700, gid), "fanout": (0o700, gid), "object": (0o600, gid)}
    b.close()


def test_an_old_0755_prefix_dir_is_tightened_but_a_root_given_is_left_alone(tmp_path):
    root = tmp_path / "l3"
    (root / "hicache-0f1e2d3c").mkdir(parents=True)
    os.chmod(root, 0o755)
    os.chmod(root / "hicache-0f1e2d3c", 0o755)
    b, _ = _fill(f"file://{root}")
    assert stat.S_IMODE(os.lstat(root).st_mode) == 0o755  # e.g. file:///srv/cache: not ours to change
    assert _modes(root)["prefix"] == (0o700, os.getegid())
    b.close()


def test_file_group_shares_the_store_with_one_group(tmp_path):
    gid = NOBODY if os.geteuid() == 0 else os.getegid()
    cfg = HiCacheConfig.load(overrides={"storage.url": f"file://{tmp_path}/l3", "storage.file_group": str(gid),
                                        "storage.max_bytes": "1MiB"}, env={})
    opts = backend_options(cfg.storage)
    assert opts["group"] == str(gid)
    b, _ = _fill(cfg.storage.url, **opts)
    root = tmp_path / "l3"
    assert _modes(root) == {"prefix": (0o2770, gid), "fanout": (0o2770, gid), "object": (0o640, gid)}
    led = os.lstat(root / LEDGER)
    assert (stat.S_IMODE(led.st_mode), led.st_gid) == (0o660, gid)
    b.check_integrity()
    b.close()
    with pytest.raises(ConfigError, match="storage.file_group='no-such-group-xyz': no such group"):
        open_storage(f"file://{tmp_path}/l4", fingerprint=FP, group="no-such-group-xyz")


def test_a_member_of_the_group_writes_the_shared_capped_store(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("a second uid needs root here")
    top = Path(tempfile.mkdtemp(prefix="hc-grp-", dir="/tmp"))  # pytest's tmp_path is 0700 all the way up
    os.chmod(top, 0o755)
    url = f"file://{top}/l3"
    b, keys = _fill(url, max_bytes=1 << 20, group=str(NOBODY))
    pid = os.fork()
    if pid == 0:
        rc = 1
        try:
            os.setgroups([NOBODY])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            other = open_storage(url, fingerprint=FP, max_bytes=1 << 20, group=str(NOBODY))
            more = page_hashes(list(range(1000, 1064)), 4)
            ok = other.put([(k, bytes(100), [100]) for k in more]) == len(more) and all(other.exists(keys))
            other.close()
            rc = 0 if ok else 3
        finally:
            os._exit(rc)
    assert os.waitpid(pid, 0)[1] == 0
    assert b.usage().used_bytes >= 2 * 16 * 100
    b.check_integrity()
    b.close()
    shutil.rmtree(top)


@pytest.mark.parametrize("kind", ["directory", "fifo", "symlink"])
def test_exists_is_false_for_what_is_not_a_regular_file(tmp_path, kind):
    root = tmp_path / "l3"
    b, keys = _fill(f"file://{root}")
    k = keys[0]
    path = b.path_of(k)
    real = path.read_bytes()
    os.unlink(path)
    if kind == "directory":
        path.mkdir()
    elif kind == "fifo":
        os.mkfifo(path)
    else:
        (tmp_path / "elsewhere").write_bytes(real)  # a valid object, outside the store
        os.symlink(tmp_path / "elsewhere", path)
    assert b.exists([k, keys[1]]) == [False, True]
    assert b.get([k], [100]) == [None]  # and the get agrees
    b.close()
