"""Resumable streams: a bounded event log per stream, and a run that outlives its connection.

With ``resumable: true`` the hub stream is read by a *pump* task, not by the response: the pump
writes every frame to the stream's :class:`EventLog`, and responses only *follow* the log. So a
client that disconnects does not stop the run at once; when the last follower leaves, a grace
timer starts (``resume_grace``, default 10 s), and a follower that comes back in time stops it.
If nobody comes back, the pump is cancelled, which closes the hub stream (and so cancels the
engine request), and the log is forgotten: the id is then unknown (404).

Resuming needs a secret: each resumable stream gets a random resume token, sent only to its
creator (in the ``start`` event's ``resume_token`` and the ``X-Resume-Token`` response header).
``GET /v1/streams/{request_id}/events`` must carry it (``X-Resume-Token`` header or ``?token=``);
a missing or wrong token gets the very 404 an unknown id gets, so ids cannot be probed, and
does nothing else: it neither attaches nor stops the grace timer.

The route takes ``Last-Event-ID`` or ``?after=N`` and decides before the response starts:
404 unknown (or no valid token), 204 finished with nothing after N, 410 when events
after N were already evicted from the bounded log, 422 for a cursor that is not an event id.
Otherwise it replays what is after N and follows live. A finished log is kept for the grace
period too, so a client that lost the last events can still fetch them.

Because the pump always reads at once, slow-reader policies never see a resumable stream: its
backlog lives in the log, bounded by the token budget and ``resume_log_events``.
"""

from __future__ import annotations

import asyncio
import hmac
import secrets
from collections import deque
from collections.abc import AsyncIterator

from fastapi import APIRouter, Header, Query, Request
from fastapi.responses import Response

from labkit.hub import Hub, Stream
from labkit.schema import StreamEncoder, clip
from labkit.service import openapi
from labkit.service.errors import ServiceError
from labkit.service.frames import PING, Frame, frames, wire_bytes
from labkit.service.responses import sse_response

router = APIRouter()


class EventLog:
    """The frames of one stream, ids 1, 2, 3, ...; at most ``capacity`` of the newest kept."""

    def __init__(self, rid: str, capacity: int) -> None:
        self.rid = rid
        self.token = secrets.token_urlsafe(24)  # only the creator is told; resuming requires it
        self._frames: deque[Frame] = deque(maxlen=capacity)
        self._changed = asyncio.Event()
        self.finished = False
        self.followers = 0
        self.timer: asyncio.TimerHandle | None = None
        self.pump: asyncio.Task[None] | None = None

    @property
    def last_id(self) -> int:
        return (self._frames[-1].id or 0) if self._frames else 0

    @property
    def first_id(self) -> int:
        return (self._frames[0].id or 1) if self._frames else 1

    def append(self, frame: Frame) -> None:
        self._frames.append(frame)
        self._notify()

    def finish(self) -> None:
        self.finished = True
        self._notify()

    def after(self, cursor: int) -> list[Frame]:
        return [f for f in self._frames if f.id is not None and f.id > cursor]

    def waiter(self) -> asyncio.Event:
        """The event the next change will set; take it before reading, then wait on it."""
        return self._changed

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()


class ResumeRegistry:
    def __init__(
        self, hub: Hub, model_name: str, *, grace: float, capacity: int, keepalive: float, pad_bytes: int
    ) -> None:
        self.hub, self.model_name = hub, model_name
        self.grace, self.capacity = grace, capacity
        self.keepalive, self.pad_bytes = keepalive, pad_bytes
        self._logs: dict[str, EventLog] = {}

    def __len__(self) -> int:
        return len(self._logs)

    def get(self, rid: str) -> EventLog | None:
        return self._logs.get(rid)

    def find(self, rid: str, token: str | None) -> EventLog:
        """The log of ``rid`` if ``token`` is its resume token; else the 404 an unknown id gets."""
        log = self._logs.get(rid)
        if log is None or token is None or not _same(token, log.token):
            raise ServiceError(404, "not_found", f"no resumable stream {clip(rid)!r} (unknown, or expired)")
        return log

    def start(self, stream: Stream, prompt_tokens: int) -> EventLog:
        """Log the start event and begin pumping the hub stream into the log."""
        log = EventLog(stream.rid, self.capacity)
        encoder = StreamEncoder()
        start = encoder.start(stream.rid, self.model_name, prompt_tokens, resume_token=log.token)
        log.append(Frame("start", start, encoder.last_id))
        self._logs[stream.rid] = log
        log.pump = asyncio.get_running_loop().create_task(self._pump(stream, encoder, log))
        return log

    async def _pump(self, stream: Stream, encoder: StreamEncoder, log: EventLog) -> None:
        try:
            async for frame in frames(stream, encoder, keepalive=None):
                log.append(frame)
        finally:
            self.hub.close(stream)
            log.finish()
            if log.followers == 0:
                self._arm(log)

    # -- followers ----------------------------------------------------------------------------
    def check_cursor(self, rid: str, token: str | None, cursor: int) -> EventLog | None:
        """The log to follow; None for "finished, nothing left" (204); or raise the refusal."""
        log = self.find(rid, token)
        if cursor > log.last_id:
            raise ServiceError(422, "invalid_request", f"event {cursor} does not exist; the last is {log.last_id}")
        if log.finished and cursor == log.last_id:
            return None
        if cursor < log.first_id - 1:
            raise ServiceError(410, "gone", f"events after {cursor} were evicted; the log starts at {log.first_id}")
        return log

    async def follow(self, log: EventLog, cursor: int) -> AsyncIterator[bytes]:
        """Replay what is after ``cursor``, then follow live until the terminal event."""
        self._attach(log)
        try:
            while True:
                waiter = log.waiter()
                pending = log.after(cursor)
                for frame in pending:
                    yield wire_bytes(frame, self.pad_bytes)
                    cursor = frame.id or cursor
                if pending and pending[-1].terminal:
                    return
                if not pending:
                    if log.finished:
                        return
                    try:
                        await asyncio.wait_for(waiter.wait(), self.keepalive)
                    except TimeoutError:
                        yield PING.data
        finally:
            self._detach(log)

    def _attach(self, log: EventLog) -> None:
        log.followers += 1
        if log.timer is not None:
            log.timer.cancel()
            log.timer = None

    def _detach(self, log: EventLog) -> None:
        log.followers -= 1
        if log.followers == 0:
            self._arm(log)

    def _arm(self, log: EventLog) -> None:
        if log.timer is None and self._logs.get(log.rid) is log:
            log.timer = asyncio.get_running_loop().call_later(self.grace, self._expire, log)

    def _expire(self, log: EventLog) -> None:
        log.timer = None
        if log.followers:
            return
        self._logs.pop(log.rid, None)
        if log.pump is not None and not log.pump.done():
            log.pump.cancel()  # its finally closes the hub stream, which cancels the request

    async def aclose(self) -> None:
        """Stop every pump and timer (server shutdown, after the hub has drained)."""
        logs, self._logs = list(self._logs.values()), {}
        for log in logs:
            if log.timer is not None:
                log.timer.cancel()
            if log.pump is not None:
                log.pump.cancel()
        pumps = [log.pump for log in logs if log.pump is not None]
        await asyncio.gather(*pumps, return_exceptions=True)
        for log in logs:
            if log.timer is not None:
                log.timer.cancel()


def _same(given: str, expected: str) -> bool:
    """Constant-time comparison (any text: compare_digest refuses non-ASCII str)."""
    return hmac.compare_digest(given.encode("utf-8", "surrogatepass"), expected.encode("utf-8"))


def parse_cursor(last_event_id: str | None, after: str | None) -> int:
    raw = last_event_id if last_event_id not in (None, "") else after
    if raw is None or raw == "":
        return 0
    digits = raw.strip()
    # isdigit() alone would pass "²" and other digits int() refuses; 18 digits outnumber any log
    if not (digits.isascii() and digits.isdigit()) or len(digits) > 18:
        raise ServiceError(422, "invalid_request", f"event id must be a non-negative integer, got {raw[:40]!r}")
    return int(digits)


@router.get("/v1/streams/{request_id}/events", response_class=Response, responses=openapi.RESUME)
async def resume_events(
    request: Request,
    request_id: str,
    last_event_id: str | None = Header(default=None),
    x_resume_token: str | None = Header(default=None),
    after: str | None = Query(default=None),
    token: str | None = Query(default=None),
) -> Response:
    service = request.app.state.service
    cursor = parse_cursor(last_event_id, after)
    log = service.resume.check_cursor(request_id, x_resume_token or token, cursor)
    if log is None:
        return Response(status_code=204)
    return sse_response(service.resume.follow(log, cursor), service.config.response_class, request_id=request_id)
