"""Everything refusable is refused before the first byte: a JSON envelope with its own status."""
from __future__ import annotations

import gzip
import re
import socket
from typing import Any

import httpx
import openai
import pytest
from service_helpers import TIMEOUT, RawClient, lab_server, occupy_a_slot

from labkit.schema import MAX_MESSAGE_CHARS, clip
from labkit.service.errors import as_service_error
from labkit.service.intake import MAX_MESSAGES, MAX_STOP_CHARS, MAX_STOP_STRINGS

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


def chat_body(fields: dict[str, Any]) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2, **fields}


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


@pytest.mark.parametrize("path", ["/v1/stream", "/v1/generate", "/v1/completions", "/v1/chat/completions",
                                  "/lab/flood"])
@pytest.mark.parametrize("content_type", [None, "", "application/x-www-form-urlencoded", "text/plain",
                                          "multipart/form-data; boundary=x", "application/jsonx"])
def test_a_body_not_sent_as_json_is_refused_with_415_naming_its_content_type(
        server: Any, path: str, content_type: str | None) -> None:
    """``curl -d`` sends a form's type, a web page's simple request ``text/plain``: each is
    refused by what it said it was, not parsed as JSON anyway, nor blamed on the fields."""
    body = b'{"prompt": "Hello", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 2}'
    headers = {"content-type": content_type} if content_type is not None else {}
    with httpx.Client(base_url=server.url, timeout=TIMEOUT) as client:
        response = client.post(path, content=body, headers=headers)
        assert response.request.headers.get("content-type") == content_type  # httpx adds none to raw content
        assert client.post(path, content=b"", headers=headers).status_code == 422  # no body: "Field required"
    assert_envelope(response, 415, "unsupported_media_type")
    said = response.json()["error"]["message"]
    assert said.endswith("no Content-Type" if content_type is None else f"has Content-Type: {content_type}"), said


@pytest.mark.parametrize("encoding", [["gzip"], ["br, gzip"], ["identity, gzip"], ["identity", "gzip"]],
                         ids=["gzip", "two-codings", "identity-then-gzip", "two-header-lines"])
def test_a_compressed_body_is_refused_with_415_and_the_coding_it_would_take(server: Any, encoding: list[str]) -> None:
    """Read as it came, gzip's bytes were "invalid JSON"; inflated, 1 MiB on the wire could be any size."""
    body = gzip.compress(b'{"prompt": "Hello", "max_new_tokens": 2}')
    headers = [("content-type", "application/json")] + [("content-encoding", line) for line in encoding]
    with httpx.Client(base_url=server.url, timeout=TIMEOUT) as client:
        response = client.post("/v1/generate", content=body, headers=headers)
        plain = client.post("/v1/generate", content=b'{"prompt": "Hello", "max_new_tokens": 2}',
                            headers={"content-type": "application/json", "content-encoding": "identity"})
    assert_envelope(response, 415, "unsupported_media_type")
    assert response.headers["accept-encoding"] == "identity" and "gzip" in response.json()["error"]["message"]
    assert plain.status_code == 200, plain.text


@pytest.mark.parametrize("head", ["content-type: text/plain", "content-type: application/json\r\ncontent-encoding: gzip"],
                         ids=["text", "gzip"])
def test_a_body_its_head_already_refuses_is_not_asked_for(server: Any, head: str) -> None:
    """With ``Expect: 100-continue`` its headers settle the 415, so the server does not answer
    ``100 Continue`` and then refuse half a megabyte it asked for (a hostile review)."""
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=TIMEOUT) as sock:
        sock.sendall((f"POST /v1/generate HTTP/1.1\r\nHost: 127.0.0.1\r\n{head}\r\ncontent-length: 500000\r\n"
                      "expect: 100-continue\r\n\r\n").encode())
        raw = b""
        while b"\r\n\r\n" not in raw:  # the old answer: 100 Continue
            raw += sock.recv(65536)
    assert raw.startswith(b"HTTP/1.1 415 "), raw[:200]


def test_a_refused_content_header_is_quoted_as_it_was_sent(server: Any) -> None:
    """Its bytes read as UTF-8, as the Last-Event-ID's are (Starlette reads a header as Latin-1)."""
    with httpx.Client(base_url=server.url, timeout=TIMEOUT) as client:
        typed = client.post("/v1/generate", content=b"{}", headers={"content-type": "text/plain; x=²".encode()})
        coded = client.post("/v1/generate", content=b"{}", headers={"content-type": "application/json",
                                                                     "content-encoding": "gzip²".encode()})
    assert typed.json()["error"]["message"].endswith("has Content-Type: text/plain; x=²"), typed.text
    assert "Content-Encoding: gzip² is not read" in coded.json()["error"]["message"], coded.text


@pytest.mark.parametrize("content_type", ["application/json; charset=utf-8", "Application/JSON",
                                          "application/vnd.api+json"])
def test_every_json_content_type_is_read_as_json(server: Any, content_type: str) -> None:
    with httpx.Client(base_url=server.url, timeout=TIMEOUT) as client:
        response = client.post("/v1/generate", content=b'{"prompt": "Hello", "max_new_tokens": 2}',
                               headers={"content-type": content_type})
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 2, response.text


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


# -- what a hostile client sent (issue 12) -----------------------------------------------------
LONE = '"\\ud800"'  # a JSON string holding a lone surrogate: valid JSON, not valid Unicode text
MARK = "SURROGATE"  # where LONE goes in each body below
SURROGATE_BODIES = [
    pytest.param("/v1/stream", '{"prompt": SURROGATE}', id="stream-prompt"),
    pytest.param("/v1/generate", '{"prompt": SURROGATE}', id="generate-prompt"),
    pytest.param("/v1/generate", '{"prompt": "x", "stop": SURROGATE}', id="generate-stop"),
    pytest.param("/v1/completions", '{"prompt": SURROGATE}', id="completions-prompt"),
    pytest.param("/v1/completions", '{"prompt": [SURROGATE]}', id="completions-prompt-list"),
    pytest.param("/v1/chat/completions", '{"messages": [{"role": "user", "content": SURROGATE}]}',
                 id="chat-content"),
    pytest.param("/v1/chat/completions", '{"messages": [{"role": SURROGATE, "content": "x"}]}', id="chat-role"),
    pytest.param("/v1/chat/completions",
                 '{"messages": [{"role": "user", "content": [{"type": "text", "text": SURROGATE}]}]}',
                 id="chat-content-part"),
]
EXCEPTION_NAME = re.compile(r"[A-Z]\w*(Error|Exception|Input)\b|Traceback|labkit\.|tokenizers")


def assert_refused_plainly(response: Any, status: int, kind: str) -> dict[str, Any]:
    """The envelope, and nothing in it that names an internal class or module."""
    assert_envelope(response, status, kind)
    assert not EXCEPTION_NAME.search(response.text), response.text
    return response.json()["error"]


@pytest.mark.parametrize("path, data", SURROGATE_BODIES)
def test_a_lone_surrogate_in_any_text_field_is_a_422_not_a_500(server: Any, path: str, data: str) -> None:
    body = data.replace(MARK, LONE).encode()
    with httpx.Client(base_url=server.url, timeout=TIMEOUT) as client:
        response = client.post(path, content=body, headers={"content-type": "application/json"})
    assert_refused_plainly(response, 422, "invalid_request")


def test_an_unexpected_failure_says_internal_error_and_nothing_else() -> None:
    err = as_service_error(RuntimeError("TextEncodeInput must be Union[...] in /opt/secret.py"))
    assert (err.status, err.type, err.message) == (500, "internal_error", "internal error")


@pytest.mark.parametrize("path", ["/v1/stream", "/v1/generate", "/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("stop, problem", [
    pytest.param([f"never{i}" for i in range(MAX_STOP_STRINGS + 1)], "stop", id="too-many"),
    pytest.param(["x" * (MAX_STOP_CHARS + 1)], "stop", id="too-long"),
    pytest.param("", "stop", id="empty-string"),
    pytest.param([""], "stop", id="empty-string-in-a-list"),
])
def test_stop_strings_are_bounded_in_number_and_length(server: Any, path: str, stop: Any, problem: str) -> None:
    body = chat_body({"stop": stop}) if path.endswith("chat/completions") else {"prompt": "x", "stop": stop}
    with httpx.Client(base_url=server.url, timeout=TIMEOUT) as client:
        error = assert_refused_plainly(client.post(path, json=body), 422, "invalid_request")
    assert problem in error["message"]


def test_the_most_stop_strings_allowed_are_served(server: Any) -> None:
    stops = [f"{i:03d}" + "z" * (MAX_STOP_CHARS - 3) for i in range(MAX_STOP_STRINGS)]
    with httpx.Client(base_url=server.url, timeout=TIMEOUT) as client:
        response = client.post("/v1/generate", json={"prompt": "x", "max_new_tokens": 4, "stop": stops})
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 4


@pytest.mark.parametrize("path, body", [
    pytest.param("/v1/generate", {"prompt": "x", "stop": [""] * 250_000}, id="250k-empty-stops"),
    pytest.param("/v1/generate", {"prompt": "x", "k" * 70_000: 1}, id="70k-char-unknown-field"),
    pytest.param("/v1/chat/completions", chat_body({"messages": [{"role": "r" * 70_000, "content": "x"}]}),
                 id="70k-char-role"),
])
def test_an_error_message_never_echoes_a_large_input(server: Any, path: str, body: dict[str, Any]) -> None:
    with httpx.Client(base_url=server.url, timeout=TIMEOUT) as client:
        response = client.post(path, json=body)
    assert_refused_plainly(response, 422, "invalid_request")
    assert len(response.content) < MAX_MESSAGE_CHARS + 100, len(response.content)


def test_a_404_never_echoes_a_long_id(server: Any) -> None:
    with httpx.Client(base_url=server.url, timeout=TIMEOUT) as client:
        response = client.get("/v1/streams/" + "a" * 12_000 + "/events")  # a head within 16 KiB
    assert_refused_plainly(response, 404, "not_found")
    assert len(response.content) < 400, len(response.content)


def test_clip_cuts_an_echoed_value_short_and_keeps_it_encodable() -> None:
    assert clip("short") == "short"
    assert clip("x" * 1000) == "x" * 64 + "…"
    assert clip("\ud800abc").encode("utf-8") == b"\\ud800abc"


@pytest.mark.parametrize("path, fields, name", [
    ("/v1/chat/completions", {"response_format": {"type": "json_object"}}, "response_format"),
    ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {"logprobs": True}, "logprobs"),
    ("/v1/chat/completions", {"n": 2}, "n"),
    ("/v1/chat/completions", {"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ("/v1/chat/completions", {"tool_choice": "required"}, "tool_choice"),
    ("/v1/chat/completions", {"presence_penalty": 0.5}, "presence_penalty"),
    ("/v1/chat/completions", {"logit_bias": {"50256": -100}}, "logit_bias"),
    ("/v1/chat/completions", {"modalities": ["text", "audio"], "audio": {"voice": "alloy", "format": "wav"}},
     "modalities"),
    ("/v1/chat/completions", {"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
    ("/v1/chat/completions", {"web_search_options": {}}, "web_search_options"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": None,
     "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]}, "tool_calls"),
    ("/v1/chat/completions", {"messages": [{"role": "assistant", "content": None,
     "function_call": {"name": "f", "arguments": "{}"}}]}, "function_call"),
    ("/v1/completions", {"logprobs": 1}, "logprobs"),
    ("/v1/completions", {"echo": True}, "echo"),
    ("/v1/completions", {"best_of": 2}, "best_of"),
    ("/v1/completions", {"suffix": "end"}, "suffix"),
])
def test_an_openai_option_this_server_does_not_support_is_refused_by_name(
        server: Any, path: str, fields: dict[str, Any], name: str) -> None:
    body = chat_body(fields) if path.endswith("chat/completions") else {"prompt": "x", "max_tokens": 2, **fields}
    with httpx.Client(base_url=server.url, timeout=TIMEOUT) as client:
        error = assert_refused_plainly(client.post(path, json=body), 422, "invalid_request")
    assert name in error["message"] and "not supported" in error["message"]


@pytest.mark.parametrize("fields, name", [
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "x", "image_url": {"url": "http://x"}}]}]},
     "image_url"),
    ({"stream": False, "stream_options": {"include_usage": True}}, "stream_options"),
])
def test_what_a_text_only_server_would_drop_without_a_word_is_refused_by_name(
        server: Any, fields: dict[str, Any], name: str) -> None:
    """An image riding on a text part, usage asked for a response that is not a stream (OpenAI
    refuses it too): accepted and ignored, the client would get less than it asked for."""
    with httpx.Client(base_url=server.url, timeout=TIMEOUT) as client:
        error = assert_refused_plainly(client.post("/v1/chat/completions", json=chat_body(fields)), 422, "invalid_request")
    assert name in error["message"], error


def test_the_default_values_of_unsupported_options_are_accepted(server: Any) -> None:
    defaults = {"response_format": {"type": "text"}, "top_logprobs": None, "logprobs": False, "n": 1,
                "tools": [], "tool_choice": "none", "presence_penalty": 0, "logit_bias": {}, "modalities": ["text"],
                "audio": None, "web_search_options": None}
    with httpx.Client(base_url=server.url, timeout=TIMEOUT) as client:
        assert client.post("/v1/chat/completions", json=chat_body(defaults)).status_code == 200


def test_chat_messages_are_bounded_in_number(server: Any) -> None:
    body = chat_body({"messages": [{"role": "user", "content": "x"}] * (MAX_MESSAGES + 1)})
    with httpx.Client(base_url=server.url, timeout=TIMEOUT) as client:
        error = assert_refused_plainly(client.post("/v1/chat/completions", json=body), 422, "invalid_request")
    assert "messages" in error["message"]


@pytest.mark.parametrize("field", ["temperature", "top_p"])
@pytest.mark.parametrize("path", ["/v1/generate", "/v1/completions"])
def test_a_temperature_or_top_p_that_float32_rounds_to_zero_is_served_greedily(
        server: Any, path: str, field: str) -> None:
    # 5e-324 once divided by zero inside the step and ended every open stream with internal_error.
    body = {"prompt": "Hello", "max_new_tokens" if path == "/v1/generate" else "max_tokens": 4}
    with httpx.Client(base_url=server.url, timeout=TIMEOUT) as client:
        tiny = client.post(path, json={**body, "temperature": 1.0, field: 5e-324})
        greedy = client.post(path, json={**body, "temperature": 0})
    assert tiny.status_code == 200, tiny.text
    assert tiny.json()["usage"] == greedy.json()["usage"]
    def text(r: httpx.Response) -> str:
        return r.json()["text"] if path == "/v1/generate" else r.json()["choices"][0]["text"]

    assert text(tiny) == text(greedy)
