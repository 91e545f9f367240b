"""The official ``openai`` client, unchanged, against /v1/completions and /v1/chat/completions."""
from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import httpx_sse
import openai
import pytest
from service_helpers import TIMEOUT


@pytest.fixture(scope="module")
def server_model(tiny_model: Any) -> Any:
    return tiny_model  # both tiny models, one server each


@pytest.fixture
def client(server: Any) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=server.url + "/v1", api_key="lab", max_retries=0, timeout=TIMEOUT) as c:
        yield c


def lab_generate(server: Any, **body: Any) -> dict[str, Any]:
    with httpx.Client(base_url=server.url, timeout=TIMEOUT) as http:
        return http.post("/v1/generate", json=body).json()


def test_completions_stream_and_whole_agree_with_the_lab_route(server: Any, client: openai.OpenAI) -> None:
    expected = lab_generate(server, prompt="The capital of Italy is", max_new_tokens=8)
    chunks = list(client.completions.create(model="any", prompt="The capital of Italy is", max_tokens=8,
                                            temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == expected["text"]
    assert chunks[-1].choices[0].finish_reason == "length"
    assert all(c.id == chunks[0].id and c.model == server.engine.model.name for c in chunks)
    whole = client.completions.create(model="any", prompt="The capital of Italy is", max_tokens=8, temperature=0)
    assert whole.choices[0].text == expected["text"] and whole.choices[0].finish_reason == "length"
    assert whole.usage.prompt_tokens == expected["usage"]["prompt_tokens"] and whole.usage.completion_tokens == 8


def test_completions_stream_reports_usage_when_asked(client: openai.OpenAI) -> None:
    chunks = list(client.completions.create(model="any", prompt="Hello", max_tokens=4, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 4
    assert all(c.usage is None for c in chunks[:-1])


def test_chat_stream_and_whole_agree(server: Any, client: openai.OpenAI) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
    chunks = list(client.chat.completions.create(model="any", messages=messages, max_tokens=6, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    whole = client.chat.completions.create(model="any", messages=messages, max_tokens=6, temperature=0)
    assert whole.choices[0].message.content == text and whole.choices[0].message.role == "assistant"
    assert finish == [whole.choices[0].finish_reason]
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens and whole.usage.completion_tokens <= 6


def test_chat_uses_the_tokenizers_template_when_it_has_one(server: Any) -> None:
    tokenizer = server.engine.tokenizer
    with httpx.Client(base_url=server.url, timeout=TIMEOUT) as http:
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "temperature": 0}
        usage = http.post("/v1/chat/completions", json=body).json()["usage"]
    if getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True)
        ids = ids["input_ids"] if hasattr(ids, "keys") else ids
        assert usage["prompt_tokens"] == len(ids)
    else:
        assert usage["prompt_tokens"] == len(tokenizer.encode("user: hi\nassistant:"))


def test_openai_streams_end_with_done_and_read_with_httpx_sse(server: Any) -> None:
    body = {"prompt": "Hello", "max_tokens": 3, "temperature": 0, "stream": True}
    with httpx.Client(base_url=server.url, timeout=TIMEOUT) as http:
        with httpx_sse.connect_sse(http, "POST", "/v1/completions", json=body) as source:
            assert source.response.headers["content-type"] == "text/event-stream; charset=utf-8"
            data = [sse.data for sse in source.iter_sse()]
    assert data[-1] == "[DONE]" and len(data) == 3 + 2  # three tokens, the finish chunk, [DONE]


def test_models_lists_the_served_model(server: Any, client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list()] == [server.engine.model.name]
