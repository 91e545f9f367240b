"""Shutdown: stop admitting (503), end every open stream with ``error: shutdown``, release all."""
from __future__ import annotations

from typing import Any

import httpx

from service_helpers import TIMEOUT, RawClient, lab_server, occupy_a_slot


def open_and_hold(server: Any, count: int) -> list[RawClient]:
    """``count`` running streams, paused in the engine so they stay open until the drain."""
    return [occupy_a_slot(server) for _ in range(count)]


def test_drain_ends_open_streams_with_a_shutdown_error_then_refuses_with_503(tiny_gpt2: Any) -> None:
    with lab_server(tiny_gpt2) as server:
        clients = open_and_hold(server, 4)
        server.drain()
        for client in clients:
            events = client.read_to_end()
            assert client.ended and events[-1][0] == "error"
            assert events[-1][1]["error"]["type"] == "shutdown"
        with httpx.Client(base_url=server.url, timeout=TIMEOUT) as http:
            for path in ("/v1/stream", "/v1/generate", "/v1/completions"):
                response = http.post(path, json={"prompt": "x"})
                assert response.status_code == 503 and response.json()["error"]["type"] == "draining"
                assert response.headers["retry-after"] == "1"
            assert http.get("/healthz").status_code == 503
        assert server.hub.stats().ends == {"shutdown": 4}


def test_leaving_the_server_ends_streams_whose_clients_never_read(tiny_gpt2: Any) -> None:
    with lab_server(tiny_gpt2, check_settled=False, drain_grace=0.5) as server:
        clients = open_and_hold(server, 2)
    for client in clients:  # what was written before the server went away
        events = client.read_to_end()
        assert client.ended and events[-1][0] == "error" and events[-1][1]["error"]["type"] == "shutdown"


def test_healthz_is_ok_while_serving(tiny_gpt2: Any) -> None:
    with lab_server(tiny_gpt2) as server, httpx.Client(base_url=server.url, timeout=TIMEOUT) as http:
        response = http.get("/healthz")
        assert response.status_code == 200 and response.json() == {"status": "ok", "model": "tiny-gpt2"}
