"""Sync generators exhaust the thread pool: with 40 sync streams blocked between events, a sync
route waits for a thread while an async one answers at once; 40 async streams hold no thread."""
from __future__ import annotations

from typing import Any

import httpx
import pytest
from service_helpers import TIMEOUT, RawClient, lab_server, wait_until

TOKENS = 40  # AnyIO's default limiter (CapacityLimiter(40) per event loop); the test checks it is so
INTERVAL = 5.0  # each sync stream's sleep: long enough to look at the server while all of them block


def threads(client: httpx.Client) -> dict[str, int]:
    return client.get("/lab/threads").json()


def open_streams(url: str, kind: str, count: int) -> list[RawClient]:
    streams = [RawClient(url, decode=False).request("GET", f"/lab/slow/{kind}?n=2&interval={INTERVAL}")
               for _ in range(count)]
    for stream in streams:
        stream.read_until(lambda s=stream: b"event: tick" in s.raw)  # its first event: now it sleeps
    return streams


@pytest.mark.slow
def test_forty_blocked_sync_streams_queue_a_sync_health_check_but_not_the_async_one(tiny_gpt2: Any) -> None:
    with lab_server(tiny_gpt2) as server, httpx.Client(base_url=server.url, timeout=TIMEOUT) as client:
        assert threads(client) == {"total_tokens": TOKENS, "borrowed_tokens": 0, "tasks_waiting": 0}
        streams = open_streams(server.url, "sync", TOKENS)
        wait_until(lambda: threads(client)["borrowed_tokens"] == TOKENS, what="every thread to be sleeping")
        health = RawClient(server.url).request("GET", "/lab/healthz/sync")
        wait_until(lambda: threads(client)["tasks_waiting"] == 1, what="the sync health check to queue")
        assert client.get("/healthz").status_code == 200  # the async one answers meanwhile
        assert threads(client) == {"total_tokens": TOKENS, "borrowed_tokens": TOKENS, "tasks_waiting": 1}
        assert health.status is None  # still waiting for a thread, after the async one answered
        health.read_to_end()  # it gets one when a stream's sleep ends and its next() returns
        assert health.status == 200 and health.json()["status"] == "ok"
        for stream in streams:
            stream.read_to_end()
            assert stream.status == 200 and stream.raw.count(b"event: tick") == 2
        wait_until(lambda: threads(client)["borrowed_tokens"] == 0, what="every thread to be returned")


def test_forty_async_streams_hold_no_thread(tiny_gpt2: Any) -> None:
    with lab_server(tiny_gpt2) as server, httpx.Client(base_url=server.url, timeout=TIMEOUT) as client:
        streams = open_streams(server.url, "async", TOKENS)
        assert threads(client) == {"total_tokens": TOKENS, "borrowed_tokens": 0, "tasks_waiting": 0}
        assert client.get("/lab/healthz/sync").json()["status"] == "ok"
        for stream in streams:
            stream.close_fin()


def test_the_slow_routes_refuse_unbounded_requests(tiny_gpt2: Any) -> None:
    with lab_server(tiny_gpt2) as server, httpx.Client(base_url=server.url, timeout=TIMEOUT) as client:
        for query in ("n=0", "n=10001", "interval=-1", "interval=61"):
            for kind in ("sync", "async"):
                response = client.get(f"/lab/slow/{kind}?{query}")
                assert response.status_code == 422 and response.json()["error"]["type"] == "invalid_request"
