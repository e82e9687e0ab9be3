"""`storage clear` and the file:// trim never follow a symlink swapped in mid-delete (issue 36, row 3).

Before the fix both unlinked by full path: with 3,000 objects under one
fan-out dir, ``mv ab ab.real && ln -s /tmp/outside ab`` in the middle of a
clear deleted 2,220 files of the same names outside the store. Both now walk
and delete through directory descriptors opened with ``O_NOFOLLOW``. The
swap is made at a fixed point of the run (the N-th unlink), not by timing.
"""
from __future__ import annotations

import os

import pytest

from hicache.cli import main
from hicache.storage import open_storage
from hicache.core.errors import StorageError
from hicache.storage.file_cap import scan

FP = "0f1e2d3c4b5a6978"
N = 300


def _store_with_one_fanout(root, **opts):
    """``N`` objects, all in the fan-out dir of their first byte ``ab``; returns (backend, that dir)."""
    b = open_storage(f"file://{root}", fingerprint=FP, **opts)
    keys = [bytes([0xAB]) + i.to_bytes(15, "big") for i in range(N)]
    assert b.put([(k, bytes(100), [100]) for k in keys]) == N
    fan = b.path_of(keys[0]).parent
    assert fan.name == "ab" and len(os.listdir(fan)) == N
    return b, fan


def _outside_twin(tmp_path, fan):
    """A directory outside the store holding files of the same names as ``fan``'s."""
    out = tmp_path / "outside"
    out.mkdir()
    for name in os.listdir(fan):
        (out / name).write_bytes(b"not the store's")
    return out


def _swap_at(monkeypatch, k: int, fan, outside):
    """On the k-th unlink: ``mv ab ab.real && ln -s outside ab``, as the attacker did."""
    real_unlink = os.unlink
    calls = [0]

    def unlink(path, *a, **kw):
        calls[0] += 1
        if calls[0] == k:
            os.rename(fan, str(fan) + ".real")
            os.symlink(outside, fan)
        return real_unlink(path, *a, **kw)
    monkeypatch.setattr(os, "unlink", unlink)
    return calls


def test_clear_never_deletes_through_a_swapped_in_symlink(tmp_path, monkeypatch, capsys):
    root = tmp_path / "l3"
    b, fan = _store_with_one_fanout(root)
    outside = _outside_twin(tmp_path, fan)
    calls = _swap_at(monkeypatch, 10, fan, outside)
    assert main(["storage", "clear", "--url", f"file://{root}", "--yes"]) == 0
    assert calls[0] >= 10
    assert len(os.listdir(outside)) == N  # nothing outside deleted
    assert os.listdir(str(fan) + ".real") == []  # the directory walked was cleared, wherever it moved
    assert "deleted 300 objects" in capsys.readouterr().out


def test_trim_never_deletes_through_a_swapped_in_symlink(tmp_path, monkeypatch):
    root = tmp_path / "l3"
    b, fan = _store_with_one_fanout(root, max_bytes=10**7)
    outside = _outside_twin(tmp_path, fan)
    calls = _swap_at(monkeypatch, 10, fan, outside)
    r = b._cap.trim(force=True, to_bytes=0)
    assert calls[0] >= 10 and r is not None
    assert len(os.listdir(outside)) == N
    assert r.deleted == 10  # up to the swap (the 10th had its directory open already); the rest are kept
    monkeypatch.undo()
    os.unlink(fan)
    os.rename(str(fan) + ".real", fan)
    assert len(scan(root)[0]) == N - 10
    b._cap.rescan()
    b.check_integrity()


def test_scan_does_not_count_through_a_symlinked_fanout_dir(tmp_path):
    root = tmp_path / "l3"
    b, fan = _store_with_one_fanout(root)
    outside = _outside_twin(tmp_path, fan)
    os.rename(fan, str(fan) + ".real")
    os.symlink(outside, fan)
    assert scan(root)[0] == []
    with pytest.raises(StorageError, match="not an object path"):
        from hicache.storage.file_cap import _unlink
        _unlink(root, str(outside / "x"))
