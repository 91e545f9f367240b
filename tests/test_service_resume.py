"""Resumable streams: a client that disconnects and comes back gets exactly the events it missed."""
from __future__ import annotations

from typing import Any

import httpx
import httpx_sse
import pytest

from service_helpers import TIMEOUT, RawClient, decode_event_sse, lab_server, tokens_of, wait_until

BODY = {"prompt": "Once upon a time,", "max_new_tokens": 24, "resumable": True}


def resume(client: httpx.Client, rid: str, *, last_id: int | None = None, after: int | None = None) -> list[Any]:
    headers = {} if last_id is None else {"Last-Event-ID": str(last_id)}
    params = {} if after is None else {"after": after}
    with httpx_sse.connect_sse(client, "GET", f"/v1/streams/{rid}/events", headers=headers, params=params) as source:
        assert source.response.headers["x-request-id"] == rid
        return [decode_event_sse(sse) for sse in source.iter_sse()]


def solo_tokens(client: httpx.Client) -> list[int]:
    body = {k: v for k, v in BODY.items() if k != "resumable"}
    return client.post("/v1/generate", json=body).json()["token_ids"]


@pytest.mark.parametrize("cursor", ["last_id", "after"])
def test_resume_after_a_disconnect_gets_exactly_the_missed_events(tiny_gpt2: Any, cursor: str) -> None:
    with lab_server(tiny_gpt2) as server, httpx.Client(base_url=server.url, timeout=TIMEOUT) as client:
        first = RawClient(server.url).post("/v1/stream", BODY)
        seen = first.read_events(6)[:6]  # start + 5 tokens
        first.close_rst()
        rid = seen[0][1]["request_id"]
        rest = resume(client, rid, **{cursor: 6})
        events = seen + rest
        assert [int(event_id) for _, _, event_id in events] == list(range(1, len(events) + 1))
        assert events[-1][0] == "done" and tokens_of(events) == solo_tokens(client)
        record = server.hub.record(rid)
        assert record.finish_reason == "length"  # the run went on while nobody was connected


def test_a_finished_stream_answers_204_and_replays_any_tail(tiny_gpt2: Any) -> None:
    with lab_server(tiny_gpt2) as server, httpx.Client(base_url=server.url, timeout=TIMEOUT) as client:
        with httpx_sse.connect_sse(client, "POST", "/v1/stream", json=BODY) as source:
            events = [decode_event_sse(sse) for sse in source.iter_sse()]
        rid, last = events[0][1]["request_id"], len(events)
        wait_until(lambda: server.service.resume.get(rid).finished, what="the log to finish")
        assert client.get(f"/v1/streams/{rid}/events", headers={"Last-Event-ID": str(last)}).status_code == 204
        assert resume(client, rid, after=last - 2) == events[-2:]
        assert resume(client, rid, after=0) == events


@pytest.mark.parametrize("path, status", [("/v1/streams/req-nope/events", 404),
                                          ("/v1/streams/{rid}/events?after=abc", 422),
                                          ("/v1/streams/{rid}/events?after=9999", 422),
                                          ("/v1/streams/{rid}/events?after=%C2%B2", 422),
                                          ("/v1/streams/{rid}/events?after=" + "9" * 5000, 422)])
def test_unknown_streams_and_bad_cursors_are_refused_before_the_stream(tiny_gpt2: Any, path: str, status: int) -> None:
    with lab_server(tiny_gpt2) as server, httpx.Client(base_url=server.url, timeout=TIMEOUT) as client:
        with httpx_sse.connect_sse(client, "POST", "/v1/stream", json=BODY) as source:
            rid = decode_event_sse(next(iter(source.iter_sse())))[1]["request_id"]
        response = client.get(path.format(rid=rid))
        assert response.status_code == status and "error" in response.json()


def test_a_run_nobody_comes_back_for_is_cancelled_after_the_grace_period(tiny_gpt2: Any) -> None:
    with lab_server(tiny_gpt2, max_batch=1, resume_grace=0.2) as server:
        client = RawClient(server.url).post("/v1/stream", {**BODY, "max_new_tokens": 400})
        rid = client.read_events(3)[0][1]["request_id"]
        client.close_fin()
        record = server.hub.record(rid)
        wait_until(lambda: record.released is not None, what="the cancel after the grace period")
        assert record.finish_reason == "cancelled" and record.tokens_generated < 400
        with httpx.Client(base_url=server.url, timeout=TIMEOUT) as http:
            assert http.get(f"/v1/streams/{rid}/events").status_code == 404


def test_a_stream_longer_than_the_log_cannot_be_resumable(tiny_gpt2: Any) -> None:
    with lab_server(tiny_gpt2, resume_log_events=16) as server, httpx.Client(base_url=server.url) as client:
        response = client.post("/v1/stream", json={**BODY, "max_new_tokens": 15})
        assert response.status_code == 422 and response.json()["error"]["type"] == "invalid_request"
