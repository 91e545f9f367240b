"""OpenAI-compatible routes, so the official ``openai`` client works against the lab unchanged.

``POST /v1/completions`` and ``POST /v1/chat/completions`` (``stream`` true or false),
``GET /v1/models``. Streams follow OpenAI's framing: unnamed ``data:`` events of JSON chunks,
then ``data: [DONE]``; with ``stream_options.include_usage`` every chunk carries ``usage: null``
and one last chunk with empty ``choices`` carries the usage. An error after the first byte is a
``data: {"error": {...}}`` chunk (the client raises ``APIError`` on it), then ``[DONE]``.

Departures, on purpose: one choice, plain text, no tools, no audio, no web search. ``n`` > 1, ``best_of``, ``echo``,
``suffix``, ``logprobs``/``top_logprobs``, penalties, ``logit_bias``, a ``response_format`` other
than text, tools, ``tool_choice``/``functions`` that could call one, ``tool`` messages and an
assistant's ``tool_calls``, ``modalities`` other than text, ``audio``, ``web_search_options``, a
content part with more than its text, and ``stream_options`` without a stream are
refused with 422 naming the field, rather than ignored, so a client never receives something
other than what it asked for; each accepts its "off" value (``n: 1``, ``tools: []``, ...), and
the OpenAPI schema says exactly that. The ``model`` field is accepted whatever it
says and the answer names the model actually served. Unknown fields are ignored, as OpenAI's
own SDKs send many. ``temperature`` defaults to 1, OpenAI's default; pass 0 for greedy.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field, StrictBool, model_validator

from labkit.engine.events import FinishEvent, TokenEvent
from labkit.hub.stream import Stream
from labkit.schema import error_envelope
from labkit.service.deadline import DeadlineSeconds
from labkit.service.frames import PING, failure, items, padding
from labkit.service.intake import (
    MAX_CONTENT_PARTS,
    MAX_MESSAGES,
    Count,
    Number,
    OffLoopBody,
    PartsInAll,
    Prompt,
    Seed,
    Stop,
    Text,
    TokenIds,
    accepting,
    chat_ids,
    prompt_ids,
)
from labkit.service.openapi import OPENAI_ANSWER
from labkit.service.responses import sse_response
from labkit.service.state import Service
from labkit.service.streaming import collect_whole, service_of
from labkit.sse import ServerSentEvent

router = APIRouter(route_class=OffLoopBody)
_FINISH = {"eos": "stop", "stop": "stop", "length": "length"}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: StrictBool = False


class TextFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]


class _Sampling(BaseModel):
    """What both routes share. Each option this server does not support accepts only its "off"
    values (see :func:`accepting`), so the schema says what is served and a refusal names it."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    temperature: Annotated[Number, Field(ge=0, le=2)] | None = None
    top_p: Annotated[Number, Field(gt=0, le=1)] | None = None
    n: Annotated[Literal[1] | None, accepting(1)] = None
    stream: StrictBool | None = False
    stream_options: StreamOptions | None = None
    stop: Stop = None
    seed: Seed | None = None
    ignore_eos: StrictBool = False  # not OpenAI's; vLLM and llama.cpp's server accept it too
    deadline_s: DeadlineSeconds | None = None  # not OpenAI's: the lab's deadline gate
    presence_penalty: Annotated[Annotated[float, Field(ge=0, le=0)] | None, accepting(0)] = None
    frequency_penalty: Annotated[Annotated[float, Field(ge=0, le=0)] | None, accepting(0)] = None
    logit_bias: Annotated[Annotated[dict[str, Any], Field(max_length=0)] | None, accepting({})] = None

    @model_validator(mode="after")
    def _usage_needs_a_stream(self) -> _Sampling:
        if self.stream_options is not None and not self.stream:  # OpenAI refuses it too
            raise ValueError("stream_options is only allowed with stream: true")
        return self


class CompletionRequest(_Sampling):
    prompt: (
        Prompt
        | Annotated[list[Prompt], Field(min_length=1, max_length=1)]
        | TokenIds
        | Annotated[list[TokenIds], Field(min_length=1, max_length=1)]
    )
    max_tokens: Count | None = 16
    echo: Annotated[Literal[False] | None, accepting(False)] = False
    logprobs: Annotated[None, accepting()] = None
    best_of: Annotated[Literal[1] | None, accepting(1)] = None
    suffix: Annotated[Literal[""] | None, accepting("")] = None


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")  # an image_url or audio riding on it would be dropped unsaid
    type: Literal["text"]
    text: Text


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant"]
    content: Text | Annotated[list[TextPart], Field(max_length=MAX_CONTENT_PARTS)] | None = None
    tool_calls: Annotated[Annotated[list[Any], Field(max_length=0)] | None, accepting([])] = None
    function_call: Annotated[None, accepting()] = None


class ChatRequest(_Sampling):
    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=MAX_MESSAGES), PartsInAll]
    max_tokens: Count | None = None
    max_completion_tokens: Count | None = None
    logprobs: Annotated[Literal[False] | None, accepting(False)] = False
    top_logprobs: Annotated[Literal[0] | None, accepting(0)] = None
    response_format: Annotated[TextFormat | None, accepting({"type": "text"})] = None
    tools: Annotated[Annotated[list[Any], Field(max_length=0)] | None, accepting([])] = None
    tool_choice: Annotated[Literal["none", "auto"] | None, accepting("none", "auto")] = None
    functions: Annotated[Annotated[list[Any], Field(max_length=0)] | None, accepting([])] = None
    function_call: Annotated[Literal["none", "auto"] | None, accepting("none", "auto")] = None
    modalities: Annotated[
        Annotated[list[Literal["text"]], Field(min_length=1, max_length=1)] | None, accepting(["text"])
    ] = None
    audio: Annotated[None, accepting()] = None
    web_search_options: Annotated[None, accepting()] = None


# -- prompts -----------------------------------------------------------------------------------
async def completion_prompt_ids(service: Service, prompt: Any) -> list[int]:
    """A text, one text in a list, token ids, or one list of token ids (the schema allows no more)."""
    if isinstance(prompt, list) and len(prompt) == 1 and not isinstance(prompt[0], int):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return await prompt_ids(service.engine, prompt)
    return list(prompt)  # the engine checks the ids against the vocabulary and the context


def message_text(message: ChatMessage) -> str:
    if message.content is None or isinstance(message.content, str):
        return message.content or ""
    return "".join(part.text for part in message.content)


async def chat_prompt_ids(service: Service, messages: list[ChatMessage]) -> list[int]:
    """The tokenizer's chat template when it has one; otherwise ``role: text`` lines."""
    return await chat_ids(service.engine, [{"role": m.role, "content": message_text(m)} for m in messages])


# -- routes ----------------------------------------------------------------------------------
@router.get("/v1/models")
async def list_models(request: Request) -> dict[str, Any]:
    name = service_of(request).model_name
    return {"object": "list", "data": [{"id": name, "object": "model", "created": 0, "owned_by": "labkit"}]}


@router.post("/v1/completions", response_class=Response, responses=OPENAI_ANSWER)
async def completions(body: CompletionRequest, request: Request) -> Response:
    service, arrived = service_of(request), time.perf_counter()
    ids = await completion_prompt_ids(service, body.prompt)
    return await answer(request, service, body, ids, body.max_tokens or 16, "completion", arrived)


@router.post("/v1/chat/completions", response_class=Response, responses=OPENAI_ANSWER)
async def chat_completions(body: ChatRequest, request: Request) -> Response:
    service, arrived = service_of(request), time.perf_counter()
    ids = await chat_prompt_ids(service, body.messages)
    room = service.engine.max_context - len(ids)
    max_tokens = body.max_completion_tokens or body.max_tokens or max(1, min(service.config.default_max_tokens, room))
    return await answer(request, service, body, ids, max_tokens, "chat", arrived)


Kind = Literal["completion", "chat"]


async def answer(
    request: Request,
    service: Service,
    body: _Sampling,
    ids: list[int],
    max_tokens: int,
    kind: Kind,
    arrived: float,
) -> Response:
    temperature = 1.0 if body.temperature is None else body.temperature
    top_p = 1.0 if body.top_p is None else body.top_p
    stream = service.open(
        ids,
        max_new_tokens=max_tokens,
        stop=body.stop,
        temperature=temperature,
        top_p=top_p,
        seed=body.seed,
        ignore_eos=body.ignore_eos,
        deadline_s=body.deadline_s,
        arrived=arrived,
    )
    shape = Shape(kind, stream.rid, service.model_name, len(ids))
    headers = {"X-Request-ID": stream.rid}
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        chunks = stream_chunks(service, stream, shape, include_usage)
        return sse_response(
            chunks, service.config.response_class, request_id=stream.rid, on_close=lambda: service.hub.close(stream)
        )
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
        self._frames: dict[bool, tuple[bytes, bytes]] = {}  # token chunks' fixed bytes, by usage_null

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def usage(self, completion_tokens: int) -> dict[str, int]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": self.prompt_tokens + completion_tokens,
        }

    def whole(self, result: dict[str, Any]) -> dict[str, Any]:
        finish = _FINISH[result["finish_reason"]]
        if self.kind == "chat":
            choice = {
                "index": 0,
                "message": {"role": "assistant", "content": result["text"]},
                "logprobs": None,
                "finish_reason": finish,
            }
        else:
            choice = {"index": 0, "text": result["text"], "logprobs": None, "finish_reason": finish}
        return {
            **self._head(self.object),
            "choices": [choice],
            "usage": self.usage(result["usage"]["completion_tokens"]),
        }

    def chunk(self, text: str | None, finish: str | None = None, role: bool = False) -> dict[str, Any]:
        if self.kind == "chat":
            delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else {}
            if text is not None:
                delta["content"] = text
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            return {**self._head("chat.completion.chunk"), "choices": [choice]}
        choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
        return {**self._head("text_completion"), "choices": [choice]}

    def token_data(self, text: str, usage_null: bool) -> bytes:
        """``_data(self.chunk(text), usage_null)``, byte for byte, without building the chunk.

        Why: a stream writes one of these per token and they differ only in ``text``, so the
        rest is encoded once per stream (see :meth:`_token_frame`) and the text is the only JSON
        encoded per token. A JSON string never holds a raw CR or LF, so the event is one
        ``data:`` line, as :class:`ServerSentEvent` would write it.
        """
        frame = self._frames.get(usage_null) or self._token_frame(usage_null)
        if frame is _NO_FRAME:
            return _data(self.chunk(text), usage_null)
        head, tail = frame
        return head + json.dumps(text, ensure_ascii=False).encode("utf-8") + tail

    def _token_frame(self, usage_null: bool) -> tuple[bytes, bytes]:
        """The bytes before and after the text, cut from a chunk encoded with a marker text
        (:data:`_NO_FRAME` if the marker's encoding is not found exactly once)."""
        marker = json.dumps(_MARK).encode("ascii")
        whole = _data(self.chunk(_MARK), usage_null)
        head, _, tail = whole.partition(marker)
        frame = (head, tail) if whole.count(marker) == 1 else _NO_FRAME
        self._frames[usage_null] = frame
        return frame

    def usage_chunk(self, completion_tokens: int) -> dict[str, Any]:
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        return {**self._head(obj), "choices": [], "usage": self.usage(completion_tokens)}


_MARK = "\x00labkit-token-text\x00"  # stands in for a token's text while a stream's chunk frame is built
_NO_FRAME = (b"", b"")  # a Shape whose fixed fields hold the marker itself: encode each chunk whole


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
                yield (padding(pad) if pad else b"") + shape.token_data(item.text, include_usage)
            elif isinstance(item, FinishEvent) and item.reason in _FINISH:
                yield _data(shape.chunk(None, _FINISH[item.reason]), include_usage)
                if include_usage:
                    yield _data(shape.usage_chunk(item.usage.completion_tokens))
            else:
                yield _data(error_envelope(*failure(item)))
        if ended:  # a stream closed under us (forced shutdown) must not look complete
            yield _data("[DONE]")
    finally:
        service.hub.close(stream)
