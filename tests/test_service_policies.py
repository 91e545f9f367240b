"""Each slow-reader policy with a reader that stalls, over real sockets.

Token events are padded with 64 KiB comments (``pad_bytes``, as in the slow-client experiment),
and both socket buffers on the slow path are pinned, as the experiments pin them: the server's
SO_SNDBUF (``sndbuf``; left alone, Linux grows it to ~4 MB) and the stalled client's SO_RCVBUF.
So the stall reaches the hub after a few tokens on any host. The naive policy stalls the
healthy stream too; the other four do not, and differ in what happens to the slow one.

The last tests hold the server's two bounds: clients that never read cannot keep the slots of a
``pause`` server past ``max_pause``, and a request that cannot be admitted ends with an error
after ``queue_timeout`` instead of waiting without an answer.
"""
from __future__ import annotations

import socket
import time
from typing import Any

import httpx
import pytest
from service_helpers import TIMEOUT, RawClient, lab_server, occupy_a_slot, wait_until

from labkit.hub import POLICIES

PAD = 64 * 1024
MAX_NEW = 128
SNDBUF = 256 * 1024  # the server's send buffer, pinned as the slow-client experiment pins it
RCVBUF = 4 * 1024  # a stalled client's receive buffer, pinned
BOUND = 20.0  # seconds any answer below may take; the starved server of issue 12 gave none in 30


def open_stream(server: Any, prompt: str, rcvbuf: int | None = None, max_new: int = MAX_NEW) -> RawClient:
    return RawClient(server.url, rcvbuf=rcvbuf).post("/v1/stream", {"prompt": prompt, "max_new_tokens": max_new})


def read_to_end_within(client: RawClient, seconds: float) -> list[Any]:
    """The whole response within ``seconds`` (pings do not extend the bound), or fail."""
    deadline = time.monotonic() + seconds
    client.sock.settimeout(seconds)
    client.read_until(lambda: time.monotonic() > deadline)
    assert client.ended, f"no complete answer within {seconds} s: {[kind for kind, _, _ in client.events]}"
    return client.events


def token_indices(events: list[Any]) -> list[int]:
    return [p["index"] for kind, p, _ in events if kind == "token"]


@pytest.mark.parametrize("policy", [p for p in POLICIES if p != "naive"])
def test_a_stalled_reader_does_not_hold_up_the_others(tiny_gpt2: Any, policy: str) -> None:
    """Under ``drop`` the engine runs on while the stall timer counts, so the stalled stream must
    outlast the timeout to be cancelled: 74-103 of 128 tokens were made by the drop here, close
    enough for a faster engine to finish first (a 0.6 s timeout saw all 128); of 480 (the tiny
    context is 512), 98-117 were made, and 367 with the 0.6 s timeout."""
    slow_new = 480 if policy == "drop" else MAX_NEW
    with lab_server(tiny_gpt2, policy=policy, pad_bytes=PAD, stall_timeout=0.25, sndbuf=SNDBUF,
                    max_pause=TIMEOUT) as server:
        slow = open_stream(server, "Hello world", rcvbuf=RCVBUF, max_new=slow_new)
        record = server.hub.record(slow.read_events(1)[0][1]["request_id"])  # then it reads nothing
        healthy = open_stream(server, "The quick brown fox")
        assert token_indices(healthy.read_to_end()) == list(range(MAX_NEW))
        assert not slow.ended
        if policy == "unbounded":
            wait_until(lambda: record.finish_reason == "length", what="the engine to finish the slow request")
        elif policy == "pause":
            wait_until(lambda: server.engine.stats()["paused"] == 1, what="the pause")
            assert record.released is None and server.engine.stats()["reserved_blocks"] > 0
        else:
            wait_until(lambda: record.finish_reason == "cancelled", what="the drop")
        events = slow.read_to_end()
        if policy in ("drop", "pause_then_drop"):
            assert events[-1][0] == "error" and events[-1][1]["error"]["type"] == "slow_client"
            assert token_indices(events) == list(range(len(events) - 2))
            assert (record.pauses > 0) == (policy == "pause_then_drop")
        else:
            assert events[-1][0] == "done" and token_indices(events) == list(range(MAX_NEW))
            assert (record.pauses > 0) == (policy == "pause")


def test_the_naive_policy_stalls_every_stream_behind_one_slow_reader(tiny_gpt2: Any) -> None:
    with lab_server(tiny_gpt2, policy="naive", pad_bytes=PAD, sndbuf=SNDBUF) as server:
        slow = open_stream(server, "Hello world", rcvbuf=RCVBUF)
        slow.read_events(1)
        healthy = open_stream(server, "The quick brown fox")
        healthy.sock.settimeout(1.0)
        with pytest.raises(socket.timeout):
            healthy.read_to_end()  # stuck: the step loop waits for the slow reader
        assert not healthy.ended and len(token_indices(healthy.events)) < MAX_NEW
        slow.close_rst()  # the slow reader leaves, and the step loop is free again
        healthy.sock.settimeout(TIMEOUT)
        assert token_indices(healthy.read_to_end()) == list(range(MAX_NEW))


# -- the server's bounds -------------------------------------------------------------------------
def test_clients_that_never_read_hold_the_slots_of_a_pause_server_for_max_pause_at_most(tiny_gpt2: Any) -> None:
    with lab_server(tiny_gpt2, policy="pause", pad_bytes=PAD, sndbuf=SNDBUF, max_batch=2, high_water=4,
                    max_pause=0.5) as server:
        hogs = [open_stream(server, f"Hog number {i}", rcvbuf=RCVBUF) for i in range(4)]  # never read
        wait_until(lambda: server.engine.stats()["paused"] == 2, what="the first two hogs to pause")
        newcomer = RawClient(server.url).post("/v1/stream", {"prompt": "Hello", "max_new_tokens": 8})
        events = read_to_end_within(newcomer, BOUND)  # admitted once the paused hogs are dropped
        assert events[-1][0] == "done" and len(token_indices(events)) == 8
        assert server.hub.stats().dropped.get("slow_client", 0) >= 2
        for hog in hogs:
            hog.close_rst()


def test_a_request_that_cannot_be_admitted_ends_with_an_error_after_queue_timeout(tiny_gpt2: Any) -> None:
    with lab_server(tiny_gpt2, max_batch=1, queue_timeout=0.5) as server:
        holder = occupy_a_slot(server)  # paused in the engine: the only slot stays taken
        waiting = RawClient(server.url).post("/v1/stream", {"prompt": "Hello", "max_new_tokens": 8})
        events = read_to_end_within(waiting, BOUND)
        assert [kind for kind, _, _ in events] == ["start", "error"]
        assert events[-1][1]["error"]["type"] == "queue_timeout"
        with httpx.Client(base_url=server.url, timeout=BOUND) as http:
            response = http.post("/v1/generate", json={"prompt": "Hello", "max_new_tokens": 8})
        assert response.status_code == 503 and response.json()["error"]["type"] == "queue_timeout"
        # both leave the queue: the engine applies the hub's cancels at its next step boundary, on its own thread
        wait_until(lambda: server.engine.stats()["waiting"] == 0, what="both to leave the engine's queue")
        holder.close_rst()
