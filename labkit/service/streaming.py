"""The lab's own routes: ``POST /v1/stream`` (server-sent events) and ``POST /v1/generate`` (JSON).

Both validate the body, tokenize and submit before anything is sent, so every refusal is a
plain JSON error with its own status; only then does a stream start. Both answer with the same
request id, text, usage and finish reason for the same request. What a body may hold, and how
its prompt is tokenized off the event loop, is :mod:`labkit.service.intake`'s.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable
from typing import Any, TypeVar

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field, StrictBool

from labkit.engine.events import FinishEvent, TokenEvent
from labkit.hub.stream import Stream, StreamClosed, StreamError
from labkit.schema import StreamEncoder
from labkit.service.deadline import DeadlineSeconds
from labkit.service.errors import ServiceError
from labkit.service.frames import failure, frames, start_frame, wire_bytes
from labkit.service.intake import Count, Number, OffLoopBody, Prompt, Seed, Stop, prompt_ids
from labkit.service.openapi import BODY_REFUSALS, LAB_STREAM
from labkit.service.responses import sse_response
from labkit.service.state import Service

router = APIRouter(route_class=OffLoopBody)
T = TypeVar("T")
_ERROR_STATUS = {"shutdown": 503, "draining": 503, "slow_client": 503, "cancelled": 503, "queue_timeout": 503}


class GenerateRequest(BaseModel):
    """Unknown fields are refused: a typo such as ``max_tokens`` should not be silently ignored."""

    model_config = ConfigDict(extra="forbid")

    prompt: Prompt
    max_new_tokens: Count = 64
    stop: Stop = None
    temperature: Number = Field(0.0, ge=0)
    top_p: Number = Field(1.0, gt=0, le=1)
    seed: Seed | None = None
    ignore_eos: StrictBool = False
    deadline_s: DeadlineSeconds | None = None


class StreamRequest(GenerateRequest):
    """``resumable`` only here: a JSON answer has no stream to resume."""

    resumable: StrictBool = False


class GenerateResponse(BaseModel):
    request_id: str
    model: str
    text: str
    token_ids: list[int]
    finish_reason: str
    usage: dict[str, int]


def service_of(request: Request) -> Service:
    return request.app.state.service


async def open_stream(service: Service, body: GenerateRequest) -> tuple[Stream, int]:
    arrived = time.perf_counter()  # the deadline counts from here: the body has just been read
    ids = await prompt_ids(service.engine, body.prompt)
    stream = service.open(
        ids,
        max_new_tokens=body.max_new_tokens,
        stop=body.stop,
        temperature=body.temperature,
        top_p=body.top_p,
        seed=body.seed,
        ignore_eos=body.ignore_eos,
        deadline_s=body.deadline_s,
        arrived=arrived,
    )
    return stream, len(ids)


@router.post("/v1/stream", response_class=Response, responses=LAB_STREAM)
async def post_stream(body: StreamRequest, request: Request) -> Response:
    service = service_of(request)
    capacity = service.config.resume_log_events
    if body.resumable and body.max_new_tokens + 2 > capacity:
        raise ServiceError(
            422,
            "invalid_request",
            f"a resumable stream of {body.max_new_tokens} tokens does not fit the {capacity}-event log",
        )
    client = request.client.host if request.client else ""
    if body.resumable:
        service.resume.admit(client)  # before the prompt is tokenized; start() checks again after
    stream, prompt_tokens = await open_stream(service, body)
    kind = service.config.response_class
    if body.resumable:
        log = await service.resume.start(stream, prompt_tokens, client)
        return sse_response(
            service.resume.follow(log, 0), kind, request_id=stream.rid, headers={"X-Resume-Token": log.token}
        )
    return sse_response(
        stream_body(service, stream, prompt_tokens),
        kind,
        request_id=stream.rid,
        on_close=lambda: service.hub.close(stream),
    )


async def stream_body(service: Service, stream: Stream, prompt_tokens: int) -> AsyncIterator[bytes]:
    """start, token..., done | error; whatever ends it (even a cancel at a yield), close once."""
    encoder, pad = StreamEncoder(), service.config.pad_bytes
    try:
        yield start_frame(encoder, stream.rid, service.model_name, prompt_tokens).data
        async for frame in frames(stream, encoder, service.config.keepalive_interval):
            yield wire_bytes(frame, pad)
    finally:
        service.hub.close(stream)


@router.post("/v1/generate", response_model=GenerateResponse, responses=BODY_REFUSALS)
async def post_generate(body: GenerateRequest, request: Request) -> Response:
    service = service_of(request)
    stream, _ = await open_stream(service, body)
    result = await collect_whole(request, service, stream)
    if result is None:
        return Response(status_code=499)
    result.update(request_id=stream.rid, model=service.model_name)
    return JSONResponse(result, headers={"X-Request-ID": stream.rid})


async def collect(stream: Stream) -> dict[str, Any]:
    """Read a stream to its end; an in-band error becomes an HTTP error (nothing was sent yet)."""
    ids: list[int] = []
    text: list[str] = []
    while True:
        try:
            item = await stream.get()
        except StreamClosed:
            raise ServiceError(503, "shutdown", "the stream was closed before it finished") from None
        if isinstance(item, TokenEvent):
            ids.append(item.token_id)
            text.append(item.text)
        elif isinstance(item, FinishEvent) and item.reason != "cancelled":
            usage = {"prompt_tokens": item.usage.prompt_tokens, "completion_tokens": item.usage.completion_tokens}
            return {"text": "".join(text), "token_ids": ids, "finish_reason": item.reason, "usage": usage}
        else:
            assert isinstance(item, (FinishEvent, StreamError))
            kind, message = failure(item)
            raise ServiceError(_ERROR_STATUS.get(kind, 500), kind, message)


async def collect_whole(request: Request, service: Service, stream: Stream) -> dict[str, Any] | None:
    """Read ``stream`` to its end for a non-streaming answer and close it on every exit.

    ``None`` when the client left first: the caller answers 499 (which nobody reads), and the
    close has already given the request's blocks back.
    """
    try:
        return await unless_disconnected(request, collect(stream))
    except ClientGone:
        return None
    finally:
        service.hub.close(stream)


class ClientGone(Exception):
    """The client of a non-streaming request disconnected before its answer was ready."""


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Run ``work`` until done or until the client disconnects, whichever comes first.

    A plain (non-streaming) route is never told that its client left, so without this a
    ``/v1/generate`` whose client gave up would run to its token limit. vLLM does the same.
    """
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        raise ClientGone()
    finally:
        for pending in (task, watcher):
            pending.cancel()
        await asyncio.gather(task, watcher, return_exceptions=True)


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
