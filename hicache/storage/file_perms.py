"""Who may read a ``file://`` store: this uid only, or the members of one group.

Without ``storage.file_group`` objects are created 0600 in 0700 directories
(another local user can neither list nor read another tenant's KV); with it,
0640 in 2770 directories of that group (setgid: files inherit the group, and
every member may add and rename objects). A prefix directory of ours made
by an older version (0755) is tightened when the store is opened; the root
directory is only given a mode when this process creates it.
"""
from __future__ import annotations

import grp
import os
import stat
from dataclasses import dataclass
from pathlib import Path

from hicache.core.errors import ConfigError


@dataclass(frozen=True, slots=True)
class FilePerms:
    gid: int | None  # the sharing group; None: this uid only

    @classmethod
    def of(cls, group: str, where: str) -> "FilePerms":
        """``storage.file_group`` (a name, a numeric gid or "") resolved. Raises ``ConfigError``."""
        if not group:
            return cls(None)
        if str(group).isdigit():
            return cls(int(group))
        try:
            return cls(grp.getgrnam(group).gr_gid)
        except KeyError:
            raise ConfigError(f"storage url {where!r}: storage.file_group={group!r}: no such group on this "
                              "machine; create it, give a numeric gid, or leave it empty (this user only)") from None

    @property
    def file_mode(self) -> int:
        return 0o600 if self.gid is None else 0o640

    @property
    def dir_mode(self) -> int:
        return 0o700 if self.gid is None else 0o2770

    def make_dir(self, path: Path, tighten: bool = False) -> None:
        """Create ``path`` (and missing parents) with ``dir_mode``; ``tighten``: also an existing
        one of ours whose mode lets more in than ``dir_mode``. Raises ``OSError``."""
        try:
            os.mkdir(path, 0o700)
        except FileNotFoundError:
            path.parent.mkdir(parents=True, exist_ok=True)
            return self.make_dir(path, tighten)
        except FileExistsError:
            if not tighten:
                return
        st = os.lstat(path)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
            return  # not ours to change (the write path refuses what is not a directory)
        if self.gid is not None and st.st_gid != self.gid:
            os.chown(path, -1, self.gid)
        if stat.S_IMODE(st.st_mode) != self.dir_mode:
            os.chmod(path, self.dir_mode)
