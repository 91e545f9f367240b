"""Everything refusable is refused before the first byte: a JSON envelope with its own status."""
from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest

from service_helpers import TIMEOUT, RawClient, lab_server, occupy_a_slot

BAD_BODIES = [
    pytest.param(b'{"prompt": "x",', "invalid_request", id="bad-json"),
    pytest.param(b'["prompt"]', "invalid_request", id="not-an-object"),
    pytest.param(b'{"prompt": 42}', "invalid_request", id="prompt-int"),
    pytest.param(b'{"prompt": "x", "max_new_tokens": "5"}', "invalid_request", id="max-new-tokens-string"),
    pytest.param(b'{"prompt": "x", "max_new_tokens": 0}', "invalid_request", id="max-new-tokens-zero"),
    pytest.param(b'{"prompt": "x", "temperature": "0.5"}', "invalid_request", id="temperature-string"),
    pytest.param(b'{"prompt": "x", "top_p": 0}', "invalid_request", id="top-p-zero"),
    pytest.param(b'{"prompt": "x", "stop": 3}', "invalid_request", id="stop-int"),
    pytest.param(b'{"prompt": "x", "stop": [""]}', "invalid_request", id="stop-empty-string"),
    pytest.param(b'{"prompt": "x", "ignore_eos": "yes"}', "invalid_request", id="ignore-eos-string"),
    pytest.param(b'{"prompt": "x", "temperature": 1, "seed": 18446744073709551616}', "invalid_request",
                 id="seed-beyond-64-bits"),
    pytest.param(b'{"prompt": "x", "max_tokens": 5}', "invalid_request", id="unknown-field"),
    pytest.param(b'{"prompt": ""}', "invalid_request", id="empty-prompt"),
    pytest.param(b'{"prompt": "x", "max_new_tokens": 600}', "prompt_too_long", id="too-long"),
]


@pytest.fixture(scope="module")
def server(tiny_gpt2: Any):
    with lab_server(tiny_gpt2) as running:
        yield running


def assert_envelope(response: Any, status: int, kind: str) -> None:
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/json"
    body = response.json()
    assert set(body) == {"error"} and body["error"]["type"] == kind and body["error"]["message"]


@pytest.mark.parametrize("path", ["/v1/stream", "/v1/generate"])
@pytest.mark.parametrize("data, kind", BAD_BODIES)
def test_a_bad_request_is_refused_with_a_json_envelope(server: Any, path: str, data: bytes, kind: str) -> None:
    with httpx.Client(base_url=server.url, timeout=TIMEOUT) as client:
        response = client.post(path, content=data, headers={"content-type": "application/json"})
    assert_envelope(response, 422, kind)


@pytest.mark.parametrize("chunked", [False, True])
def test_a_body_over_the_size_limit_gets_413_before_anything_reads_it(server: Any, chunked: bool) -> None:
    body = b'{"prompt": "' + b"word " * (server.config.http.max_body_bytes // 5 + 1) + b'"}'
    content = iter([body[i:i + 65536] for i in range(0, len(body), 65536)]) if chunked else body
    before = len(server.hub.records())
    with httpx.Client(base_url=server.url, timeout=TIMEOUT) as client:
        response = client.post("/v1/stream", content=content, headers={"Content-Type": "application/json"})
    assert_envelope(response, 413, "payload_too_large")
    assert len(server.hub.records()) == before  # nothing was tokenized or submitted


def test_the_refusal_is_the_whole_response_not_a_stream(server: Any) -> None:
    raw = RawClient(server.url).post("/v1/stream", {"prompt": ""})
    raw.read_to_end()
    raw.close_fin()
    assert raw.status == 422 and raw.headers["content-type"] == "application/json"
    assert raw.json()["error"]["type"] == "invalid_request" and not raw.events


@pytest.mark.parametrize("method, path, status, kind", [("GET", "/nowhere", 404, "not_found"),
                                                        ("GET", "/v1/stream", 405, "method_not_allowed")])
def test_routing_errors_use_the_envelope_too(server: Any, method: str, path: str, status: int, kind: str) -> None:
    with httpx.Client(base_url=server.url, timeout=TIMEOUT) as client:
        assert_envelope(client.request(method, path), status, kind)


def test_the_waiting_limit_answers_429_with_retry_after(tiny_gpt2: Any) -> None:
    with lab_server(tiny_gpt2, max_batch=1, max_waiting=1) as server:
        running = occupy_a_slot(server)
        waiting = RawClient(server.url).post("/v1/stream", {"prompt": "Hi", "max_new_tokens": 4})
        waiting.read_events(1)
        with httpx.Client(base_url=server.url, timeout=TIMEOUT) as client:
            for path, body in [("/v1/stream", {"prompt": "x"}), ("/v1/generate", {"prompt": "x"}),
                               ("/v1/completions", {"prompt": "x", "max_tokens": 2})]:
                response = client.post(path, json=body)
                assert_envelope(response, 429, "queue_full")
                assert response.headers["retry-after"] == "1"
        running.close_rst()
        assert waiting.read_to_end()[-1][0] == "done"


def test_openai_client_sees_a_422_for_unsupported_options(server: Any) -> None:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="lab", max_retries=0)
    with pytest.raises(openai.UnprocessableEntityError):
        client.completions.create(model="tiny-gpt2", prompt="x", max_tokens=2, n=2)
    with pytest.raises(openai.UnprocessableEntityError):
        client.chat.completions.create(model="tiny-gpt2", messages=[], max_tokens=2)
    client.close()


def test_service_config_names_the_bad_setting() -> None:
    from labkit.service.config import ServiceConfig

    for bad in [{"policy": "lifo"}, {"max_batch": 0}, {"response_class": "mine"}, {"pad_bytes": -1},
                {"keepalive_interval": 0}, {"port": 70000}]:
        with pytest.raises(ValueError, match=next(iter(bad))):
            ServiceConfig.of(**bad)
