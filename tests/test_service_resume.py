"""Resumable streams: a client that disconnects and comes back gets exactly the events it missed,
and only the client that created a stream (it holds the resume token) can read it again."""
from __future__ import annotations

import time
from typing import Any

import httpx
import httpx_sse
import pytest
from service_helpers import TIMEOUT, RawClient, decode_event_sse, lab_server, sse_post, tokens_of, wait_until

BODY = {"prompt": "Once upon a time,", "max_new_tokens": 24, "resumable": True}


def resume(client: httpx.Client, rid: str, token: str, *, last_id: int | None = None, after: int | None = None,
           token_in: str = "header") -> list[Any]:
    headers = {} if last_id is None else {"Last-Event-ID": str(last_id)}
    params: dict[str, Any] = {} if after is None else {"after": after}
    if token_in == "header":
        headers["X-Resume-Token"] = token
    else:
        params["token"] = token
    with httpx_sse.connect_sse(client, "GET", f"/v1/streams/{rid}/events", headers=headers, params=params) as source:
        assert source.response.headers["x-request-id"] == rid
        return [decode_event_sse(sse) for sse in source.iter_sse()]


def solo_tokens(client: httpx.Client) -> list[int]:
    body = {k: v for k, v in BODY.items() if k != "resumable"}
    return client.post("/v1/generate", json=body).json()["token_ids"]


@pytest.mark.parametrize("cursor, token_in", [("last_id", "header"), ("after", "query")])
def test_resume_after_a_disconnect_gets_exactly_the_missed_events(tiny_gpt2: Any, cursor: str, token_in: str) -> None:
    with lab_server(tiny_gpt2) as server, httpx.Client(base_url=server.url, timeout=TIMEOUT) as client:
        first = RawClient(server.url).post("/v1/stream", BODY)
        seen = first.read_events(6)[:6]  # start + 5 tokens
        first.close_rst()
        rid, token = seen[0][1]["request_id"], seen[0][1]["resume_token"]
        assert first.headers["x-resume-token"] == token
        rest = resume(client, rid, token, token_in=token_in, **{cursor: 6})
        events = seen + rest
        assert [int(event_id) for _, _, event_id in events] == list(range(1, len(events) + 1))
        assert events[-1][0] == "done" and tokens_of(events) == solo_tokens(client)
        record = server.hub.record(rid)
        assert record.finish_reason == "length"  # the run went on while nobody was connected


def test_a_finished_stream_answers_204_and_replays_any_tail(tiny_gpt2: Any) -> None:
    with lab_server(tiny_gpt2) as server, httpx.Client(base_url=server.url, timeout=TIMEOUT) as client:
        with httpx_sse.connect_sse(client, "POST", "/v1/stream", json=BODY) as source:
            events = [decode_event_sse(sse) for sse in source.iter_sse()]
        rid, token, last = events[0][1]["request_id"], events[0][1]["resume_token"], len(events)
        wait_until(lambda: server.service.resume.get(rid).finished, what="the log to finish")
        headers = {"Last-Event-ID": str(last), "X-Resume-Token": token}
        assert client.get(f"/v1/streams/{rid}/events", headers=headers).status_code == 204
        assert resume(client, rid, token, after=last - 2) == events[-2:]
        assert resume(client, rid, token, after=0) == events


@pytest.mark.parametrize("path, status", [("/v1/streams/req-nope/events", 404),
                                          ("/v1/streams/{rid}/events?after=abc", 422),
                                          ("/v1/streams/{rid}/events?after=9999", 422),
                                          ("/v1/streams/{rid}/events?after=%C2%B2", 422),
                                          ("/v1/streams/{rid}/events?after=" + "9" * 5000, 422)])
def test_unknown_streams_and_bad_cursors_are_refused_before_the_stream(tiny_gpt2: Any, path: str, status: int) -> None:
    with lab_server(tiny_gpt2) as server, httpx.Client(base_url=server.url, timeout=TIMEOUT) as client:
        with httpx_sse.connect_sse(client, "POST", "/v1/stream", json=BODY) as source:
            start = decode_event_sse(next(iter(source.iter_sse())))[1]
        response = client.get(path.format(rid=start["request_id"]), headers={"X-Resume-Token": start["resume_token"]})
        assert response.status_code == status and "error" in response.json()


def test_a_bad_last_event_id_is_quoted_as_it_was_sent(server: Any) -> None:
    """A header's bytes are UTF-8 here (Starlette reads them as Latin-1: "²" came back as "Â²").
    The cursor is read before the stream is looked up, so no stream need exist."""
    with httpx.Client(base_url=server.url, timeout=TIMEOUT) as client:
        said = {}
        for sent in ["²", "7\udcff", "x" * 100]:
            value = sent.encode("utf-8", "surrogateescape")
            response = client.get("/v1/streams/req-nope/events", headers={"Last-Event-ID": value})
            assert response.status_code == 422, response.text
            said[sent] = response.json()["error"]["message"]
    assert said["²"] == "event id must be a non-negative integer, got '²'"
    assert said["7\udcff"].endswith("got " + repr("7\\xff"))  # not UTF-8: its byte, escaped
    assert said["x" * 100].endswith("got '" + "x" * 64 + "…'")  # cut as every echo is


def hold_in_the_engine(server: Any, rid: str) -> None:
    """Pause a running request in the engine: it stays alive, making no tokens, until cancelled.

    So only the grace timer can end it, however fast the engine: 400 unpaused tokens of the tiny
    model take about 0.5 s, near the grace periods below once the engine or the machine is faster."""
    paused = server.engine.stats()["paused"]
    server.engine.pause(rid)
    wait_until(lambda: server.engine.stats()["paused"] == paused + 1, what="the pause")


def test_a_run_nobody_comes_back_for_is_cancelled_after_the_grace_period(tiny_gpt2: Any) -> None:
    with lab_server(tiny_gpt2, max_batch=1, resume_grace=0.2) as server:
        client = RawClient(server.url).post("/v1/stream", {**BODY, "max_new_tokens": 400})
        start = client.read_events(3)[0][1]
        rid = start["request_id"]
        hold_in_the_engine(server, rid)
        client.close_fin()
        record = server.hub.record(rid)
        wait_until(lambda: record.released is not None, what="the cancel after the grace period")
        assert record.finish_reason == "cancelled" and record.tokens_generated < 400
        with httpx.Client(base_url=server.url, timeout=TIMEOUT) as http:
            response = http.get(f"/v1/streams/{rid}/events", headers={"X-Resume-Token": start["resume_token"]})
            assert response.status_code == 404


def test_a_stream_longer_than_the_log_cannot_be_resumable(tiny_gpt2: Any) -> None:
    with lab_server(tiny_gpt2, resume_log_events=16) as server, httpx.Client(base_url=server.url) as client:
        response = client.post("/v1/stream", json={**BODY, "max_new_tokens": 15})
        assert response.status_code == 422 and response.json()["error"]["type"] == "invalid_request"


def test_resumable_streams_are_bounded_in_number_and_a_finished_one_frees_its_place(tiny_gpt2: Any) -> None:
    """A resumable run outlives its connection by resume_grace: clients that open one and hang up
    at once must not be able to fill the batch and the queue for everyone else.

    The two refusals below must come within the grace of the first hang-up (about 40 ms after it
    here): a grace of 1 s leaves room for a slow machine, at the cost of waiting it out at the end."""
    with lab_server(tiny_gpt2, max_resumable=2, resumable_share=1.0, resume_grace=1.0) as server:
        first = [RawClient(server.url).post("/v1/stream", {**BODY, "max_new_tokens": 300}) for _ in range(2)]
        for client in first:
            client.read_events(2)
            client.close_fin()
        with httpx.Client(base_url=server.url, timeout=TIMEOUT) as http:
            refused = http.post("/v1/stream", json={**BODY, "max_new_tokens": 4})
            assert refused.status_code == 429 and refused.json()["error"]["type"] == "queue_full"
            assert refused.headers["Retry-After"] == "1"
            plain = http.post("/v1/stream", json={**BODY, "resumable": False, "max_new_tokens": 4})
            assert plain.status_code == 200, "only resumable streams count against the bound"
            wait_until(lambda: len(server.service.resume) == 0, what="the abandoned runs to expire")
            again = http.post("/v1/stream", json={**BODY, "max_new_tokens": 4})
            assert again.status_code == 200


def test_a_finished_log_expires_a_fixed_time_after_it_finished_however_often_it_is_replayed(tiny_gpt2: Any) -> None:
    """Issue 25: a replay re-armed the grace, so a client replaying its finished one-token streams
    kept them (and every resumable slot) for ever, at no engine cost. The replays here come ten
    times per grace, for up to twenty graces: only a fixed expiry ends them."""
    with lab_server(tiny_gpt2, resume_grace=0.5) as server, httpx.Client(base_url=server.url, timeout=TIMEOUT) as client:
        events = sse_post(client, "/v1/stream", {**BODY, "max_new_tokens": 1})[1]
        rid, token = events[0][1]["request_id"], events[0][1]["resume_token"]
        statuses = []
        for _ in range(200):
            response = client.get(f"/v1/streams/{rid}/events", params={"after": 0}, headers={"X-Resume-Token": token})
            statuses.append(response.status_code)
            if response.status_code == 404:
                break
            time.sleep(0.05)
        assert statuses[-1] == 404 and set(statuses[:-1]) == {200}, statuses
        assert len(server.service.resume) == 0


def test_one_client_may_hold_only_its_share_of_the_resumable_streams(tiny_gpt2: Any) -> None:
    """Clients are told apart by address: 127.0.0.2 is another client on the same loopback."""
    with lab_server(tiny_gpt2, max_resumable=4, resumable_share=0.5, retry_after_s=3) as server:
        mine = [RawClient(server.url).post("/v1/stream", {**BODY, "max_new_tokens": 300}) for _ in range(2)]
        for stream in mine:
            stream.read_events(2)
        with httpx.Client(base_url=server.url, timeout=TIMEOUT) as http:
            refused = http.post("/v1/stream", json={**BODY, "max_new_tokens": 4})
        assert refused.status_code == 429 and refused.headers["Retry-After"] == "3"
        error = refused.json()["error"]
        assert error["type"] == "queue_full" and "resumable_share" in error["message"], error
        other = httpx.HTTPTransport(local_address="127.0.0.2")
        with httpx.Client(base_url=server.url, timeout=TIMEOUT, transport=other) as http:
            served = sse_post(http, "/v1/stream", {**BODY, "max_new_tokens": 4})[1]
        assert served[-1][0] == "done"
        for stream in mine:
            stream.read_to_end()
            stream.close_fin()


@pytest.mark.parametrize("trusted", [(), ("127.0.0.1",)], ids=["no-proxy", "loopback-a-proxy"])
def test_a_client_names_itself_in_x_forwarded_for_only_through_a_trusted_proxy(tiny_gpt2: Any, trusted) -> None:
    """One peer that says it is two clients: by default it is one (its share is spent), and only
    when its address is a proxy the server was told to trust does the header name the client."""
    with lab_server(tiny_gpt2, max_resumable=2, resumable_share=0.5, forwarded_allow_ips=trusted) as server:
        first = RawClient(server.url).post("/v1/stream", {**BODY, "max_new_tokens": 300})
        first.read_events(2)
        with httpx.Client(base_url=server.url, timeout=TIMEOUT, headers={"X-Forwarded-For": "10.0.0.7"}) as http:
            second = http.post("/v1/stream", json={**BODY, "max_new_tokens": 4})
        assert second.status_code == (200 if trusted else 429), second.text
        first.close_rst()


# -- only the creator can resume -------------------------------------------------------------------
def refusal(client: httpx.Client, rid: str, headers: dict[str, str], params: dict[str, str]) -> dict[str, Any]:
    response = client.get(f"/v1/streams/{rid}/events", headers=headers, params=params)
    assert response.status_code == 404, response.status_code
    return response.json()


def test_the_resume_token_goes_to_the_creator_only_and_is_new_for_every_stream(tiny_gpt2: Any) -> None:
    with lab_server(tiny_gpt2) as server, httpx.Client(base_url=server.url, timeout=TIMEOUT) as client:
        starts = []
        for _ in range(2):
            with httpx_sse.connect_sse(client, "POST", "/v1/stream", json=BODY) as source:
                events = [decode_event_sse(sse) for sse in source.iter_sse()]
                assert source.response.headers["x-resume-token"] == events[0][1]["resume_token"]
            starts.append(events[0][1])
        assert starts[0]["resume_token"] != starts[1]["resume_token"] and len(starts[0]["resume_token"]) >= 32
        plain = sse_post(client, "/v1/stream", {k: v for k, v in BODY.items() if k != "resumable"})[1]
        assert "resume_token" not in plain[0][1]  # a stream that cannot be resumed has no token


def test_without_the_right_token_a_stream_looks_exactly_like_an_unknown_one(tiny_gpt2: Any) -> None:
    with lab_server(tiny_gpt2) as server, httpx.Client(base_url=server.url, timeout=TIMEOUT) as client:
        first = RawClient(server.url).post("/v1/stream", {**BODY, "max_new_tokens": 400})
        start = first.read_events(1)[0][1]
        rid, token = start["request_id"], start["resume_token"]
        other = RawClient(server.url).post("/v1/stream", BODY)
        other_token = other.read_events(1)[0][1]["resume_token"]
        unknown = refusal(client, "req-0123456789abcdef", {}, {})
        expected = {"error": {**unknown["error"],
                              "message": unknown["error"]["message"].replace("req-0123456789abcdef", rid)}}
        for headers, params in [({}, {}), ({"X-Resume-Token": token[:-1] + ("y" if token.endswith("x") else "x")}, {}), ({}, {"token": other_token}),
                                ({"X-Resume-Token": ""}, {}), ({}, {"token": "\u00e9" * 40}),
                                ({"Last-Event-ID": "999999"}, {})]:
            assert refusal(client, rid, headers, params) == expected, (headers, params)
        first.close_rst()
        other.close_rst()


def test_a_refused_attempt_does_not_keep_an_abandoned_stream_alive(tiny_gpt2: Any) -> None:
    with lab_server(tiny_gpt2, max_batch=1, resume_grace=0.3) as server:
        creator = RawClient(server.url).post("/v1/stream", {**BODY, "max_new_tokens": 400})
        rid = creator.read_events(3)[0][1]["request_id"]
        hold_in_the_engine(server, rid)
        creator.close_fin()  # the grace timer starts
        record = server.hub.record(rid)
        with httpx.Client(base_url=server.url, timeout=TIMEOUT) as intruder:
            deadline = time.monotonic() + TIMEOUT
            while record.released is None and time.monotonic() < deadline:  # knocks until the end
                with intruder.stream("GET", f"/v1/streams/{rid}/events") as response:
                    assert response.status_code == 404
                time.sleep(0.02)
        assert record.finish_reason == "cancelled" and record.tokens_generated < 400


def test_one_stream_has_at_most_max_followers_at_once_and_a_place_frees_when_one_leaves(tiny_gpt2: Any) -> None:
    """Each event wakes every follower of a stream and each replays from the log: one client that
    fanned its own stream out to hundreds of followers slowed every other stream (a hostile review)."""
    from labkit.service.resume import MAX_FOLLOWERS

    with lab_server(tiny_gpt2) as server, httpx.Client(base_url=server.url, timeout=TIMEOUT) as http:
        creator = RawClient(server.url).post("/v1/stream", {**BODY, "max_new_tokens": 200})
        start = creator.read_events(2)[0][1]
        rid, token = start["request_id"], start["resume_token"]
        server.engine.pause(rid)  # the run stands still, so every follower stays attached
        path, headers = f"/v1/streams/{rid}/events?after=1", {"X-Resume-Token": token}
        followers = [RawClient(server.url).request("GET", path, headers=headers) for _ in range(MAX_FOLLOWERS - 1)]
        for follower in followers:
            follower.read_events(1)
            assert follower.status == 200
        refused = http.get(path, headers=headers)
        assert refused.status_code == 429 and refused.json()["error"]["type"] == "queue_full", refused.text
        assert "followers" in refused.json()["error"]["message"] and refused.headers["Retry-After"]
        followers.pop().close_fin()
        wait_until(lambda: server.service.resume.get(rid).followers < MAX_FOLLOWERS, what="the follower to leave")
        again = RawClient(server.url).request("GET", path, headers=headers)
        assert again.read_events(1) and again.status == 200
        server.engine.resume(rid)
        for client in (creator, again, *followers):
            assert client.read_to_end()[-1][0] == "done"


def test_resume_requests_borrow_no_thread(server: Any) -> None:
    """A plain ``def`` dependency runs in AnyIO's thread pool: eight concurrent resumes of no
    stream at all started eight worker threads (up to 40), and queued behind sync routes."""
    import concurrent.futures
    import threading

    def workers() -> int:
        return sum(t.name.startswith("AnyIO worker") for t in threading.enumerate())

    before = workers()
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        statuses = list(pool.map(lambda i: httpx.get(f"{server.url}/v1/streams/none-{i}/events",
                                                     timeout=TIMEOUT).status_code, range(8)))  # fmt: skip
    assert statuses == [404] * 8 and workers() == before, (statuses, workers(), before)
