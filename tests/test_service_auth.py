"""Bearer tokens on the /v1/ routes: off by default; when on, a request without a valid token is
refused with 401 before its first byte, and a token checked at a stream's start is not checked
again, so it fails only when the client comes back with it."""
from __future__ import annotations

import argparse
import time
from typing import Any

import httpx
import pytest
from service_helpers import TIMEOUT, RawClient, lab_server, sse_post, wait_until

from labkit.server import add_serve_arguments, config_from_args
from labkit.service.auth import InvalidToken, mint_token, verify_token
from labkit.service.config import ServiceConfig

SECRET = "a-lab-secret-of-32-characters-ok"
BODY = {"prompt": "Once upon a time,", "max_new_tokens": 8}


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


# -- the token ------------------------------------------------------------------------------------
def test_a_minted_token_verifies_until_its_expiry_and_names_its_subject() -> None:
    token = mint_token(SECRET, 60, "alice", now=1000.0)
    claims = verify_token(SECRET, token, now=1059.9)
    assert claims.subject == "alice" and claims.expires == 1060.0
    with pytest.raises(InvalidToken, match="expired"):
        verify_token(SECRET, token, now=1060.0)


@pytest.mark.parametrize("forge", [
    lambda t: mint_token("another-secret-of-enough-length", 60),  # signed with another secret
    lambda t: t[:-2] + ("AA" if not t.endswith("AA") else "BB"),  # signature changed
    lambda t: mint_token(SECRET, 60, "bob").split(".")[0] + "." + t.split(".")[1],  # claims swapped
    lambda t: t.replace(".", ""), lambda t: t + ".x", lambda t: "", lambda t: "é.é", lambda t: "x" * 600,
])
def test_a_forged_or_malformed_token_is_refused(forge: Any) -> None:
    with pytest.raises(InvalidToken):
        verify_token(SECRET, forge(mint_token(SECRET, 60)))


def test_minting_refuses_a_subject_or_lifetime_it_could_not_carry() -> None:
    for subject in ("", "a:b", "a b", "x" * 65):
        with pytest.raises(ValueError, match="subject"):
            mint_token(SECRET, 60, subject)
    for ttl in (0, -1, 86401):
        with pytest.raises(ValueError, match="ttl_s"):
            mint_token(SECRET, ttl)


def test_a_short_secret_is_refused_without_being_quoted_and_never_shows_in_a_repr() -> None:
    with pytest.raises(ValueError, match="auth_secret") as refused:
        ServiceConfig.of(auth_secret="short-secret")
    assert "short-secret" not in str(refused.value)
    assert SECRET not in repr(ServiceConfig.of(auth_secret=SECRET))


def test_the_secret_can_come_from_an_environment_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    monkeypatch.setenv("LAB_SECRET", SECRET)
    assert config_from_args(parser.parse_args(["--auth-secret-env", "LAB_SECRET"])).http.auth_secret == SECRET
    assert config_from_args(parser.parse_args(["--auth-secret", SECRET])).http.auth_secret == SECRET
    with pytest.raises(SystemExit):
        config_from_args(parser.parse_args(["--auth-secret-env", "LAB_SECRET", "--auth-secret", SECRET]))
    with pytest.raises(SystemExit):
        config_from_args(parser.parse_args(["--auth-secret-env", "NOT_SET_ANYWHERE_12345"]))


# -- the server -----------------------------------------------------------------------------------
def test_without_a_secret_no_route_asks_for_a_token(tiny_gpt2: Any) -> None:
    with lab_server(tiny_gpt2) as server, httpx.Client(base_url=server.url, timeout=TIMEOUT) as client:
        assert client.post("/v1/generate", json=BODY).status_code == 200
        assert client.post("/lab/token").status_code == 404


@pytest.mark.parametrize("path, body", [
    ("/v1/stream", BODY), ("/v1/generate", BODY),
    ("/v1/completions", {"prompt": "Hi", "max_tokens": 4, "stream": True}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "stream": True}),
])
def test_every_v1_route_refuses_a_request_without_a_valid_token_before_the_first_byte(
        tiny_gpt2: Any, path: str, body: dict[str, Any]) -> None:
    with lab_server(tiny_gpt2, auth_secret=SECRET) as server, httpx.Client(base_url=server.url,
                                                                          timeout=TIMEOUT) as client:
        cases = [
            ({}, 'Bearer realm="labkit"'),
            (bearer("not-a-token"), 'error="invalid_token"'),
            (bearer(mint_token(SECRET, 60, now=time.time() - 61)), 'error_description="the token expired"'),
            (bearer(mint_token("another-secret-of-enough-length", 60)), 'error="invalid_token"'),
            ({"Authorization": "Basic dXNlcjpwYXNz"}, 'error="invalid_request"'),
        ]
        for headers, challenge in cases:
            response = client.post(path, json=body, headers=headers)
            assert response.status_code == 401, (headers, response.text)
            assert response.headers["content-type"] == "application/json"
            assert response.json()["error"]["type"] == "unauthorized"
            assert challenge in response.headers["www-authenticate"]
        assert client.post(path, json=body, headers=bearer(server.token())).status_code == 200
        assert client.get("/healthz").status_code == 200 and client.get("/stats").status_code == 200
        assert len(server.hub.records()) == 1  # the refused ones never reached the hub


def test_a_request_without_a_token_is_refused_before_its_body_is_read(tiny_gpt2: Any) -> None:
    with lab_server(tiny_gpt2, auth_secret=SECRET, max_body_bytes=1024) as server:
        client = RawClient(server.url).request("POST", "/v1/stream", b"x" * 4096)
        client.read_to_end()
        assert client.status == 401  # not 413: nothing past the head was looked at


def test_the_lab_token_route_issues_tokens_the_server_accepts(tiny_gpt2: Any) -> None:
    with lab_server(tiny_gpt2, auth_secret=SECRET, auth_ttl_s=120) as server, \
            httpx.Client(base_url=server.url, timeout=TIMEOUT) as client:
        issued = client.post("/lab/token", params={"ttl_s": 30, "subject": "nb10"}).json()
        assert issued["token_type"] == "Bearer" and issued["expires_in"] == 30
        assert verify_token(SECRET, issued["token"]).subject == "nb10"
        assert client.post("/lab/token").json()["expires_in"] == 120  # the server's auth_ttl_s
        for params in ({"ttl_s": 0}, {"ttl_s": 86401}, {"subject": "a b"}):
            assert client.post("/lab/token", params=params).status_code == 422
        assert client.post("/v1/generate", json=BODY, headers=bearer(issued["token"])).status_code == 200


def test_a_token_that_expires_mid_stream_ends_nothing_but_cannot_resume(tiny_gpt2: Any) -> None:
    """The check is at the request's start: the stream runs on past the token's expiry; coming back
    with the stale token gets 401, and a fresh one gets the rest (here: 204, all was read)."""
    with lab_server(tiny_gpt2, auth_secret=SECRET) as server, \
            httpx.Client(base_url=server.url, timeout=TIMEOUT) as client:
        token = server.token(ttl_s=1.0)
        stream = RawClient(server.url).post("/v1/stream", {**BODY, "max_new_tokens": 40, "resumable": True},
                                            headers=bearer(token))
        start = stream.read_events(3)[0][1]
        rid = start["request_id"]
        server.engine.pause(rid)  # the stream stays open, making no tokens, until the token expires
        wait_until(lambda: _expired(token), what="the token to expire")
        server.engine.resume(rid)
        events = stream.read_to_end()
        assert stream.status == 200 and events[-1][0] == "done" and len(events) == 42
        path, resume = f"/v1/streams/{rid}/events", {"X-Resume-Token": start["resume_token"], "Last-Event-ID": "42"}
        stale = client.get(path, headers={**resume, **bearer(token)})
        assert stale.status_code == 401 and "expired" in stale.json()["error"]["message"]
        assert client.get(path, headers={**resume, **bearer(server.token())}).status_code == 204


def _expired(token: str) -> bool:
    try:
        verify_token(SECRET, token)
    except InvalidToken:
        return True
    return False


def test_a_stream_opened_with_a_token_reads_like_any_other(tiny_gpt2: Any) -> None:
    with lab_server(tiny_gpt2, auth_secret=SECRET) as server, \
            httpx.Client(base_url=server.url, timeout=TIMEOUT, headers=bearer(server.token())) as client:
        response, events = sse_post(client, "/v1/stream", BODY)
        assert response.status_code == 200 and [e[0] for e in events][-1] == "done"
