"""A client that leaves mid-stream, by FIN or by RST: the engine drops the sequence within one step
and every block comes back; with the write-only response nobody notices and generation runs on."""
from __future__ import annotations

import random
from typing import Any

import pytest
from service_helpers import RawClient, lab_server, occupy_a_slot, wait_until

MAX_NEW = 400  # far more than a client reads before it leaves; tiny-gpt2's context is 512


def leave_after(server: Any, how: str, tokens: int, max_new: int = MAX_NEW) -> Any:
    """Open a stream, read its start and ``tokens`` tokens, close the socket; return the record."""
    client = RawClient(server.url).post("/v1/stream", {"prompt": "Hello world", "max_new_tokens": max_new})
    rid = client.read_events(1 + tokens)[0][1]["request_id"]
    client.close(how)
    record = server.hub.record(rid)
    wait_until(lambda: record.released is not None, what="the engine to release the sequence")
    return record


@pytest.mark.parametrize("how", ["fin", "rst"])
def test_a_client_that_leaves_is_dropped_within_one_step(tiny_gpt2: Any, how: str) -> None:
    with lab_server(tiny_gpt2, response_class="starlette") as server:
        record = leave_after(server, how, tokens=3)
        assert record.finish_reason == "cancelled" and record.end == "client_gone"
        assert record.tokens_generated < MAX_NEW
        # the step in flight when close() ran may finish; the next one applies the cancel
        assert record.release_step - record.steps_at_close <= 1
        assert server.hub.stats().late_events >= 1  # the cancelled finish found the stream closed


@pytest.mark.parametrize("response_class, reason", [("starlette", "cancelled"), ("write_only", "length")])
def test_only_a_listening_response_notices_the_client_leave(tiny_gpt2: Any, response_class: str, reason: str) -> None:
    with lab_server(tiny_gpt2, response_class=response_class) as server:
        record = leave_after(server, "rst", tokens=2, max_new=120)
        assert record.finish_reason == reason
        wasted = record.tokens_generated - 2
        assert (wasted >= 120 - 2) == (response_class == "write_only")


def test_a_waiting_stream_whose_client_leaves_is_never_admitted(tiny_gpt2: Any) -> None:
    with lab_server(tiny_gpt2, max_batch=1) as server:
        running = occupy_a_slot(server)
        waiting = RawClient(server.url).post("/v1/stream", {"prompt": "Hi", "max_new_tokens": 100})
        record = server.hub.record(waiting.read_events(1)[0][1]["request_id"])
        waiting.close_fin()
        wait_until(lambda: record.released is not None, what="the cancel")
        assert record.finish_reason == "cancelled" and record.tokens_generated == 0
        running.close_rst()


@pytest.mark.parametrize("path, body", [("/v1/generate", {"prompt": "Hi", "max_new_tokens": 100}),
                                        ("/v1/completions", {"prompt": "Hi", "max_tokens": 100})])
def test_a_whole_answer_client_that_leaves_cancels_its_request(tiny_gpt2: Any, path: str,
                                                               body: dict[str, Any]) -> None:
    with lab_server(tiny_gpt2, max_batch=1) as server:
        running = occupy_a_slot(server)
        leaver = RawClient(server.url).post(path, body)
        wait_until(lambda: len(server.hub.records()) == 2, what="the generate request to be submitted")
        record = server.hub.records()[-1]
        leaver.close_rst()
        wait_until(lambda: record.released is not None, what="the cancel")
        assert record.finish_reason == "cancelled" and record.tokens_generated == 0
        running.close_rst()


def test_many_clients_leaving_at_random_leak_nothing(tiny_gpt2: Any) -> None:
    rng = random.Random(0)
    with lab_server(tiny_gpt2, max_batch=4) as server:
        clients = []
        for i in range(24):
            client = RawClient(server.url).post("/v1/stream", {"prompt": f"Story {i}:", "max_new_tokens": 40})
            clients.append((client, rng.choice(["fin", "rst", "read"]), rng.randint(0, 10)))
        for client, how, tokens in clients:
            if how == "read":
                assert client.read_to_end()[-1][0] == "done"
                client.close_fin()
            else:
                client.read_events(1 + tokens)
                client.close(how)
        # lab_server checks: every stream closed, every block back, cache whole, no thread left
    records = server.hub.records()
    assert len(records) == 24 and all(r.closed is not None and r.released is not None for r in records)
