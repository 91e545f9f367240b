"""Resumable streams: a bounded event log per stream, and a run that outlives its connection.

With ``resumable: true`` the hub stream is read by a *pump* task, not by the response: the pump
writes every frame to the stream's :class:`EventLog`, and responses only *follow* the log. So a
client that disconnects does not stop the run at once; when the last follower leaves, a grace
timer starts (``resume_grace``, default 10 s), and a follower that comes back in time stops it;
a follower on another server sharing the store, seen there when the grace runs out, grants another.
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
Otherwise it replays what is after N and follows live. A finished log is kept for
``resume_grace`` after it finished, so a client that lost the last events can still fetch them,
and no longer, however often it is replayed: when a replay re-armed the grace, a client that
replayed its finished one-token streams every few seconds held every resumable slot for ever.

Resumable streams are bounded in number (``max_resumable``: a run outlives its connection by the
grace, so without a bound clients that open one and hang up would fill the batch and the queue
at no cost to themselves), and one client, told apart by its address (``request.client``: the
peer, or ``X-Forwarded-For`` from a proxy named in ``--forwarded-allow-ips``), may hold only ``resumable_share`` of
them, so that no single client can take them all.

One stream has at most :data:`MAX_FOLLOWERS` followers at once (its creator counts; more get
429 ``queue_full``): each event wakes every follower, and each replays from the log, so a client
that fanned its own stream out to a few hundred followers slowed every other stream by half.
The cap holds for a stream followed from the store too, counted on each server (every server
sharing the store may serve it that many), and those followers together are bounded by the
store's ``readers``: each holds one of its connections in a blocking read, and the runs' writes
need the rest (a write that waits too long fails every resumable run on this server). One client
may hold only ``resumable_share`` of those readers, as of the runs, so that no client can shut
every other out of resuming here.

Because the pump always reads at once, slow-reader policies never see a resumable stream: its
backlog lives in the log, bounded by the token budget and ``resume_log_events``.

With a ``resume_store`` other than ``memory`` (:mod:`labkit.service.resume_store`) the pump also
writes every frame to the store, before the log's followers see it, and a resume for an id this
process does not hold is answered from the store, with the same refusals.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import time
from collections import Counter
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass
from typing import Annotated

from fastapi import APIRouter, Depends, Header, Query, Request
from fastapi.responses import Response

from labkit.hub import Hub, Stream
from labkit.schema import StreamEncoder, as_sent, clip, error_envelope
from labkit.service import openapi
from labkit.service.errors import ServiceError
from labkit.service.event_log import EventLog
from labkit.service.frames import PING, Frame, frames, wire_bytes
from labkit.service.responses import sse_response
from labkit.service.resume_store import MemoryStore, ResumeStore, StoredLog, StoreUnavailable
from labkit.sse import ServerSentEvent

router = APIRouter()
MAX_FOLLOWERS = 4  # at once, per stream: its creator, a reconnect the server has not yet seen leave, a tab or two
DRAINING = object()  # what a stored follower reads once its server drains
CROWDED = f"this stream has {MAX_FOLLOWERS} followers, the most at once"


@dataclass(frozen=True)
class ResumeLimits:
    most: int  # max_resumable
    share: float  # resumable_share: of ``most``, what one client may hold
    retry_after_s: int

    @property
    def per_client(self) -> int:
        return max(1, int(self.most * self.share))


class ResumeRegistry:
    def __init__(
        self,
        hub: Hub,
        model_name: str,
        *,
        grace: float,
        capacity: int,
        keepalive: float,
        pad_bytes: int,
        store: ResumeStore | None = None,
        limits: ResumeLimits,
    ) -> None:
        self.hub, self.model_name = hub, model_name
        self.grace, self.capacity = grace, capacity
        self.keepalive, self.pad_bytes = keepalive, pad_bytes
        self.store: ResumeStore = store or MemoryStore()
        self.limits = limits
        self._logs: dict[str, EventLog] = {}
        self._held: Counter[str] = Counter()  # logs alive, by client
        self._stored: Counter[str] = Counter()  # followers of logs this process only reads, by id
        self._readers: Counter[str] = Counter()  # the same followers, by client
        self._draining = asyncio.Event()  # set by the server's drain: stored followers end

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

    def admit(self, client: str) -> None:
        """Refuse (429) a resumable stream beyond ``max_resumable``, or beyond the client's share."""
        most, retry = self.limits.most, {"Retry-After": str(self.limits.retry_after_s)}
        if len(self._logs) >= most:
            raise ServiceError(429, "queue_full", f"{most} resumable streams are open; try again later", retry)
        if self._held[client] >= self.limits.per_client:
            message = (
                f"this client holds {self._held[client]} resumable streams, its share of them "
                f"(resumable_share {self.limits.share} of max_resumable {most}); try again later"
            )
            raise ServiceError(429, "queue_full", message, retry)

    async def start(self, stream: Stream, prompt_tokens: int, client: str) -> EventLog:
        """Log the start event (in the store first) and begin pumping the hub stream into the log
        (or, if the bounds were reached while its prompt was tokenized, close the stream and refuse).

        The store's copy of ``start`` leaves the resume token out: the store keeps only its hash."""
        try:
            self.admit(client)
        except ServiceError:
            self.hub.close(stream)
            raise
        log = EventLog(stream.rid, self.capacity, client)
        encoder = StreamEncoder()
        start = encoder.start(stream.rid, self.model_name, prompt_tokens, resume_token=log.token)
        stored = StreamEncoder().start(stream.rid, self.model_name, prompt_tokens)
        try:
            await self.store.create(stream.rid, log.token)
            await self.store.append(stream.rid, Frame("start", stored, encoder.last_id))
        except BaseException as exc:
            self.hub.close(stream)
            if isinstance(exc, StoreUnavailable):
                raise ServiceError(503, "store_unavailable", str(exc)) from None
            raise
        log.append(Frame("start", start, encoder.last_id))
        self._held[client] += 1
        self._logs[stream.rid] = log
        log.pump = asyncio.get_running_loop().create_task(self._pump(stream, encoder, log))
        return log

    async def _pump(self, stream: Stream, encoder: StreamEncoder, log: EventLog) -> None:
        try:
            async for frame in frames(stream, encoder, keepalive=self.store.refresh_s):
                if frame is PING:  # quiet for refresh_s: the run is alive, say so to the store
                    await self.store.alive(stream.rid)
                    continue
                await self.store.append(stream.rid, frame)  # write-ahead: no client holds an id the store lacks
                log.append(frame)
        except StoreUnavailable:
            log.append(Frame("error", encoder.error("internal_error", "internal error"), encoder.last_id))
        finally:
            self.hub.close(stream)
            log.finish()
            self._disarm(log)
            self._arm(log)  # from now on a fixed term: followers no longer stop or restart it
            try:
                await (self.store.forget(stream.rid) if log.expired else self.store.release(stream.rid))
            except StoreUnavailable:
                pass  # the keys expire on their own

    # -- followers ----------------------------------------------------------------------------
    def check_cursor(self, rid: str, token: str | None, cursor: int) -> EventLog | None:
        """The log to follow; None for "finished, nothing left" (204); or raise the refusal."""
        log = self.find(rid, token)
        self._refuse_crowd(log.followers)
        return log if to_follow(log, cursor) else None

    def _crowded(self, followers: int, client: str | None = None) -> str | None:
        """Why one more follower is refused: its stream's cap, or (a ``client`` following from the
        store) the store's readers, all of them or this client's share of them, as for runs."""
        if followers >= MAX_FOLLOWERS:
            return CROWDED
        if client is None:
            return None
        readers, share = self.store.readers, self.limits.share
        if sum(self._stored.values()) >= readers:
            return f"the resume store serves {readers} followers at once, the most"
        if self._readers[client] >= max(1, int(readers * share)):
            return (f"this client follows {self._readers[client]} streams from the resume store, its share of "
                    f"the store's {readers} readers (resumable_share {share}); try again later")  # fmt: skip
        return None

    def _refuse_crowd(self, followers: int, client: str | None = None) -> None:
        if why := self._crowded(followers, client):
            raise ServiceError(429, "queue_full", why, {"Retry-After": str(self.limits.retry_after_s)})

    async def check_stored(self, rid: str, token: str | None, cursor: int, client: str) -> StoredLog | None:
        """:meth:`check_cursor` for a stream this process does not hold, asked of the store."""
        try:
            log = None if token is None else await self.store.find(rid, token)
        except StoreUnavailable as exc:
            raise ServiceError(503, "store_unavailable", str(exc)) from None
        if log is None:
            self.find(rid, None)  # raises the very 404 of an unknown id
        assert log is not None
        self._refuse_crowd(self._stored[rid], client)
        return log if to_follow(log, cursor) else None

    async def follow_stored(self, log: StoredLog, cursor: int, client: str) -> AsyncIterator[bytes]:
        """Replay and follow a stored log; a store that fails mid-way cuts the stream (the client
        resumes); an error event if more followers came between their checks and here."""
        if why := self._crowded(self._stored[log.rid], client):
            yield error_event("queue_full", why)
            return
        self._stored[log.rid] += 1
        self._readers[client] += 1
        try:
            async with contextlib.aclosing(self.store.follow(log, cursor, self.keepalive)) as frames:
                while (frame := await self._next_unless_draining(frames)) is not DRAINING:
                    yield PING.data if frame is None else wire_bytes(frame, self.pad_bytes)  # type: ignore[arg-type]
                yield error_event("shutdown", "this server is shutting down; the run goes on: resume it elsewhere")
        except (StoreUnavailable, StopAsyncIteration):
            return
        finally:
            for counter, key in ((self._stored, log.rid), (self._readers, client)):
                counter[key] -= 1
                if not counter[key]:
                    del counter[key]

    async def _next_unless_draining(self, frames: AsyncGenerator[Frame | None, None]) -> object:
        """The store's next frame, or :data:`DRAINING` once this server drains: the run goes on
        where it runs, so the follower is told so (an ``error`` without an id, which the log's
        next event would need) instead of being cut with its connection (a review)."""
        if self._draining.is_set():
            return DRAINING
        step, drained = asyncio.ensure_future(anext(frames)), asyncio.ensure_future(self._draining.wait())
        try:
            await asyncio.wait({step, drained}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            drained.cancel()
            if not step.done():
                step.cancel()
                await asyncio.wait({step})  # the reader's own finally runs before its generator is closed
        return DRAINING if step.cancelled() else step.result()

    async def drain(self, grace: float) -> None:
        """The server drains: its followers of stored logs end with ``error: shutdown``; wait up
        to ``grace`` for them to be sent (the connections still open then are cut)."""
        self._draining.set()
        deadline = time.monotonic() + grace
        while self._stored and time.monotonic() < deadline:
            await asyncio.sleep(0.02)

    async def follow(self, log: EventLog, cursor: int) -> AsyncIterator[bytes]:
        """Replay what is after ``cursor``, then follow live until the terminal event; an error
        event if more followers came between their checks and here (the check raced)."""
        if why := self._crowded(log.followers):
            yield error_event("queue_full", why)
            return
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
        if not log.finished:
            self._disarm(log)

    def _detach(self, log: EventLog) -> None:
        log.followers -= 1
        if log.followers == 0:
            self._arm(log)

    def _arm(self, log: EventLog) -> None:
        if log.timer is None and self._logs.get(log.rid) is log:
            log.timer = asyncio.get_running_loop().call_later(self.grace, self._expire, log)

    def _disarm(self, log: EventLog) -> None:
        if log.timer is not None:
            log.timer.cancel()
            log.timer = None

    def _expire(self, log: EventLog) -> None:
        log.timer = None
        if log.followers and not log.finished:
            return
        if log.finished or self.store.refresh_s is None:  # no other server can be following it
            self._drop(log)
        elif log.check is None:  # (one still asking decides for this grace too)
            log.check = asyncio.get_running_loop().create_task(self._drop_unless_watched(log))

    async def _drop_unless_watched(self, log: EventLog) -> None:
        """A follower on a server sharing the store keeps the run, as one here does: another grace."""
        try:
            watched = await self.store.watched(log.rid)
        except Exception:  # noqa: BLE001 - nobody can tell (StoreUnavailable, a closed client): the grace is the bound
            watched = False
        finally:
            log.check = None
        if log.timer is not None or (log.followers and not log.finished):
            return  # it finished, or a follower came here, while the store was asked
        if watched:
            self._arm(log)
        else:
            self._drop(log)

    def _drop(self, log: EventLog) -> None:
        if self._logs.get(log.rid) is log:  # a follower still replaying keeps its own reference
            del self._logs[log.rid]
            self._held[log.client] -= 1
            if not self._held[log.client]:
                del self._held[log.client]
        if log.pump is not None and not log.pump.done():
            log.expired = True
            log.pump.cancel()  # its finally closes the hub stream, which cancels the request

    async def aclose(self) -> None:
        """Stop every pump and timer (server shutdown, after the hub has drained). The logs leave
        ``_logs`` first, so a pump's ``finally`` or a follower's detach cannot arm a new timer."""
        logs, self._logs = list(self._logs.values()), {}
        self._held.clear()
        for log in logs:
            if log.timer is not None:
                log.timer.cancel()
            if log.check is not None:
                log.check.cancel()
            if log.pump is not None:
                log.pump.cancel()
        tasks = [task for log in logs for task in (log.pump, log.check) if task is not None]
        await asyncio.gather(*tasks, return_exceptions=True)
        await self.store.aclose()


def error_event(type: str, why: str) -> bytes:
    """An ``error`` event with no id: more followers came between a check and its start
    (``queue_full``), or this server drains while the run goes on elsewhere (``shutdown``)."""
    return ServerSentEvent(data=json.dumps(error_envelope(type, why)), event="error").encode()


def to_follow(log: EventLog | StoredLog, cursor: int) -> bool:
    """True: follow ``log`` after ``cursor``; False: it finished and nothing is after it (204);
    or raise the refusal (422 an id that does not exist, 410 one already evicted)."""
    if cursor > log.last_id:
        raise ServiceError(422, "invalid_request", f"event {cursor} does not exist; the last is {log.last_id}")
    if log.finished and cursor == log.last_id:
        return False
    if cursor < log.first_id - 1:
        raise ServiceError(410, "gone", f"events after {cursor} were evicted; the log starts at {log.first_id}")
    return True


def _same(given: str, expected: str) -> bool:
    """Constant-time comparison (any text: compare_digest refuses non-ASCII str)."""
    return hmac.compare_digest(given.encode("utf-8", "surrogatepass"), expected.encode("utf-8"))


def parse_cursor(last_event_id: str | None, after: str | None) -> int:
    """The cursor, from ``Last-Event-ID`` (quoted :func:`as_sent` when refused) or from
    ``?after=``; 0 when neither is given."""
    raw = as_sent(last_event_id) if last_event_id else after
    if raw is None or raw == "":
        return 0
    digits = raw.strip()
    # isdigit() alone would pass "²" and other digits int() refuses; 18 digits outnumber any log
    if not (digits.isascii() and digits.isdigit()) or len(digits) > 18:
        raise ServiceError(422, "invalid_request", f"event id must be a non-negative integer, got {clip(raw)!r}")
    return int(digits)


@dataclass(frozen=True)
class Resume:
    """What a resume asks: the event to follow after, and the token it carries."""

    cursor: int
    token: str | None


async def resume_asked(
    last_event_id: str | None = Header(default=None),
    x_resume_token: str | None = Header(default=None),
    after: str | None = Query(default=None),
    token: str | None = Query(default=None),
) -> Resume:
    """The cursor (``Last-Event-ID`` or ``?after=``) and the token (``X-Resume-Token`` or ``?token=``).
    ``async``: FastAPI runs a plain ``def`` dependency in the thread pool, a thread per request."""
    return Resume(parse_cursor(last_event_id, after), x_resume_token or token)


Asked = Annotated[Resume, Depends(resume_asked)]  # a route's parameter: the resume it was asked for


@router.get("/v1/streams/{request_id}/events", response_class=Response, responses=openapi.RESUME)
async def resume_events(request: Request, request_id: str, asked: Asked) -> Response:
    service = request.app.state.service
    cursor, given = asked.cursor, asked.token
    if service.resume.get(request_id) is None:  # not run here: perhaps by a server before this one
        client = request.client.host if request.client else ""
        stored = await service.resume.check_stored(request_id, given, cursor, client)
        if stored is None:
            return Response(status_code=204)
        body = service.resume.follow_stored(stored, cursor, client)
        return sse_response(body, service.config.response_class, request_id=request_id)
    log = service.resume.check_cursor(request_id, given, cursor)
    if log is None:
        return Response(status_code=204)
    return sse_response(service.resume.follow(log, cursor), service.config.response_class, request_id=request_id)
