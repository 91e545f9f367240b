"""Lab routes: things the experiments need that a production server would not expose.

They are mounted only when ``HttpConfig.lab_routes`` is on (``labkit serve --lab-routes``;
``serve_in_thread`` turns it on): the records name every request, and a flood writes as much as
it is asked to, so neither belongs on a server that anyone but the lab can reach.

``GET /lab/streams`` and ``GET /lab/streams/{request_id}``: the hub's per-stream records
(submit, first token sampled / queued / taken, close, engine release and the step that carried
it, tokens generated and delivered, how it ended), all ``time.perf_counter()`` seconds on the
server's clock, which the answer also gives (``clock``). ``?ids=a,b,c`` answers one entry per id,
in that order (``null``: no record of it), so an experiment can wait for its own streams' release
with one request per poll; ``?since=T`` keeps the records submitted at or after ``T`` (a
``clock`` read earlier), so it can count what happened to the streams of one run.

``GET /lab/integrity``: the engine's cache check (free and used blocks partition the pool; every
held block belongs to one live sequence), run by the step thread between two steps so that it
never races one, and the server's ``/stats`` read on the loop right after it: ``{"ok", "what",
"stats"}``. An experiment asks for it once the server is idle, instead of calling into the hub
and the engine from its own thread.

``GET /lab/steps?since=N``: the engine's step log after step ``N`` (number, start, seconds,
sequences decoded, prompts prefilled): what an experiment reads its step-time spread from, over
HTTP, instead of reaching into the engine from another thread.

``GET /lab/deadline``: the deadline gate's readings (prediction, deadline, refused, request id),
also while the gate is off, so an experiment can set what it would have refused against what
happened to those requests (:mod:`labkit.service.deadline`).

``POST /lab/flood`` {flood_id, event_bytes, count, block_threshold}: writes ``count`` SSE events
of exactly ``event_bytes`` bytes each, as fast as the connection accepts them, and times every
``send``. The first send that takes longer than ``block_threshold`` (default 50 ms) marks the
point where the write blocked; the bytes of every send before it are "bytes accepted before the
write blocks" (the app-level answer: uvicorn's transport buffer plus both kernels' socket
buffers). A client that never reads sends the request on a raw socket with its own
``flood_id``, reads nothing, polls ``GET /lab/flood/{flood_id}`` from another connection until
``blocked`` is true, then closes; events are built as they are written, never stored. A flood
is bounded: events of at most ``FLOOD_MAX_EVENT_BYTES``, at most ``FLOOD_MAX_EVENTS`` of them,
``FLOOD_MAX_BYTES`` in all (422 beyond), which is well past any buffer the lab measures.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass, field
from typing import Any

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr, model_validator
from starlette.types import Message, Send

from labkit.schema import clip
from labkit.service.errors import ServiceError
from labkit.service.intake import OffLoopBody
from labkit.service.responses import SSE_HEADERS, SSE_MEDIA_TYPE, ClosingStreamingResponse
from labkit.service.streaming import Number, service_of
from labkit.sse import ServerSentEvent

router = APIRouter(route_class=OffLoopBody)  # /lab/flood's body is read as the /v1 routes' are
MAX_IDS = 1000  # request ids one ``/lab/streams?ids=`` may name
INTEGRITY_TIMEOUT_S = 30.0  # the step thread runs the check between two steps: one step's wait at most
FLOOD_MAX_EVENT_BYTES = 1 << 20
FLOOD_MAX_EVENTS = 1_000_000
FLOOD_MAX_BYTES = 64 << 20


@router.get("/lab/streams")
async def all_records(request: Request, ids: str | None = None, since: float | None = None) -> dict[str, Any]:
    hub, clock = service_of(request).hub, time.perf_counter()
    if ids is not None and since is not None:
        raise ServiceError(422, "invalid_request", "ask by ids or since a clock reading, not both")
    if ids is None:
        after = 0.0 if since is None else since
        return {"streams": [r.as_dict() for r in hub.records() if r.submitted >= after], "clock": clock}
    wanted = [rid for rid in ids.split(",") if rid]
    if not 0 < len(wanted) <= MAX_IDS:
        raise ServiceError(422, "invalid_request", f"ids must name 1 to {MAX_IDS} request ids, got {len(wanted)}")
    records = (hub.record(rid) for rid in wanted)
    return {"streams": [r.as_dict() if r is not None else None for r in records], "clock": clock}


@router.get("/lab/streams/{request_id}")
async def one_record(request: Request, request_id: str) -> dict[str, Any]:
    record = service_of(request).hub.record(request_id)
    if record is None:
        raise ServiceError(404, "not_found", f"no record of stream {clip(request_id)!r}")
    return record.as_dict()


@router.get("/lab/steps")
async def steps(request: Request, since: int = 0) -> dict[str, Any]:
    engine = service_of(request).engine
    return {"steps": [asdict(r) for r in engine.steps_since(since)], "step": engine.current_step}


@router.get("/lab/integrity")
async def integrity(request: Request) -> dict[str, Any]:
    """The cache check on the step thread between two steps, then the books on the loop.

    Callers that arrive while a check is under way share it: however many ask at once, the step
    thread runs one check, so asking cannot stall decoding by more than one check's time."""
    service, state = service_of(request), request.app.state
    check = getattr(state, "integrity_check", None)
    if check is None or check.done():
        check = state.integrity_check = asyncio.ensure_future(_check_integrity(service))
    ok, what = await asyncio.shield(check)
    return {"ok": ok, "what": what, "stats": service.stats().as_dict()}


async def _check_integrity(service: Any) -> tuple[bool, str]:
    try:
        await asyncio.wait_for(asyncio.wrap_future(service.hub.check_integrity()), INTEGRITY_TIMEOUT_S)
        return True, ""
    except TimeoutError:
        raise ServiceError(
            503, "internal_error", f"the step thread did not run the check within {INTEGRITY_TIMEOUT_S:g} s"
        ) from None
    except Exception as exc:  # an AssertionError is the check's finding; it is the answer, not a failure
        return False, clip(str(exc), 400) or "the integrity check failed"


class FloodRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    flood_id: StrictStr | None = Field(None, pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    event_bytes: StrictInt = Field(1024, ge=32, le=FLOOD_MAX_EVENT_BYTES)
    count: StrictInt = Field(256, ge=1, le=FLOOD_MAX_EVENTS)
    block_threshold: Number = Field(0.05, gt=0, le=10)

    @model_validator(mode="after")
    def bounded(self) -> FloodRequest:
        if self.event_bytes * self.count > FLOOD_MAX_BYTES:
            raise ValueError(
                f"event_bytes * count must be at most {FLOOD_MAX_BYTES} bytes, got {self.event_bytes * self.count}"
            )
        return self


@dataclass
class FloodRecord:
    flood_id: str
    event_bytes: int
    count: int
    block_threshold: float
    started: float = field(default_factory=time.perf_counter)
    events_accepted: int = 0  # events whose send returned before the first blocked send
    bytes_accepted: int = 0  # their SSE bytes
    wire_bytes_accepted: int = 0  # the same plus HTTP/1.1 chunk framing (headers not counted)
    blocked: bool = False
    blocked_at: float | None = None
    block_seconds: float | None = None  # how long that first blocked send took, once it returned
    events_sent: int = 0
    finished: bool = False

    def sent(self, size: int, seconds: float, now: float) -> None:
        self.events_sent += 1
        if self.blocked:
            if self.block_seconds is None:
                self.block_seconds = seconds
            return
        self.events_accepted += 1
        self.bytes_accepted += size
        self.wire_bytes_accepted += size + len(f"{size:x}") + 4

    def block(self, now: float) -> None:
        if not self.blocked:
            self.blocked, self.blocked_at = True, now


def flood_event(index: int, size: int) -> bytes:
    base = ServerSentEvent(event="flood", id=index, data="").encode()
    return ServerSentEvent(event="flood", id=index, data="x" * max(0, size - len(base))).encode()


async def flood_body(count: int, size: int) -> AsyncIterator[bytes]:
    for index in range(1, count + 1):
        yield flood_event(index, size)


class FloodResponse(ClosingStreamingResponse):
    """Starlette's response with every body ``send`` timed against the block threshold."""

    def __init__(self, content: Any, record: FloodRecord, **kwargs: Any) -> None:
        super().__init__(content, **kwargs)
        self.record = record

    async def stream_response(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        try:
            async for chunk in self.body_iterator:
                await self._timed_send(send, {"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            self.record.finished = True

    async def _timed_send(self, send: Send, message: Message) -> None:
        start = time.perf_counter()
        task = asyncio.ensure_future(send(message))
        try:
            done, _ = await asyncio.wait({task}, timeout=self.record.block_threshold)
            if not done:
                self.record.block(time.perf_counter())
                await task
        finally:
            task.cancel()
        task.result()
        self.record.sent(len(message["body"]), time.perf_counter() - start, time.perf_counter())


@router.get("/lab/deadline")
async def deadline_readings(request: Request) -> dict[str, Any]:
    gate = service_of(request).deadline
    return {"enabled": gate.enabled, "readings": gate.readings()}


@router.post("/lab/flood")
async def flood(body: FloodRequest, request: Request) -> FloodResponse:
    service = service_of(request)
    flood_id = body.flood_id or uuid.uuid4().hex[:12]
    if flood_id in service.floods:
        raise ServiceError(422, "invalid_request", f"flood_id {clip(flood_id)!r} is already in use")
    record = FloodRecord(flood_id, body.event_bytes, body.count, body.block_threshold)
    service.remember_flood(flood_id, record)
    headers = {**SSE_HEADERS, "X-Flood-ID": flood_id}
    return FloodResponse(flood_body(body.count, body.event_bytes), record, media_type=SSE_MEDIA_TYPE, headers=headers)


@router.get("/lab/flood/{flood_id}")
async def flood_result(request: Request, flood_id: str) -> dict[str, Any]:
    record = service_of(request).floods.get(flood_id)
    if record is None:
        raise ServiceError(404, "not_found", f"no flood {clip(flood_id)!r}")
    return asdict(record)
