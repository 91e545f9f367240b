"""The deadline gate: a request with ``deadline_s`` that cannot finish in time is refused with 429
``deadline_unreachable`` and Retry-After before the first byte; everything else is served.

A "slot held" below is a running stream paused in the engine (``occupy_a_slot``): with one batch
slot, nothing behind it can make a token until it leaves, so a short deadline behind it is
certainly missed, whatever the machine's speed.
"""
from __future__ import annotations

import math
import time
from dataclasses import replace
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from service_helpers import TIMEOUT, RawClient, lab_server, occupy_a_slot, wait_until

from labkit.engine.events import StepRecord
from labkit.service.config import ServiceConfig
from labkit.service.deadline import MAX_DEADLINE_S, step_seconds, steps_to_finish

ROUTES = [
    ("/v1/stream", {"prompt": "Hi", "max_new_tokens": 4}),
    ("/v1/generate", {"prompt": "Hi", "max_new_tokens": 4}),
    ("/v1/completions", {"prompt": "Hi", "max_tokens": 4, "stream": True}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}),
]



@pytest.fixture(scope="module")
def server_settings() -> dict[str, Any]:
    return {"docs": True}  # the module's server serves /openapi.json, read by a test below


def refusals(url: str) -> float:
    text = httpx.get(url + "/metrics", timeout=TIMEOUT).text
    for family in text_string_to_metric_families(text):
        if family.name == "labkit_deadline_refusals":
            return sum(s.value for s in family.samples if s.name.endswith("_total"))
    raise AssertionError("no labkit_deadline_refusals counter on /metrics")


def assert_refused(response: httpx.Response) -> None:
    assert response.status_code == 429, response.text
    assert response.headers["content-type"] == "application/json"
    assert response.json()["error"]["type"] == "deadline_unreachable"
    assert int(response.headers["retry-after"]) >= 1


# -- the prediction, in steps ---------------------------------------------------------------------
def test_an_idle_engine_finishes_a_request_in_its_prefill_step_and_one_step_per_token() -> None:
    assert steps_to_finish([], tokens=10, slots=4) == 11


def test_a_free_slot_is_taken_at_once_even_behind_running_requests() -> None:
    assert steps_to_finish([(True, 50), (True, 50)], tokens=10, slots=4) == 11


def test_a_full_batch_makes_the_request_wait_for_the_first_slot_to_free() -> None:
    assert steps_to_finish([(True, 30), (True, 5)], tokens=10, slots=2) == 5 + 1 + 10


def test_waiting_requests_ahead_take_the_freed_slots_first() -> None:
    # slot A frees at 5, slot B at 30; the waiting request (20 tokens) takes A until 5+1+20=26;
    # the new one then takes A at 26.
    assert steps_to_finish([(True, 30), (True, 5), (False, 20)], tokens=10, slots=2) == 26 + 1 + 10


# -- the step cost: recent steps only ------------------------------------------------------------
def test_a_step_counts_while_it_ended_at_most_window_s_ago() -> None:
    slow, fast = StepRecord(1, 0.0, 1.0, 1, 0), StepRecord(2, 10.0, 0.01, 1, 0)  # ended at 1.0 and 10.01
    assert step_seconds([slow, fast], now=10.5, max_age_s=20.0) == pytest.approx(0.505)
    assert step_seconds([slow, fast], now=10.5, max_age_s=2.0) == pytest.approx(0.01)


def test_an_engine_idle_longer_than_window_s_leaves_nothing_to_predict_from() -> None:
    assert step_seconds([StepRecord(1, 0.0, 1.0, 1, 0)], now=3.5, max_age_s=2.0) is None
    assert step_seconds([], now=3.5, max_age_s=2.0) is None


# -- over HTTP -----------------------------------------------------------------------------------
@pytest.mark.parametrize("path, body", ROUTES, ids=[p for p, _ in ROUTES])
def test_an_impossible_deadline_gets_429_with_retry_after_before_any_body(tiny_gpt2: Any, path: str, body: dict) -> None:
    with lab_server(tiny_gpt2, max_batch=1) as server:
        held = occupy_a_slot(server)
        raw = RawClient(server.url).post(path, {**body, "deadline_s": 0.001})
        raw.read_to_end()
        raw.close_fin()
        assert raw.status == 429 and raw.headers["content-type"] == "application/json"
        assert raw.json()["error"]["type"] == "deadline_unreachable" and not raw.events
        assert int(raw.headers["retry-after"]) >= 1
        assert refusals(server.url) == 1
        readings = httpx.get(server.url + "/lab/deadline", timeout=TIMEOUT).json()["readings"]
        assert [(r["refused"], r["request_id"]) for r in readings] == [(True, None)]
        assert readings[0]["predicted_s"] > readings[0]["deadline_s"] == 0.001
        held.close_rst()


@pytest.mark.parametrize("tokens", [10**18, 10**400], ids=["past-the-context", "past-any-float"])
@pytest.mark.parametrize("path, body", ROUTES, ids=[p for p, _ in ROUTES])
def test_a_request_that_can_never_fit_is_a_422_whatever_its_deadline(tiny_gpt2: Any, path: str, body: dict,
                                                                     tokens: int) -> None:  # fmt: skip
    """Not a 429 to retry (the gate predicting 10**18 steps), nor a 500 (10**400 steps as a float)."""
    limit = "max_tokens" if "max_tokens" in body else "max_new_tokens"
    with lab_server(tiny_gpt2, max_batch=1) as server:
        held = occupy_a_slot(server)  # the gate has steps to predict from, and a queue
        response = httpx.post(server.url + path, json={**body, limit: tokens, "deadline_s": 3600}, timeout=TIMEOUT)
        assert response.status_code == 422 and response.json()["error"]["type"] == "prompt_too_long", response.text
        assert refusals(server.url) == 0
        held.close_rst()


def test_without_a_deadline_the_same_request_is_never_refused(tiny_gpt2: Any) -> None:
    with lab_server(tiny_gpt2, max_batch=1) as server:
        held = occupy_a_slot(server)
        waiting = RawClient(server.url).post("/v1/stream", {"prompt": "Hi", "max_new_tokens": 4})
        assert waiting.read_events(1)[0][0] == "start"  # admitted and queued behind the held slot
        held.close_rst()
        assert waiting.read_to_end()[-1][0] == "done"
        assert refusals(server.url) == 0


def test_with_the_gate_off_the_refused_request_is_admitted_and_misses_its_deadline(tiny_gpt2: Any) -> None:
    """What the gate refuses would indeed have missed its deadline.

    The held stream has nearly a whole context (480 tokens) still to make, so the prediction is
    hundreds of steps: it clears the short deadline on a fast machine too (with 200 tokens and a
    0.3 s deadline it sat within 2% of it once the engine's step got faster)."""
    deadline = 0.05
    with lab_server(tiny_gpt2, max_batch=1, deadline_gate=False) as server:
        held = occupy_a_slot(server, max_new_tokens=480)
        sent = time.perf_counter()
        late = RawClient(server.url).post("/v1/stream", {"prompt": "Hi", "max_new_tokens": 4, "deadline_s": deadline})
        assert late.read_events(1)[0][0] == "start"
        time.sleep(deadline)
        assert server.hub.streams()[-1].record.tokens_generated == 0  # nothing made within the deadline
        held.close_rst()
        events = late.read_to_end()
        assert events[-1][0] == "done" and time.perf_counter() - sent > deadline
        assert refusals(server.url) == 0
        readings = httpx.get(server.url + "/lab/deadline", timeout=TIMEOUT).json()
        (reading,) = [r for r in readings["readings"] if r["request_id"] == events[0][1]["request_id"]]
        assert readings["enabled"] is False and not reading["refused"]
        assert reading["predicted_s"] > deadline  # the shadow gate saw the miss coming


def test_an_achievable_deadline_is_admitted_and_finishes_in_time(tiny_gpt2: Any) -> None:
    deadline = 20.0  # generous: a 4-token answer of the tiny model takes milliseconds
    with lab_server(tiny_gpt2, max_batch=2) as server, httpx.Client(base_url=server.url, timeout=TIMEOUT) as client:
        client.post("/v1/generate", json={"prompt": "warm", "max_new_tokens": 4})  # a step cost to predict from
        for path, body in ROUTES:
            sent = time.perf_counter()
            response = client.post(path, json={**body, "deadline_s": deadline})
            assert response.status_code == 200, response.text
            assert time.perf_counter() - sent < deadline
        assert refusals(server.url) == 0


def test_with_no_step_measured_yet_the_gate_admits(tiny_gpt2: Any) -> None:
    with lab_server(tiny_gpt2) as server, httpx.Client(base_url=server.url, timeout=TIMEOUT) as client:
        assert server.engine.steps_since(0) == []
        response = client.post("/v1/generate", json={"prompt": "Hi", "max_new_tokens": 2, "deadline_s": 1e-6})
        assert response.status_code == 200, response.text


def test_slow_steps_left_behind_by_an_idle_engine_stop_refusing_requests(tiny_gpt2: Any) -> None:
    """The lock-up the gate had: after a window of slow steps (``step_delay``: a busy machine) it
    predicted every deadline missed, and as a refused request makes no step the window never
    changed, so it refused everything from then on. Once those steps are older than
    ``deadline_window_s`` it admits, and then predicts from the steps of the present."""
    slow = 0.5  # seconds slept in every step that fills the window
    body = {"prompt": "Hi", "max_new_tokens": 4, "deadline_s": 3 * slow}  # 5 steps: 2.5 s at the slow cost
    with lab_server(tiny_gpt2, step_delay=slow, deadline_window=4) as server, httpx.Client(
        base_url=server.url, timeout=TIMEOUT
    ) as client:
        assert client.post("/v1/generate", json={"prompt": "Hi", "max_new_tokens": 4}).status_code == 200
        server.engine.config = replace(server.engine.config, step_delay=0.0)  # the machine is free again
        assert_refused(client.post("/v1/generate", json=body))  # the slow steps are still recent: a fair refusal
        give_up = time.monotonic() + TIMEOUT  # the default deadline_window_s is 2 s
        while (response := client.post("/v1/generate", json=body)).status_code == 429 and time.monotonic() < give_up:
            time.sleep(0.2)
        assert response.status_code == 200, response.text  # admitted, with nothing recent to predict from
        assert client.post("/v1/generate", json=body).status_code == 200  # predicted from its steps now
        readings = httpx.get(server.url + "/lab/deadline", timeout=TIMEOUT).json()["readings"]
        blind, predicted = readings[-2:]
        assert not blind["refused"] and blind["predicted_s"] is None
        assert not predicted["refused"] and predicted["step_s"] < slow  # not from the old steps


def test_while_a_stream_holds_a_slot_its_steps_still_count_however_old(tiny_gpt2: Any) -> None:
    """An engine with a stream running is stalled on it, not idle: its last steps still predict."""
    with lab_server(tiny_gpt2, max_batch=1, deadline_window_s=0.1) as server, httpx.Client(
        base_url=server.url, timeout=TIMEOUT
    ) as client:
        held = occupy_a_slot(server)
        assert [s.state.value for s in server.hub.streams()] == ["running"]
        time.sleep(0.5)  # no step since, five times deadline_window_s
        assert_refused(client.post("/v1/stream", json={"prompt": "Hi", "max_new_tokens": 4, "deadline_s": 0.001}))
        held.close_rst()


def test_refusals_leak_no_stream_and_no_block(tiny_gpt2: Any) -> None:
    with lab_server(tiny_gpt2, max_batch=1) as server, httpx.Client(base_url=server.url, timeout=TIMEOUT) as client:
        held = occupy_a_slot(server)
        streams, blocks = server.hub.open_streams, server.engine.stats()["reserved_blocks"]
        for _ in range(20):
            assert_refused(client.post("/v1/stream", json={"prompt": "Hi", "max_new_tokens": 8, "deadline_s": 0.001}))
        assert server.hub.open_streams == streams and server.engine.stats()["reserved_blocks"] == blocks
        assert refusals(server.url) == 20
        held.close_rst()
        wait_until(lambda: server.hub.open_streams == 0, what="the held stream to close")
        server.hub.check_integrity().result(TIMEOUT)  # lab_server checks again at the end


BAD = [
    pytest.param(b"-1", id="negative"),
    pytest.param(b"0", id="zero"),
    pytest.param(b"NaN", id="nan"),
    pytest.param(b"Infinity", id="infinity"),
    pytest.param(str(MAX_DEADLINE_S * 10).encode(), id="huge"),
    pytest.param(b'"5"', id="string"),
    pytest.param(b"true", id="bool"),
    pytest.param(b"[1]", id="list"),
]


@pytest.mark.parametrize("value", BAD)
@pytest.mark.parametrize("path", ["/v1/stream", "/v1/generate", "/v1/completions"])
def test_a_bad_deadline_is_a_422_with_the_envelope(server: Any, path: str, value: bytes) -> None:
    head = b'{"prompt": "Hi", "max_tokens": 2' if path == "/v1/completions" else b'{"prompt": "Hi", "max_new_tokens": 2'
    data = head + b', "deadline_s": ' + value + b"}"
    with httpx.Client(base_url=server.url, timeout=TIMEOUT) as client:
        response = client.post(path, content=data, headers={"content-type": "application/json"})
    assert response.status_code == 422, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request" and "deadline_s" in error["message"]


def test_the_deadline_is_in_the_openapi_schema(server: Any) -> None:
    schema = httpx.get(server.url + "/openapi.json", timeout=TIMEOUT).json()["components"]["schemas"]
    for model in ("StreamRequest", "GenerateRequest", "CompletionRequest", "ChatRequest"):
        field = schema[model]["properties"]["deadline_s"]
        number = next(b for b in field["anyOf"] if b.get("type") == "number")
        assert number["exclusiveMinimum"] == 0 and number["maximum"] == MAX_DEADLINE_S
        assert "deadline_unreachable" in number["description"]


def test_the_gate_is_a_flag_of_labkit_serve_and_checked() -> None:
    import argparse

    from labkit.server import add_serve_arguments, config_from_args

    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    http = config_from_args(parser.parse_args(["--no-deadline-gate", "--deadline-window", "8"])).http
    assert (http.deadline_gate, http.deadline_window) == (False, 8)
    assert config_from_args(parser.parse_args(["--deadline-window-s", "0.5"])).http.deadline_window_s == 0.5
    assert config_from_args(parser.parse_args([])).http.deadline_gate is True
    assert ServiceConfig.of(deadline_gate=False).http.deadline_gate is False
    with pytest.raises(ValueError, match="deadline_window"):
        ServiceConfig.of(deadline_window=0)
    with pytest.raises(ValueError, match="deadline_window_s"):
        ServiceConfig.of(deadline_window_s=0)
    assert math.isfinite(MAX_DEADLINE_S)
