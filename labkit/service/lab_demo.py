"""The browser demo (lab routes only): a page that streams, and a resume route that can drop.

``GET /lab/demo``: a static page (``static/demo.html``, no CDN) with two panels. The first
POSTs a resumable request with ``fetch``, takes its ``X-Request-ID`` and ``X-Resume-Token``,
lets that response go (the run outlives its connection for ``resume_grace``) and follows the
stream with ``EventSource``; the second streams a plain POST with ``fetch`` and a reader. Both
show the text as it arrives and record every event's id and arrival time in
``window.labkitDemo``, which a driver (Selenium) reads.

``GET /lab/demo/events/{request_id}``: the resumable GET route (same token, same
``Last-Event-ID``, same 204/404/410/422 before the response starts) with two lab additions:
``?retry=MS`` sends an SSE ``retry:`` field first, which sets the browser's reconnect delay, and
``?drop_after=N`` closes the connection, without ending the response, after event ``N`` when the
connection began before it: a network failure mid-stream, while the run goes on into its log.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Query, Request
from fastapi.responses import HTMLResponse, Response
from starlette.types import Receive, Scope, Send

from labkit.service.connections import TRANSPORT_KEY
from labkit.service.responses import SSE_HEADERS, SSE_MEDIA_TYPE, ClosingStreamingResponse
from labkit.service.resume import Asked

router = APIRouter()
PAGE = Path(__file__).with_name("static") / "demo.html"
MAX_RETRY_MS = 60_000


class DroppedConnection(Exception):
    """Raised inside the body to say: close the socket here, send nothing more."""


@router.get("/lab/demo", response_class=HTMLResponse)
async def demo_page() -> HTMLResponse:
    return HTMLResponse(PAGE.read_text(encoding="utf-8"), headers={"Cache-Control": "no-store"})


@router.get("/lab/demo/events/{request_id}", response_class=Response)
async def demo_events(
    request: Request,
    request_id: str,
    asked: Asked,
    retry: int | None = Query(default=None, ge=0, le=MAX_RETRY_MS),
    drop_after: int | None = Query(default=None, ge=1),
) -> Response:
    service = request.app.state.service
    cursor = asked.cursor
    log = service.resume.check_cursor(request_id, asked.token, cursor)
    if log is None:
        return Response(status_code=204)
    drop = drop_after if drop_after is not None and cursor < drop_after else None
    body = _events(service.resume.follow(log, cursor), retry, drop)
    headers = {**SSE_HEADERS, "X-Request-ID": request_id}
    return DroppingResponse(body, media_type=SSE_MEDIA_TYPE, headers=headers)


async def _events(follow: AsyncIterator[bytes], retry: int | None, drop: int | None) -> AsyncIterator[bytes]:
    if retry is not None:
        yield f"retry: {retry}\n\n".encode()
    try:
        async for chunk in follow:
            yield chunk
            if drop is not None and _last_id(chunk) >= drop:
                raise DroppedConnection
    finally:
        await follow.aclose()  # type: ignore[attr-defined]  # detach from the log at once


def _last_id(chunk: bytes) -> int:
    ids = [line[3:].strip() for line in chunk.split(b"\n") if line.startswith(b"id:")]
    return int(ids[-1]) if ids and ids[-1].isdigit() else -1


class DroppingResponse(ClosingStreamingResponse):
    """A stream whose body may ask to drop the connection: the socket is closed after what was
    written, with no final chunk, so the client sees a cut stream (as on a network failure).

    The service's connection protocol puts its transport in the scope (``TRANSPORT_KEY``);
    closing it is what a lab route may do and a production route should not.
    """

    transport: Any = None

    async def _serve(self, scope: Scope, receive: Receive, send: Send) -> None:
        self.transport = scope.get(TRANSPORT_KEY)
        await super()._serve(scope, receive, send)

    async def stream_response(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        try:
            async for chunk in self.body_iterator:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        except DroppedConnection:
            if self.transport is None:  # another server: end the response (the client still reconnects)
                await send({"type": "http.response.body", "body": b"", "more_body": False})
                return
            self.transport.close()  # flushes what was written, then FIN; no chunked terminator
            # Starlette's disconnect listener cancels this task once uvicorn sees the close; the
            # bound keeps a server without one from waiting forever.
            await asyncio.sleep(1.0)
            return
        await send({"type": "http.response.body", "body": b"", "more_body": False})
