"""Each slow-reader policy with a reader that stalls, over real sockets.

Token events are padded with 64 KiB comments (``pad_bytes``, as in the slow-client experiment),
so the ~4 MB that Linux lets a server's send buffer grow to (plus the stalled client's small
receive buffer: it grows only while its owner reads) fills after about 70 tokens of a 128-token
stream: from then on the stall reaches the hub. The naive policy stalls the
healthy stream too; the other four do not, and differ in what happens to the slow one.
"""
from __future__ import annotations

import socket
from typing import Any

import pytest

from labkit.hub import POLICIES
from service_helpers import TIMEOUT, RawClient, lab_server, wait_until

PAD = 64 * 1024
MAX_NEW = 128


def open_stream(server: Any, prompt: str) -> RawClient:
    return RawClient(server.url).post("/v1/stream", {"prompt": prompt, "max_new_tokens": MAX_NEW})


def token_indices(events: list[Any]) -> list[int]:
    return [p["index"] for kind, p, _ in events if kind == "token"]


@pytest.mark.parametrize("policy", [p for p in POLICIES if p != "naive"])
def test_a_stalled_reader_does_not_hold_up_the_others(tiny_gpt2: Any, policy: str) -> None:
    with lab_server(tiny_gpt2, policy=policy, pad_bytes=PAD, stall_timeout=0.25) as server:
        slow = open_stream(server, "Hello world")
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
    with lab_server(tiny_gpt2, policy="naive", pad_bytes=PAD) as server:
        slow = open_stream(server, "Hello world")
        slow.read_events(1)
        healthy = open_stream(server, "The quick brown fox")
        healthy.sock.settimeout(1.0)
        with pytest.raises(socket.timeout):
            healthy.read_to_end()  # stuck: the step loop waits for the slow reader
        assert not healthy.ended and len(token_indices(healthy.events)) < MAX_NEW
        slow.close_rst()  # the slow reader leaves, and the step loop is free again
        healthy.sock.settimeout(TIMEOUT)
        assert token_indices(healthy.read_to_end()) == list(range(MAX_NEW))
