"""OpenAI-compatible routes, so the official ``openai`` client works against the lab unchanged.

``POST /v1/completions`` and ``POST /v1/chat/completions`` (``stream`` true or false),
``GET /v1/models``. Streams follow OpenAI's framing: unnamed ``data:`` events of JSON chunks,
then ``data: [DONE]``; with ``stream_options.include_usage`` every chunk carries ``usage: null``
and one last chunk with empty ``choices`` carries the usage. An error after the first byte is a
``data: {"error": {...}}`` chunk (the client raises ``APIError`` on it), then ``[DONE]``.

Departures, on purpose: one choice only (``n`` > 1, ``best_of``, ``echo``, ``logprobs``,
penalties, ``logit_bias`` and tools are refused with 422 rather than ignored, so a client never
receives something other than what it asked for); the ``model`` field is accepted whatever it
says and the answer names the model actually served. Unknown fields are ignored, as OpenAI's
own SDKs send many. ``temperature`` defaults to 1, OpenAI's default; pass 0 for greedy.
"""
from __future__ import annotations

import json
import time
from typing import Any, AsyncIterator, Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr

from labkit.engine.events import FinishEvent, TokenEvent
from labkit.hub.stream import Stream
from labkit.schema import error_envelope
from labkit.service.errors import ServiceError
from labkit.service.frames import PING, items, padding
from labkit.service.responses import sse_response
from labkit.service.state import Service
from labkit.service.streaming import Number, collect_whole, service_of
from labkit.sse import ServerSentEvent

router = APIRouter()
_FINISH = {"eos": "stop", "stop": "stop", "length": "length"}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: StrictBool = False


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    temperature: Number | None = Field(None, ge=0, le=2)
    top_p: Number | None = Field(None, gt=0, le=1)
    n: StrictInt | None = None
    stream: StrictBool | None = False
    stream_options: StreamOptions | None = None
    stop: StrictStr | list[StrictStr] | None = None
    seed: StrictInt | None = None
    ignore_eos: StrictBool = False  # not OpenAI's; vLLM and llama.cpp's server accept it too
    presence_penalty: Number | None = None
    frequency_penalty: Number | None = None
    logit_bias: dict[str, Any] | None = None

    def refuse_unsupported(self) -> None:
        checks = {"n": self.n not in (None, 1), "presence_penalty": bool(self.presence_penalty),
                  "frequency_penalty": bool(self.frequency_penalty), "logit_bias": bool(self.logit_bias)}
        checks.update(self._extra_unsupported())
        bad = [name for name, refused in checks.items() if refused]
        if bad:
            raise ServiceError(422, "invalid_request", f"not supported by this server: {', '.join(bad)}")

    def _extra_unsupported(self) -> dict[str, bool]:
        return {}


class CompletionRequest(_Sampling):
    prompt: StrictStr | list[StrictStr] | list[StrictInt] | list[list[StrictInt]]
    max_tokens: StrictInt | None = Field(16, ge=1)
    echo: StrictBool | None = False
    logprobs: StrictInt | None = None
    best_of: StrictInt | None = None
    suffix: StrictStr | None = None

    def _extra_unsupported(self) -> dict[str, bool]:
        return {"echo": bool(self.echo), "logprobs": self.logprobs is not None,
                "best_of": self.best_of not in (None, 1), "suffix": bool(self.suffix)}


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: StrictStr
    content: StrictStr | list[dict[str, Any]] | None = None


class ChatRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: StrictInt | None = Field(None, ge=1)
    max_completion_tokens: StrictInt | None = Field(None, ge=1)
    logprobs: StrictBool | None = False
    tools: list[Any] | None = None

    def _extra_unsupported(self) -> dict[str, bool]:
        return {"logprobs": bool(self.logprobs), "tools": bool(self.tools)}


# -- prompts -----------------------------------------------------------------------------------
def completion_prompt_ids(service: Service, prompt: Any) -> list[int]:
    if isinstance(prompt, str):
        return service.encode(prompt)
    if prompt and all(isinstance(t, int) for t in prompt):
        return list(prompt)
    if len(prompt) != 1:
        raise ServiceError(422, "invalid_request", "exactly one prompt per request is supported")
    return service.encode(prompt[0]) if isinstance(prompt[0], str) else list(prompt[0])


def message_text(message: ChatMessage) -> str:
    if message.content is None or isinstance(message.content, str):
        return message.content or ""
    parts = []
    for part in message.content:
        if part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise ServiceError(422, "invalid_request", "only text content parts are supported")
        parts.append(part["text"])
    return "".join(parts)


def chat_prompt_ids(service: Service, messages: list[ChatMessage]) -> list[int]:
    """The tokenizer's chat template when it has one; otherwise ``role: text`` lines."""
    turns = [{"role": m.role, "content": message_text(m)} for m in messages]
    tokenizer = service.engine.tokenizer
    if getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template(turns, add_generation_prompt=True, tokenize=True)
        ids = ids["input_ids"] if hasattr(ids, "keys") else ids
        return [int(t) for t in ids]
    text = "".join(f"{t['role']}: {t['content']}\n" for t in turns) + "assistant:"
    return service.encode(text)


# -- routes ----------------------------------------------------------------------------------
@router.get("/v1/models")
async def list_models(request: Request) -> dict[str, Any]:
    name = service_of(request).model_name
    return {"object": "list", "data": [{"id": name, "object": "model", "created": 0, "owned_by": "labkit"}]}


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request) -> Response:
    service = service_of(request)
    body.refuse_unsupported()
    ids = completion_prompt_ids(service, body.prompt)
    return await answer(request, service, body, ids, body.max_tokens or 16, "completion")


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatRequest, request: Request) -> Response:
    service = service_of(request)
    body.refuse_unsupported()
    ids = chat_prompt_ids(service, body.messages)
    room = service.engine.max_context - len(ids)
    max_tokens = body.max_completion_tokens or body.max_tokens or max(1, min(service.config.default_max_tokens, room))
    return await answer(request, service, body, ids, max_tokens, "chat")


Kind = Literal["completion", "chat"]


async def answer(request: Request, service: Service, body: _Sampling, ids: list[int], max_tokens: int,
                 kind: Kind) -> Response:
    temperature = 1.0 if body.temperature is None else body.temperature
    stream = service.open(ids, max_new_tokens=max_tokens, stop=body.stop, temperature=temperature,
                          top_p=1.0 if body.top_p is None else body.top_p, seed=body.seed,
                          ignore_eos=body.ignore_eos)
    shape = Shape(kind, stream.rid, service.model_name, len(ids))
    headers = {"X-Request-ID": stream.rid}
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        chunks = stream_chunks(service, stream, shape, include_usage)
        return sse_response(chunks, service.config.response_class, request_id=stream.rid,
                            on_close=lambda: service.hub.close(stream))
    result = await collect_whole(request, service, stream)
    if result is None:
        return Response(status_code=499)
    return JSONResponse(shape.whole(result), headers=headers)


class Shape:
    """The JSON objects of one OpenAI answer: chunks while streaming, or the whole response."""

    def __init__(self, kind: Kind, rid: str, model: str, prompt_tokens: int) -> None:
        self.kind, self.model, self.prompt_tokens = kind, model, prompt_tokens
        self.id = ("chatcmpl-" if kind == "chat" else "cmpl-") + rid
        self.created = int(time.time())
        self.object = "chat.completion" if kind == "chat" else "text_completion"

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def usage(self, completion_tokens: int) -> dict[str, int]:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": self.prompt_tokens + completion_tokens}

    def whole(self, result: dict[str, Any]) -> dict[str, Any]:
        finish = _FINISH[result["finish_reason"]]
        if self.kind == "chat":
            choice = {"index": 0, "message": {"role": "assistant", "content": result["text"]},
                      "logprobs": None, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": result["text"], "logprobs": None, "finish_reason": finish}
        return {**self._head(self.object), "choices": [choice],
                "usage": self.usage(result["usage"]["completion_tokens"])}

    def chunk(self, text: str | None, finish: str | None = None, role: bool = False) -> dict[str, Any]:
        if self.kind == "chat":
            delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else {}
            if text is not None:
                delta["content"] = text
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            return {**self._head("chat.completion.chunk"), "choices": [choice]}
        choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
        return {**self._head("text_completion"), "choices": [choice]}

    def usage_chunk(self, completion_tokens: int) -> dict[str, Any]:
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        return {**self._head(obj), "choices": [], "usage": self.usage(completion_tokens)}


def _data(payload: dict[str, Any] | str, usage_null: bool = False) -> bytes:
    if isinstance(payload, dict):
        if usage_null:
            payload = {**payload, "usage": None}
        payload = json.dumps(payload, ensure_ascii=False, separators=(",", ":"))
    return ServerSentEvent(data=payload).encode()


async def stream_chunks(service: Service, stream: Stream, shape: Shape, include_usage: bool) -> AsyncIterator[bytes]:
    pad, ended = service.config.pad_bytes, False
    try:
        if shape.kind == "chat":
            yield _data(shape.chunk(None, role=True), include_usage)
        async for item in items(stream, service.config.keepalive_interval):
            ended = item is not None and not isinstance(item, TokenEvent)
            if item is None:
                yield PING.data
            elif isinstance(item, TokenEvent):
                yield (padding(pad) if pad else b"") + _data(shape.chunk(item.text), include_usage)
            elif isinstance(item, FinishEvent) and item.reason in _FINISH:
                yield _data(shape.chunk(None, _FINISH[item.reason]), include_usage)
                if include_usage:
                    yield _data(shape.usage_chunk(item.usage.completion_tokens))
            else:
                kind, message = ("cancelled", "the request was cancelled") if isinstance(item, FinishEvent) \
                    else (item.type, item.message)
                yield _data(error_envelope(kind, message))
        if ended:  # a stream closed under us (forced shutdown) must not look complete
            yield _data("[DONE]")
    finally:
        service.hub.close(stream)
