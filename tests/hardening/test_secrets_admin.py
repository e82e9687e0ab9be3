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


@pytest.mark.parametrize("cmd", ["du", "ls", "clear", "fsck"])
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


@pytest.mark.parametrize("url,shown", [
    ("redis://h:6379/0?password=w0rd#Tail", "redis://h:6379/0?password=***"),
    ("redis://h:6379/0?password=w0rd Tail&db=1", "redis://h:6379/0?password=***&db=1"),
    ("h:6379/0?ssl_password=ab#cdTail", "h:6379/0?ssl_password=***"),
])
def test_a_query_password_is_hidden_past_a_hash_or_a_space(url, shown):
    from hicache.core.redact import Redactor, redact_url
    assert redact_url(url) == shown
    r = Redactor()
    r.add_url(url)
    assert "Tail" not in r.text(f"cannot connect to {url} now") and "w0rd" not in r.text(f"to {url}")


def test_a_store_error_mid_command_is_one_redacted_line(monkeypatch, capsys):
    """A Redis error after the connection was made (a server that went away, an ACL
    reply) ends in one ``hicache: error:`` line without the password, for every command."""
    import redis
    from hicache.storage import admin

    class Failing:
        def du(self, prefix):
            raise redis.ConnectionError("Error 104 while writing to redis://:S3cretPw@127.0.0.1:6390/0")

    monkeypatch.setattr(admin, "open_store", lambda *a, **k: Failing())
    rc = main(["storage", "du", "--url", "redis://:S3cretPw@127.0.0.1:6390/0"])
    out, err = capsys.readouterr()
    assert rc == 2 and err.startswith("hicache: error: L3 redis://:***@127.0.0.1:6390/0: du stopped"), err
    assert "S3cretPw" not in out + err and err.count("\n") == 1
