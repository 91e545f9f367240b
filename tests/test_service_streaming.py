"""POST /v1/stream and POST /v1/generate over real uvicorn: order, schema, ids, headers, agreement."""
from __future__ import annotations

import asyncio
from typing import Any

import httpx
import httpx_sse
import pytest
from engine_helpers import with_eos
from service_helpers import (
    PROMPTS,
    TIMEOUT,
    RawClient,
    decode_event_sse,
    lab_server,
    occupy_a_slot,
    sse_post,
    text_of,
    tokens_of,
    wait_until,
)


@pytest.fixture(scope="module")
def server_settings() -> dict[str, Any]:
    return {"max_batch": 8}


def generate(client: httpx.Client, **body: Any) -> dict[str, Any]:
    response = client.post("/v1/generate", json=body)
    assert response.status_code == 200, response.text
    assert response.headers["x-request-id"] == response.json()["request_id"]
    return response.json()


def test_stream_events_come_in_order_with_schema_ids_and_headers(server: Any) -> None:
    with httpx.Client(base_url=server.url, timeout=TIMEOUT) as client:
        response, events = sse_post(client, "/v1/stream", {"prompt": "Hello world", "max_new_tokens": 6})
    kinds = [kind for kind, _, _ in events]
    assert kinds == ["start"] + ["token"] * 6 + ["done"]
    assert [event_id for _, _, event_id in events] == [str(i) for i in range(1, 9)]
    start, done = events[0][1], events[-1][1]
    assert [p["index"] for kind, p, _ in events if kind == "token"] == list(range(6))
    assert response.headers["content-type"] == "text/event-stream; charset=utf-8"
    assert response.headers["cache-control"] == "no-cache"
    assert response.headers["x-accel-buffering"] == "no"
    assert response.headers["x-request-id"] == start["request_id"]
    assert start["model"] == "tiny-gpt2" and start["prompt_tokens"] == done["usage"]["prompt_tokens"] == 2
    assert done == {"finish_reason": "length", "usage": {"prompt_tokens": 2, "completion_tokens": 6}}


def test_stream_and_generate_agree(server: Any) -> None:
    body = {"prompt": "The capital of Italy is", "max_new_tokens": 12}
    with httpx.Client(base_url=server.url, timeout=TIMEOUT) as client:
        _, events = sse_post(client, "/v1/stream", body)
        whole = generate(client, **body)
    done = events[-1][1]
    assert whole["token_ids"] == tokens_of(events)
    assert whole["text"] == text_of(events)
    assert whole["usage"] == done["usage"] and whole["finish_reason"] == done["finish_reason"]
    assert whole["model"] == events[0][1]["model"]


def test_a_stop_string_ends_the_stream_with_reason_stop(server: Any) -> None:
    with httpx.Client(base_url=server.url, timeout=TIMEOUT) as client:
        full = generate(client, prompt="Once upon a time,", max_new_tokens=24)["text"]
        stop = full[len(full) // 3: len(full) // 3 + 3]
        assert stop.strip(), f"pick a better prompt: {full!r}"
        _, events = sse_post(client, "/v1/stream", {"prompt": "Once upon a time,", "max_new_tokens": 24, "stop": stop})
    assert events[-1][1]["finish_reason"] == "stop"
    text = text_of(events)
    assert stop not in text and full.startswith(text)


def test_sampling_with_a_seed_is_repeatable(server: Any) -> None:
    body = {"prompt": "Water boils at", "max_new_tokens": 10, "temperature": 0.9, "top_p": 0.9, "seed": 7}
    with httpx.Client(base_url=server.url, timeout=TIMEOUT) as client:
        first, second = generate(client, **body), generate(client, **body)
    assert first["token_ids"] == second["token_ids"]


def test_ignore_eos_runs_a_stream_past_eos_to_its_limit(server: Any, tiny_gpt2: Any) -> None:
    body = {"prompt": "Water boils at", "max_new_tokens": 8}
    with httpx.Client(base_url=server.url, timeout=TIMEOUT) as client:
        free_run = generate(client, **body)["token_ids"]
    with lab_server(with_eos(tiny_gpt2, free_run[2])) as eos_server:
        with httpx.Client(base_url=eos_server.url, timeout=TIMEOUT) as client:
            ended = generate(client, **body)
            ignored = generate(client, **body, ignore_eos=True)
    assert ended["finish_reason"] == "eos" and ended["token_ids"] == free_run[: free_run.index(free_run[2]) + 1]
    assert ignored["finish_reason"] == "length" and ignored["token_ids"] == free_run


def test_concurrent_streams_equal_their_solo_runs(server: Any) -> None:
    bodies = [{"prompt": p, "max_new_tokens": 16} for p in PROMPTS]
    with httpx.Client(base_url=server.url, timeout=TIMEOUT) as client:
        solo = [generate(client, **body)["token_ids"] for body in bodies]

    async def one(client: httpx.AsyncClient, body: dict[str, Any]) -> list[int]:
        async with httpx_sse.aconnect_sse(client, "POST", "/v1/stream", json=body) as source:
            events = [decode_event_sse(sse) async for sse in source.aiter_sse()]
        assert events[-1][0] == "done"
        return tokens_of(events)

    async def together() -> list[list[int]]:
        async with httpx.AsyncClient(base_url=server.url, timeout=TIMEOUT) as client:
            return await asyncio.gather(*(one(client, body) for body in bodies))

    assert asyncio.run(together()) == solo


def test_a_quiet_stream_gets_keepalive_pings(tiny_gpt2: Any) -> None:
    with lab_server(tiny_gpt2, max_batch=1, keepalive_interval=0.02) as server:
        blocker = occupy_a_slot(server)  # the next stream waits for the slot, quietly
        quiet = RawClient(server.url).post("/v1/stream", {"prompt": "Hi", "max_new_tokens": 4})
        quiet.read_events(1)
        quiet.read_until(lambda: quiet.raw.count(b": ping\n\n") >= 3)
        assert quiet.raw.count(b": ping\n\n") >= 3 and [k for k, _, _ in quiet.events] == ["start"]
        blocker.close_rst()
        events = quiet.read_to_end()
        assert [k for k, _, _ in events] == ["start"] + ["token"] * 4 + ["done"]
        assert [event_id for _, _, event_id in events] == [str(i) for i in range(1, 7)]


def test_pad_bytes_pads_each_token_event_with_a_comment_of_that_size(tiny_gpt2: Any) -> None:
    body = {"prompt": "Hello world", "max_new_tokens": 5}
    with lab_server(tiny_gpt2, pad_bytes=4096) as server:
        with httpx.Client(base_url=server.url, timeout=TIMEOUT) as client:
            plain = generate(client, **body)
        raw = RawClient(server.url).post("/v1/stream", body)
        events = raw.read_to_end()
    comment = b": " + b"x" * (4096 - 4) + b"\n\n"
    assert raw.raw.count(comment) == 5
    assert tokens_of(events) == plain["token_ids"]


def test_step_end_delivery_streams_the_same_tokens(tiny_gpt2: Any, server: Any) -> None:
    body = {"prompt": "def fibonacci(n):", "max_new_tokens": 10}
    with httpx.Client(base_url=server.url, timeout=TIMEOUT) as client:
        expected = generate(client, **body)["token_ids"]
    with lab_server(tiny_gpt2, first_token="step_end") as other:
        with httpx.Client(base_url=other.url, timeout=TIMEOUT) as client:
            _, events = sse_post(client, "/v1/stream", body)
    assert tokens_of(events) == expected


def test_records_keep_the_per_stream_timestamps(server: Any) -> None:
    with httpx.Client(base_url=server.url, timeout=TIMEOUT) as client:
        _, events = sse_post(client, "/v1/stream", {"prompt": "Dear Sir or Madam,", "max_new_tokens": 4})
        rid = events[0][1]["request_id"]
        wait_until(lambda: client.get(f"/lab/streams/{rid}").json()["closed"] is not None, what="the close")
        record = client.get(f"/lab/streams/{rid}").json()
    assert record["submitted"] <= record["first_token_sampled"] <= record["first_token_queued"]
    assert record["first_token_queued"] <= record["first_token_taken"] <= record["closed"]
    assert record["released"] is not None and record["end"] == "length"
    assert record["tokens_generated"] == record["tokens_delivered"] == 4
