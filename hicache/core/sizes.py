"""Byte sizes as operators write them (``20GiB``, ``500MB``, ``auto``): a leaf module
that the config and the storage capacity code both read."""
from __future__ import annotations

import re
from typing import Any, Literal

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgtp]?)(i?)b?\s*$", re.IGNORECASE)


def parse_size(value: Any) -> int | Literal["auto"]:
    """``"auto"``, an int, or a size string (``"20GiB"``, ``"500M"``, ``"1.5TB"``) -> bytes.

    Raises ``ValueError`` naming the value (the config turns it into ``ConfigError``)."""
    if isinstance(value, bool):
        raise ValueError("must be a byte count, a size such as 20GiB, or auto; not a boolean")
    if isinstance(value, int):
        if value < 0:
            raise ValueError("must be >= 0 (0 = unbounded)")
        return value
    if isinstance(value, str):
        if value.strip().lower() == "auto":
            return "auto"
        m = _SIZE.match(value)
        if m:
            num, unit, binary = m.groups()
            base = 1024 if binary or not unit else 1000
            return int(float(num) * base ** " kmgtp".index(unit.lower() or " "))
    raise ValueError(f"{value!r} is not a byte count: use bytes (21474836480), a size (20GiB, 500MB) or auto")
