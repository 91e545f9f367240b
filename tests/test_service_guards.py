"""What every request passes before a route: the Host check, Retry-After on 503, the lab routes'
and the API docs' opt-in, and the flood's bounds."""
from __future__ import annotations

import argparse
import socket
from typing import Any

import httpx
import pytest
from service_helpers import TIMEOUT, lab_server

from labkit.service.guards import host_name


def get(server: Any, path: str, host: str) -> httpx.Response:
    with httpx.Client(base_url=server.url, timeout=TIMEOUT) as client:
        return client.get(path, headers={"Host": host})


@pytest.mark.parametrize("value, name", [("localhost", "localhost"), ("LocalHost:8000", "localhost"),
                                         ("127.0.0.1:1", "127.0.0.1"), ("[::1]:80", "[::1]"), ("[::1]", "[::1]"),
                                         ("evil.example:8000", "evil.example"), ("::1", "::1")])
def test_host_name_drops_the_port_and_case(value: str, name: str) -> None:
    assert host_name(value) == name


@pytest.mark.parametrize("value", ["localhost:evil.com", "[::1]x", "localhost:", "[::1]:", "localhost@evil.com"])
def test_a_host_that_is_not_a_name_and_a_port_is_not_read_as_one(value: str) -> None:
    """A hostile review sent these and got 200: the parser kept '[::1]' or 'localhost' and dropped the rest."""
    assert host_name(value) not in ("localhost", "[::1]", "127.0.0.1")


def test_only_loopback_names_are_served_by_default(tiny_gpt2: Any) -> None:
    """A DNS-rebinding page reaches 127.0.0.1 under its own name, and the browser sends that name."""
    with lab_server(tiny_gpt2) as server:
        for host in ("localhost", f"localhost:{server.port}", f"127.0.0.1:{server.port}", "[::1]:8000"):
            assert get(server, "/healthz", host).status_code == 200, host
        for host in ("evil.example", f"evil.example:{server.port}", "127.0.0.1.evil.example", "localhost.:80"):
            refused = get(server, "/healthz", host)
            assert refused.status_code == 400, host
            assert refused.json()["error"]["type"] == "invalid_host"
        with httpx.Client(base_url=server.url, timeout=TIMEOUT) as client:
            posted = client.post("/v1/generate", json={"prompt": "Hi", "max_new_tokens": 2},
                                 headers={"Host": "evil.example"})
        assert posted.status_code == 400 and server.hub.stats().ends == {}


def raw_get(server: Any, head: bytes) -> bytes:
    """One request on a raw socket, read until the server closes."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=TIMEOUT) as sock:
        sock.sendall(head)
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    return data


def test_http_1_0_needs_no_host_and_http_1_1_does(tiny_gpt2: Any) -> None:
    """Host is optional in HTTP/1.0 (RFC 1945) and mandatory in HTTP/1.1 (RFC 9112 3.2). No browser
    sends HTTP/1.0, so a request without Host is no DNS-rebinding page; a named host is checked."""
    with lab_server(tiny_gpt2) as server:
        assert raw_get(server, b"GET /healthz HTTP/1.0\r\n\r\n").startswith(b"HTTP/1.1 200 ")
        assert raw_get(server, b"GET /healthz HTTP/1.0\r\nHost: evil.example\r\n\r\n").startswith(b"HTTP/1.1 400 ")
        assert raw_get(server, b"GET /healthz HTTP/1.1\r\nConnection: close\r\n\r\n").startswith(b"HTTP/1.1 400 ")


def test_the_api_docs_are_served_only_when_asked_for(tiny_gpt2: Any) -> None:
    """The docs page loads its scripts from a CDN: a server that never asked for it serves none."""
    from labkit.server import add_serve_arguments, config_from_args

    with lab_server(tiny_gpt2) as server:
        for path in ("/docs", "/redoc", "/openapi.json"):
            assert get(server, path, "localhost").status_code == 404, path
    with lab_server(tiny_gpt2, docs=True) as server:
        for path in ("/docs", "/redoc", "/openapi.json"):
            assert get(server, path, "localhost").status_code == 200, path
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    assert config_from_args(parser.parse_args([])).http.docs is False
    assert config_from_args(parser.parse_args(["--docs"])).http.docs is True


def test_allowed_hosts_are_configurable(tiny_gpt2: Any) -> None:
    with lab_server(tiny_gpt2, allowed_hosts=("api.test",)) as server:
        assert get(server, "/healthz", "api.test:8000").status_code == 200
        assert get(server, "/healthz", "localhost").status_code == 400
    with lab_server(tiny_gpt2, allowed_hosts=("*",)) as server:
        assert get(server, "/healthz", "anything.example").status_code == 200


def test_lab_routes_are_mounted_only_when_asked_for(tiny_gpt2: Any) -> None:
    with lab_server(tiny_gpt2, lab_routes=False) as server:
        assert get(server, "/lab/streams", "localhost").status_code == 404
        with httpx.Client(base_url=server.url, timeout=TIMEOUT) as client:
            assert client.post("/lab/flood", json={"count": 1}).status_code == 404
    with lab_server(tiny_gpt2) as server:  # serve_in_thread is the lab's own server: on
        assert get(server, "/lab/streams", "localhost").status_code == 200


def test_labkit_serve_leaves_the_lab_routes_off() -> None:
    from labkit.service.config import ServiceConfig

    assert ServiceConfig().http.lab_routes is False


@pytest.mark.parametrize("body", [
    {"event_bytes": (1 << 20) + 1, "count": 1},  # one event over 1 MiB
    {"event_bytes": 32, "count": 1_000_001},  # over a million events
    {"event_bytes": 1 << 20, "count": 65},  # 65 MiB in all
    {"event_bytes": 16 * 2**20, "count": 1_000_000},  # the 16 TB a request could ask for before
])
def test_a_flood_beyond_its_bounds_is_refused_with_422(tiny_gpt2: Any, body: dict[str, int]) -> None:
    with lab_server(tiny_gpt2) as server, httpx.Client(base_url=server.url, timeout=TIMEOUT) as client:
        with client.stream("POST", "/lab/flood", json=body) as refused:  # never read a flood to its end
            assert refused.status_code == 422
            assert refused.read() and refused.json()["error"]["type"] == "invalid_request"


def test_a_flood_at_its_bounds_is_accepted(tiny_gpt2: Any) -> None:
    with lab_server(tiny_gpt2) as server, httpx.Client(base_url=server.url, timeout=TIMEOUT) as client:
        with client.stream("POST", "/lab/flood", json={"event_bytes": 1 << 20, "count": 2}) as response:
            assert response.status_code == 200
            assert sum(len(chunk) for chunk in response.iter_bytes()) == 2 << 20


def test_a_health_probe_by_head_gets_the_status_without_a_body(tiny_gpt2: Any) -> None:
    """A load balancer or ``curl -I`` probes with HEAD: a 405 would read as a failing server."""
    with lab_server(tiny_gpt2) as server, httpx.Client(base_url=server.url, timeout=TIMEOUT) as client:
        for path in ("/healthz", "/health"):
            head = client.head(path)
            assert head.status_code == 200 and head.content == b"", (path, head.status_code)
            assert head.headers["content-type"] == "application/json"


@pytest.mark.parametrize("path, method", [("/v1/stream/", "POST"), ("/healthz/", "GET"), ("/v1/streams/x/events/", "GET")])
def test_a_trailing_slash_is_an_unknown_path_not_a_redirect(tiny_gpt2: Any, path: str, method: str) -> None:
    """Starlette's redirect carried the query (a resume ?token=) to a Location built from Host."""
    with lab_server(tiny_gpt2) as server, httpx.Client(base_url=server.url, timeout=TIMEOUT) as client:
        response = client.request(method, path + "?token=secret", json={"prompt": "x"} if method == "POST" else None)
    assert response.status_code == 404 and response.json()["error"]["type"] == "not_found", response.status_code
    assert "location" not in response.headers
