"""REST input bounds (issue 17, items 4-7).

Before the fix: an oversized body was parsed and echoed three times in the
422 (test_oversized_body...: 422 with the body inside, not 413); NaN,
Infinity and a lone-surrogate namespace made the default error handler fail
with a 500; a 5-character token was accepted for a non-loopback bind;
/v1/config answered without the token.
"""
from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from hicache.api.app import create_app
from hicache.api.deps import check_bind
from hicache.core.errors import ConfigError

LIMIT = 4096
TOKEN = "0123456789abcdef-token"


@pytest.fixture
def client(make_state):
    st = make_state({"service.max_request_bytes": str(LIMIT)})
    with TestClient(create_app(st)) as c:
        yield c


def test_oversized_body_is_refused_before_parsing(client):
    body = '{"tokens": [' + ",".join(["12345"] * 2000) + "]}"
    r = client.post("/v1/lookup", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 413 and "service.max_request_bytes" in r.json()["detail"]
    assert "12345" not in r.text and len(r.content) < 400


def test_oversized_chunked_body_is_cut_off(client):
    def chunks():
        yield b'{"tokens": ['
        for _ in range(2000):
            yield b"12345,"
        yield b"1]}"
    r = client.post("/v1/lookup", content=chunks(), headers={"content-type": "application/json"})
    assert r.status_code == 413 and "12345" not in r.text


@pytest.mark.parametrize("body", ['{"tokens": [NaN]}', '{"tokens": [Infinity]}', '{"tokens": [-Infinity, 1]}',
                                  '{"tokens": [1, 2], "namespace": "\\ud800"}',
                                  '{"tokens": ["' + "x" * 3000 + '"]}'])
def test_unencodable_or_bad_inputs_are_422_without_echo(client, body):
    r = client.post("/v1/lookup", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 422, r.text
    assert "xxxxxxxxxx" not in r.text and "input" not in r.json()["detail"][0]


def test_validation_errors_are_bounded(make_state):
    st = make_state()
    with TestClient(create_app(st)) as c:
        r = c.post("/v1/lookup", json={"tokens": ["a"] * 5000})
    assert r.status_code == 422 and len(r.json()["detail"]) == 11 and len(r.content) < 3000


@pytest.mark.parametrize("token", ["short", " " * 20, "abc def ghi jkl", "\t" * 8 + "x" * 15])
def test_short_or_blank_admin_tokens_are_refused_beyond_loopback(token):
    with pytest.raises(ConfigError, match="at least 16") as e:
        check_bind("0.0.0.0", token)
    assert token.strip() not in str(e.value) or not token.strip()
    check_bind("0.0.0.0", "x" * 16)
    check_bind("127.0.0.1", "short")  # loopback: admin routes are open, no token needed


def test_config_route_is_admin_when_a_token_is_set(make_state):
    st = make_state({"service.host": "0.0.0.0"}, admin_token=TOKEN)
    with TestClient(create_app(st)) as c:
        assert c.get("/v1/config").status_code == 401
        r = c.get("/v1/config", headers={"Authorization": f"Bearer {TOKEN}"})
        assert r.status_code == 200 and TOKEN not in r.text
