"""`hicache storage` never shows a piece of a Redis password (issue 36, row 2).

Before the fix the admin commands passed redis-py's error text through:
with an unencoded '/' in the password its parser takes the piece before it
for a port and quotes it (``... as 'S3cr'``). Every error now goes through
``hicache.core.redact``, which also knows the ``--url`` given on the command
line and hides a quoted piece of the password however short.
"""
from __future__ import annotations

import pytest

from hicache.cli import main


@pytest.mark.parametrize("cmd", ["du", "ls", "clear"])
@pytest.mark.parametrize("url,pieces", [
    ("redis://:S3cr/et@Pw@127.0.0.1:6390/0", ["S3cr", "et@Pw", "S3cr/et"]),
    ("redis://:S3cr/et@Pw@127.0.0.1:P/0", ["S3cr", "et@Pw"]),
    ("redis://u:ab/cdefgh@127.0.0.1:6390/0", ["'ab'", "cdefgh"]),  # a two-letter piece, quoted
])
def test_storage_commands_never_print_a_piece_of_the_password(cmd, url, pieces, capsys):
    rc = main(["storage", cmd, "--url", url, "--set", "storage.timeout_ms=200"])
    out, err = capsys.readouterr()
    assert rc == 2 and "cannot reach it" in err and "ValueError" in err, err
    for p in pieces:
        assert p not in out + err, (p, err)


def test_error_text_keeps_the_library_message_minus_the_secrets():
    from hicache.core.redact import error_text
    url = "redis://:S3cr/et@Pw@h:1/0"
    e = ValueError("Port could not be cast to integer value as 'S3cr'")
    assert error_text(e, url) == "ValueError: Port could not be cast to integer value as '***'"
    assert error_text(ConnectionError("Error 111 connecting to h:1."), url) == \
        "ConnectionError: Error 111 connecting to h:1."
