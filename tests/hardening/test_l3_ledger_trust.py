"""The file:// cap ledger is held to the shared segment's trust rules (issue 36, rows 4, 6 and 10).

Before the fix ``.hicache-usage`` was used whatever it was: ``nobody``
planted it 0666 and zeroed it between rounds, and 45 MiB landed under
``max_bytes=10MiB``; a FIFO, directory or symlink in its place dropped every
put for good with nothing naming the file; a second uid on a capped store got
a raw ``PermissionError`` traceback. Now a ledger (or trim lock) that is not
a regular file with one link, owned by this uid and writable by no one else
is moved aside with a warning and rebuilt from a scan; where it cannot be,
the error names the file and the fix.
"""
from __future__ import annotations

import logging
import os
import stat

import pytest

from hicache.core.errors import HiCacheError, IntegrityError
from hicache.core.hashing import page_hashes
from hicache.storage import open_storage
from hicache.storage import file_cap
from hicache.storage.file_cap import LEDGER, TRIM_LOCK, FileCap, scan

FP = "0f1e2d3c4b5a6978"
NOBODY = 65534
OBJ = 1000
CAP = 20 * OBJ


def _on_disk(root) -> int:
    return sum(f.size for f in scan(root)[0])


def _put_round(b, r: int) -> None:
    keys = page_hashes(list(range(r * 400, (r + 1) * 400)), 4)  # 100 pages
    assert b.put([(k, bytes(OBJ), [OBJ]) for k in keys]) == 100


def test_a_planted_ledger_zeroed_between_rounds_cannot_lift_the_cap(tmp_path, caplog):
    root = tmp_path / "l3"
    root.mkdir()
    planted = root / LEDGER
    fd = os.open(planted, os.O_CREAT | os.O_RDWR, 0o666)  # the attacker keeps its descriptor
    os.fchmod(fd, 0o666)
    if os.geteuid() == 0:
        os.fchown(fd, NOBODY, NOBODY)
    with caplog.at_level(logging.WARNING, "hicache.storage.file_cap"):
        b = open_storage(f"file://{root}", fingerprint=FP, max_bytes=CAP)
    assert f"{planted} is owned by uid" in caplog.text or f"{planted} has mode 0666" in caplog.text
    for r in range(5):
        _put_round(b, r)
        os.pwrite(fd, bytes(24), 0)  # zero "the ledger" between rounds
        assert _on_disk(root) <= CAP
    os.close(fd)
    st = os.lstat(planted)
    assert st.st_uid == os.geteuid() and stat.S_IMODE(st.st_mode) == 0o600
    assert [p for p in os.listdir(root) if p.startswith(LEDGER + ".untrusted.")]
    b.check_integrity()
    b.close()


@pytest.mark.parametrize("kind", ["fifo", "directory", "symlink", "hardlink"])
@pytest.mark.parametrize("which", [LEDGER, TRIM_LOCK])
def test_a_ledger_that_is_no_file_never_takes_l3_down(tmp_path, caplog, kind, which):
    root = tmp_path / "l3"
    b = open_storage(f"file://{root}", fingerprint=FP, max_bytes=CAP)
    _put_round(b, 0)
    path = root / which
    os.unlink(path) if os.path.exists(path) else None
    if kind == "fifo":
        os.mkfifo(path, 0o600)
    elif kind == "directory":
        os.mkdir(path)
        (path / "x").write_bytes(b"")
    elif kind == "symlink":
        (tmp_path / "outside").write_bytes(bytes(24))
        os.symlink(tmp_path / "outside", path)
    else:
        (tmp_path / "other").write_bytes(bytes(24))
        os.link(tmp_path / "other", path)
    with caplog.at_level(logging.WARNING, "hicache.storage.file_cap"):
        for r in range(1, 4):
            _put_round(b, r)  # every put stored (the trim ran: 400 pages under a 20-page cap)
    assert str(path) in caplog.text
    assert stat.S_ISREG(os.lstat(path).st_mode) and _on_disk(root) <= CAP
    assert (tmp_path / "outside").read_bytes() == bytes(24) if kind == "symlink" else True
    b.check_integrity()
    assert b.usage().used_bytes >= _on_disk(root)
    b.close()


def test_a_ledger_that_cannot_be_moved_aside_is_named_with_the_fix(tmp_path, monkeypatch):
    root = tmp_path / "l3"
    root.mkdir()
    os.mkdir(root / LEDGER)

    def no_rename(*a, **kw):
        raise PermissionError(13, "Permission denied")
    monkeypatch.setattr(os, "rename", no_rename)
    with pytest.raises(file_cap.LedgerError) as e:
        FileCap(root, CAP)
    msg = str(e.value)
    assert f"{root / LEDGER} is a directory, and this user cannot move it aside" in msg and "rm -r" in msg
    assert isinstance(e.value, OSError)  # inside a put: an outage, counted, not a crash
    monkeypatch.undo()
    os.rmdir(root / LEDGER)  # the documented repair
    cap = FileCap(root, CAP)
    assert cap.usage() == (0, 0)
    cap.check_integrity()


def test_check_integrity_names_an_untrusted_ledger_and_does_not_repair_it(tmp_path):
    root = tmp_path / "l3"
    b = open_storage(f"file://{root}", fingerprint=FP, max_bytes=CAP)
    os.unlink(root / LEDGER)
    os.mkdir(root / LEDGER)
    with pytest.raises(IntegrityError, match=f"{root / LEDGER} is a directory"):
        b.check_integrity()
    assert os.path.isdir(root / LEDGER)  # a check does not mutate; the next put repairs
    _put_round(b, 0)
    b.check_integrity()
    b.close()


def _open_as(uid: int, url: str) -> tuple[str, str]:
    """``open_storage(url)`` in a forked child running as ``uid``: (exception type, message) or ("", "")."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        out = b""
        try:
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            try:
                open_storage(url, fingerprint=FP, max_bytes=CAP).close()
            except BaseException as e:  # noqa: BLE001 - reported to the parent
                out = f"{type(e).__name__}|{isinstance(e, HiCacheError)}|{e}".encode()
            os.write(w, out)
        finally:
            os._exit(0)
    os.close(w)
    data = b""
    while chunk := os.read(r, 65536):
        data += chunk
    os.close(r)
    os.waitpid(pid, 0)
    kind, _, rest = data.decode().partition("|")
    return kind, rest


def test_a_second_uid_on_a_capped_store_gets_a_clear_error(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("opening as a second uid needs root here")
    import shutil
    import tempfile
    from pathlib import Path
    top = Path(tempfile.mkdtemp(prefix="hc-uid-", dir="/tmp"))  # pytest's tmp_path is 0700 all the way up
    os.chmod(top, 0o755)
    root = top / "l3"
    b = open_storage(f"file://{root}", fingerprint=FP, max_bytes=CAP)
    _put_round(b, 0)
    for mode in (0o755, 0o700):  # an old store's directory, and a new one's
        os.chmod(root, mode)
        kind, rest = _open_as(NOBODY, f"file://{root}")
        is_ours, _, msg = rest.partition("|")
        assert kind and is_ours == "True", (kind, rest)  # a HiCacheError, not a PermissionError traceback
        assert str(root) in msg and ("storage.file_group" in msg or "writable directory" in msg), msg
    b.check_integrity()
    b.close()
    shutil.rmtree(top)
